"""megatron's dense MLP and shared experts with the GLU as one fused kernel each way.

megatron's MLP without Transformer Engine (and with `bias_activation_fusion` off, as we build
it) runs the GLU act(gate) * (up + offset) as separate PyTorch passes over [tokens, 2F], which
autograd keeps and walks back one by one. `FusedGLUMLP` is that MLP (same parameters, names,
sharded state dict and tensor parallel layout: each rank's fc1 output is its own [gate, up]
halves) whose forward on CUDA tensors takes `msa_model.ops.glu` instead: one kernel forward,
one backward, fc1's output the GLU's only saved activation. Where the kernel does not apply (CPU
tensors, clamps, biases, other activations, Transformer Engine activations, a per-token
scale) it is megatron's forward unchanged. `FusedGLUSharedExpertMLP` is megatron's shared
expert (its gate and overlap untouched) over the same forward.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

from msa_model.model.experts import fused_glu
from msa_model.ops.glu import glu


class FusedGLUMLP(MLP):
    """MLP whose GLU is the fused kernel where it applies (module docstring)."""

    # CPU tensors take the kernel too (in Triton's interpreter): for tests
    fused_on_cpu = False

    def forward(self, hidden_states: torch.Tensor, per_token_scale: torch.Tensor | None = None, **kwargs):
        fused = self._fused_glu(hidden_states, per_token_scale)
        if fused is None:
            return super().forward(hidden_states, per_token_scale, **kwargs)
        h, _ = self.linear_fc1(hidden_states)
        a = glu(h.reshape(-1, h.shape[-1]), None, *fused, backend="triton").view(*h.shape[:-1], h.shape[-1] // 2)
        return self.linear_fc2(a)

    def _fused_glu(self, x: torch.Tensor, per_token_scale) -> tuple[float, float] | None:
        config = self.config
        if (not (x.is_cuda or self.fused_on_cpu) or per_token_scale is not None or not config.gated_linear_unit
                or config.add_bias_linear or config.use_te_activation_func or config.bias_activation_fusion):
            return None
        return fused_glu(config)


class FusedGLUSharedExpertMLP(SharedExpertMLP, FusedGLUMLP):
    """megatron's SharedExpertMLP whose MLP forward (its `super().forward`) is FusedGLUMLP's."""


def _shared_experts(megatron_builder, *, config, pg_collection, gate: bool, submodules, name: str | None = None):
    """The shared experts megatron's builder would make, with the fused GLU where that is its
    SharedExpertMLP (not its grouped-GEMM variant)."""
    if getattr(config, "use_grouped_gemm_for_shared_expert", False):
        return megatron_builder(config=config, pg_collection=pg_collection, gate=gate, submodules=submodules, name=name)
    return FusedGLUSharedExpertMLP(config=config, submodules=submodules, gate=gate, pg_collection=pg_collection,
                                   name=name)


def with_fused_glu(layer_spec):
    """The layer spec with megatron's MLP builders (the dense MLP, a MoE block's shared experts)
    replaced by the fused-GLU ones, their submodules kept; other MLP blocks are left alone."""
    mlp = layer_spec.submodules.mlp
    if not isinstance(mlp, functools.partial):
        return layer_spec
    if getattr(mlp.func, "__func__", None) is MLP.as_mlp_submodule.__func__ and mlp.func.__self__ is MLP:
        layer_spec.submodules.mlp = functools.partial(FusedGLUMLP.as_mlp_submodule, *mlp.args, **mlp.keywords)
        return layer_spec
    moe = mlp.keywords.get("submodules")
    shared = getattr(moe, "shared_experts", None)
    if isinstance(shared, functools.partial) and getattr(shared.func, "__name__", "") == "_build_shared_experts":
        shared = functools.partial(_shared_experts, shared.func, *shared.args, **shared.keywords)
        layer_spec.submodules.mlp = functools.partial(
            mlp.func, *mlp.args, **{**mlp.keywords, "submodules": dataclasses.replace(moe, shared_experts=shared)})
    return layer_spec
