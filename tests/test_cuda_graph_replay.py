"""model.msa.cuda_graph's bookkeeping around a replay, on CPU: torch.cuda.make_graphed_callables
stands in as a capture that runs the core once and replays that give its outputs without running
the core again (what a CUDA graph does: kernels, no Python). The graphs' numbers on a GPU are
tests/test_cuda_graph_gpu.py's."""

from __future__ import annotations

import pytest
import torch

from msa_model.model.attention import MSAOptions, MSASelfAttention, msa_settings


def _fake_make_graphed_callables(body, samples, pool=None, **options):
    """Runs `body` once on the samples (the capture); a replay returns o from its q (so q's
    gradient, and its hooks, come with the backward) and the capture's KL and keys."""
    POOLS.append(pool)
    _, kl, keys = body(*samples)
    return lambda q, *rest: (q * 2.0, kl, keys)


POOLS = []  # the memory pool each capture was given


def _layer(monkeypatch):
    """An MSASelfAttention with the state `_graphed_core` reads, a stub core that (like the op)
    takes the KL's teacher from the backward when a backward follows (grad enabled) and from the
    forward otherwise, and a list of the KLs it records after a backward."""
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", _fake_make_graphed_callables)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", object)
    POOLS.clear()
    layer = MSASelfAttention.__new__(MSASelfAttention)
    torch.nn.Module.__init__(layer)
    layer.settings, layer._graphs, layer._late_kl = msa_settings(MSAOptions(), None), {}, False
    layer._graph_pool = None
    layer.recorded = []

    def core(q, k, v, iq, ik, doc_start=None, record_late_kl=True):
        layer._late_kl = torch.is_grad_enabled()
        return q * 2.0, (iq.float() ** 2).mean(), torch.ones(())

    layer._core, layer._record_kl = core, layer.recorded.append
    return layer


def _inputs():
    return tuple(torch.randn(1, 8, 2, 4, requires_grad=True) for _ in range(5))


def test_a_replay_keeps_the_late_kl_of_its_capture(monkeypatch):
    """An eager forward between two replays (validation, whose KL comes from the forward) must not
    decide for the replay: its KL is still filled in by the backward, so the forward must not
    record it (it holds NaN there) and the backward must, once."""
    layer = _layer(monkeypatch)
    layer._graphed_core(*_inputs())
    assert layer._late_kl and len(layer.recorded) == 0
    with torch.no_grad():
        layer._core(*_inputs())
    assert not layer._late_kl
    q, *rest = _inputs()
    o, kl, _ = layer._graphed_core(q, *rest)
    assert layer._late_kl and len(layer._graphs) == 1
    o.sum().backward()
    assert len(layer.recorded) == 1 and layer.recorded[0] is kl


def test_a_layers_graphs_share_one_memory_pool(monkeypatch):
    """Each new input shape captures a graph of its own, into the layer's one pool; another layer
    has another pool."""
    first, second = _layer(monkeypatch), _layer(monkeypatch)
    first._graphed_core(*_inputs())
    first._graphed_core(*(torch.randn(1, 16, 2, 4, requires_grad=True) for _ in range(5)))
    first._graphed_core(*_inputs())  # a replay: no capture
    second._graphed_core(*_inputs())
    assert len(POOLS) == 3 and POOLS[0] is POOLS[1] is not None and POOLS[2] is not POOLS[0]


@pytest.fixture(scope="module")
def one_rank():
    from msa_model.config import ParallelConfig
    from msa_model.training.distributed import init_distributed, shutdown

    init_distributed(ParallelConfig(), "cpu", 1234)
    yield
    shutdown()


def _tiny_model(scope: str, di: int):
    from omegaconf import OmegaConf

    from msa_model.config import ModelConfig, ParallelConfig
    from msa_model.model.attention import set_msa_phase
    from msa_model.model.gpt import build_model

    cfg = OmegaConf.structured(ModelConfig(
        num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2, head_dim=16,
        seq_length=128, num_experts=2, moe_ffn_hidden_size=32, first_dense_layers=1, params_dtype="fp32"))
    cfg.msa.block_size, cfg.msa.topk, cfg.msa.index_head_dim = 16, 2, di
    cfg.msa.cuda_graph, cfg.msa.cuda_graph_scope = True, scope
    torch.manual_seed(0)
    model = build_model(cfg, ParallelConfig(), vocab_size=256, on_cpu=True)
    model.train()
    set_msa_phase(model, True)
    return model


# Di 16 = D: the index branch rotates with q's table; Di 8: with a table of its own, a graph input
@pytest.mark.parametrize("di", [16, 8])
def test_the_graphed_block_computes_the_eager_block(one_rank, monkeypatch, di):
    """model.msa.cuda_graph_scope=attention: what a layer's graph captures (the block's body, fed
    the layer's input and RoPE tables) gives the eager layer's loss, every weight's gradient (the
    index branch's and the projections' among them) and KL, with one capture a layer. The capture
    here is the body itself, run eagerly (a CUDA graph's numbers: tests/test_cuda_graph_gpu.py)."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    from msa_model.model.attention import KL_METRIC, msa_layers

    captured = []

    def capture(body, samples, pool=None, **options):
        captured.append(body.func.__name__)
        # the weights come in as inputs: the capture must not reach the parameters themselves
        names = body.args[1]
        assert len(names) > 0 and all(s.is_leaf and s.requires_grad for s in samples[-len(names):])
        return body

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", object)
    monkeypatch.setattr(MSASelfAttention, "_graphable",
                        lambda self, x, doc: self.options.msa.cuda_graph and self.sparse and torch.is_grad_enabled())
    eager, graphed = _tiny_model("core", di), _tiny_model("attention", di)
    for layer in msa_layers(eager):
        layer.options.msa.cuda_graph = False
    graphed.load_state_dict(eager.state_dict())
    tokens = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(128).expand(2, -1)
    results = []
    for model in (eager, graphed):
        get_moe_metrics_tracker().clear()
        model.zero_grad(set_to_none=True)
        loss = model(tokens, positions, None, labels=tokens).float().mean()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((float(loss.detach()), grads, get_moe_metrics_tracker().metrics[KL_METRIC].values.clone()))
    (loss_e, grads_e, kl_e), (loss_g, grads_g, kl_g) = results
    assert captured == ["_block_body"] * len(msa_layers(graphed))
    assert loss_g == pytest.approx(loss_e, rel=1e-6)
    assert grads_g.keys() == grads_e.keys() and any(".index_q_proj." in n for n in grads_g)
    for name, g in grads_e.items():
        assert torch.allclose(grads_g[name], g, rtol=1e-4, atol=1e-6), name
    assert torch.allclose(kl_g, kl_e, rtol=1e-5) and bool((kl_g > 0).any())
