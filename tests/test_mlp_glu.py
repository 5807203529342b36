"""The dense MLP and the shared experts with the fused GLU (msa_model.model.mlp) against megatron's own
modules with the same weights: output and every gradient. The model builds them in place of
megatron's. CPU: fp32 through Triton's interpreter; CUDA: bf16 within 2x megatron's own error
(both against megatron's module in fp64)."""

from __future__ import annotations

import pytest
import torch

from msa_model.ops.triton_utils import interpreting

CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not CUDA and not interpreting(),
                                reason="the fused GLU on CPU needs Triton's interpreter")


@pytest.fixture(scope="module")
def megatron_one_rank():
    from msa_model.config import ParallelConfig
    from msa_model.training.distributed import init_distributed, shutdown

    init_distributed(ParallelConfig(), "cuda" if CUDA else "cpu", 1234)
    yield
    shutdown()


def _model_cfg(**kw):
    from omegaconf import OmegaConf

    from msa_model.config import ModelConfig

    base = dict(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
                head_dim=16, seq_length=64, num_experts=4, moe_ffn_hidden_size=32, moe_shared_expert_size=48,
                first_dense_layers=1)
    return OmegaConf.structured(ModelConfig(**{**base, **kw}))


def _pair(kind: str, activation: str):
    """Builders of (ours, megatron's), and weights for both."""
    from megatron.core.models.gpt.moe_module_specs import _build_shared_experts
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules

    from msa_model.config import ParallelConfig
    from msa_model.model.mlp import FusedGLUMLP, _shared_experts
    from msa_model.model.gpt import transformer_config
    from megatron.core.transformer.moe.moe_layer import get_default_pg_collection

    offset = 1.0 if activation == "quick_geglu" else 0.0
    config = transformer_config(_model_cfg(activation=activation, glu_linear_offset=offset), ParallelConfig(),
                                on_cpu=not CUDA)
    sub = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    if kind == "dense":
        ours = lambda: FusedGLUMLP(config, sub, ffn_hidden_size=config.ffn_hidden_size)  # noqa: E731
        theirs = lambda: MLP(config, sub, ffn_hidden_size=config.ffn_hidden_size)  # noqa: E731
    else:
        pg = get_default_pg_collection()
        ours = lambda: _shared_experts(_build_shared_experts, config=config, pg_collection=pg, gate=True,  # noqa: E731
                                       submodules=sub)
        theirs = lambda: _build_shared_experts(config=config, pg_collection=pg, gate=True, submodules=sub)  # noqa: E731
    return ours, theirs, ours().state_dict()


def _grads(make, weights, x, dy, dtype, device):
    module = make()
    module.load_state_dict(weights)
    module = module.to(device=device, dtype=dtype)
    x = x.to(device=device, dtype=dtype).requires_grad_()
    out = module(x)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(dy.to(device=device, dtype=dtype))
    return [out.detach().double().cpu(), x.grad.double().cpu()] + [
        p.grad.double().cpu() for _, p in sorted(module.named_parameters())]


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


@pytest.mark.parametrize("kind", ["dense", "shared"])
@pytest.mark.parametrize("activation", ["swiglu", "quick_geglu"])
def test_fused_glu_mlp_matches_megatron(megatron_one_rank, monkeypatch, kind, activation):
    import msa_model.model.mlp as mlp

    calls = []
    fused = mlp.glu
    monkeypatch.setattr(mlp, "glu", lambda *a, **k: calls.append(1) or fused(*a, **k))
    monkeypatch.setattr(mlp.FusedGLUMLP, "fused_on_cpu", not CUDA)
    ours, theirs, weights = _pair(kind, activation)
    g = torch.Generator().manual_seed(7)
    x, dy = torch.randn(6, 2, 64, generator=g), torch.randn(6, 2, 64, generator=g)
    want = _grads(theirs, weights, x, dy, torch.float64, "cpu")
    device, dtype = ("cuda", torch.bfloat16) if CUDA else ("cpu", torch.float32)
    got = _grads(ours, weights, x, dy, dtype, device)
    assert calls, "the fused GLU was not used"
    errs = [_rel(a, b) for a, b in zip(got, want)]
    if not CUDA:
        assert max(errs) < 1e-5, errs
        return
    base = [_rel(a, b) for a, b in zip(_grads(theirs, weights, x, dy, dtype, device), want)]
    for e, b in zip(errs, base):
        assert e <= 2 * b + 1e-4, (errs, base)


def test_model_builds_the_fused_glu_modules(megatron_one_rank):
    from msa_model.config import ParallelConfig
    from msa_model.model.mlp import FusedGLUMLP, FusedGLUSharedExpertMLP
    from msa_model.model.gpt import build_model

    model = build_model(_model_cfg(), ParallelConfig(), 257, on_cpu=not CUDA)
    dense, moe = model.decoder.layers
    assert type(dense.mlp) is FusedGLUMLP
    assert type(moe.mlp.shared_experts) is FusedGLUSharedExpertMLP
