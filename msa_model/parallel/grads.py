"""The attention layers' gradient adjustments for tensor (TP) and context (CP) parallelism, in one
place: with them every parameter's gradient equals one process's (docs/parallelism.md).

Tensor parallel: whole GQA groups per rank (query heads, kv heads and index queries split alike;
TP must divide Hkv), the shared index key duplicated. Each rank's KL is the mean over its own
groups, so the model's KL is the mean of the ranks' values:
- `scale_for_tp_mean`: this rank's index queries, and through them index_q_proj and the index-q
  norm (whose gradient megatron sums over TP), get 1/TP of the local KL's gradient;
- `DuplicatedLinear`, `average_over_tp`: the duplicated index-key weights average their gradients
  over TP (megatron's finalize_model_grads, `average_gradients_across_tp_domain`).
Context parallel (msa_model.parallel.context_parallel gathers the keys): `attach_kl` divides each rank's KL
by CP, because megatron multiplies its loss scale for auxiliary losses by CP.
Per-step metrics are per-rank means over the rank's groups and queries: `metrics_group` is the
TP x CP group that averages them into the layer's value.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler


class DuplicatedLinear(torch.nn.Module):
    """A bias-free linear layer whose weight is replicated on every tensor-parallel rank.

    Megatron-style interface: forward returns (output, None). Under sequence parallelism the
    input arrives split along S and is gathered first. Gradients are averaged over the TP group
    by megatron's finalize_model_grads (`average_gradients_across_tp_domain`).
    """

    def __init__(self, input_size: int, output_size: int, *, config, init_method, tp_group=None):
        super().__init__()
        self.config = config
        self.tp_group = tp_group
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype, device=device))
        if config.perform_initialization:
            # the CPU generator draws the same numbers on every TP rank, keeping replicas equal
            with torch.no_grad():
                master = torch.empty(output_size, input_size, dtype=torch.float32)
                init_method(master)
                self.weight.copy_(master)
        average_over_tp(self)

    def forward(self, x_SBH: torch.Tensor):
        if self.config.sequence_parallel and self.tp_group is not None and self.tp_group.size() > 1:
            x_SBH = gather_from_sequence_parallel_region(x_SBH, group=self.tp_group)
        return F.linear(x_SBH, self.weight), None


def average_over_tp(module: torch.nn.Module) -> None:
    """Mark a module replicated on every TP rank: finalize_model_grads averages its gradients."""
    for p in module.parameters():
        p.average_gradients_across_tp_domain = True


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by `factor`."""

    @staticmethod
    def forward(ctx, x, factor: float):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def scale_for_tp_mean(x: torch.Tensor, tp_group) -> torch.Tensor:
    """x unchanged; its gradient scaled by 1/TP (the model's KL is the mean of the TP ranks')."""
    tp = tp_group.size()
    return _ScaleGrad.apply(x, 1.0 / tp) if tp > 1 else x


def attach_kl(output: torch.Tensor, kl: torch.Tensor, kl_coeff: float, cp_group) -> torch.Tensor:
    """`output` unchanged; in backward the gradient of kl_coeff * KL enters at it, scaled like the
    loss. megatron multiplies that scale by CP (right for losses it reduces over CP itself), while
    each rank's KL is its local mean: CP is divided back out."""
    return MoEAuxLossAutoScaler.apply(output, kl * (kl_coeff / cp_group.size()))


def metrics_group(pg_collection):
    """The TP x CP group whose mean of per-rank values is the layer's value."""
    group = getattr(pg_collection, "tp_cp", None)
    return group if group is not None else parallel_state.get_tensor_and_context_parallel_group()
