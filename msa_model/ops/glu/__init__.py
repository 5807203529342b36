"""The GLU activation with routing probabilities: `glu(h, probs, alpha, offset)` (reference.py
defines it; triton.py fuses the forward and the backward, which the grouped experts call
directly: msa_model/model/experts.py; `glu` is the autograd op the dense MLPs take: msa_model/model/mlp.py)."""

from __future__ import annotations

import torch

from .reference import glu_reference
from .triton import glu_backward_triton, glu_forward_triton


class _GluTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, probs, alpha, offset):
        ctx.save_for_backward(h, probs)
        ctx.args = (alpha, offset)
        return glu_forward_triton(h, probs, alpha, offset)

    @staticmethod
    def backward(ctx, da):
        h, probs = ctx.saved_tensors
        dh, _, dp = glu_backward_triton(h, probs, da, *ctx.args, activation=False)
        return dh, dp, None, None


def glu(h_N2F: torch.Tensor, probs_N: torch.Tensor | None = None, alpha: float = 1.0, offset: float = 0.0,
        backend: str = "auto") -> torch.Tensor:
    """act(gate) (up + offset) p, act(x) = x sigmoid(alpha x): a [N, F] in h's dtype from h [N, 2F]
    and probs [N] (None: 1), differentiable in h and probs. backend "auto" fuses on CUDA."""
    if backend == "reference" or (backend == "auto" and not h_N2F.is_cuda):
        return glu_reference(h_N2F, probs_N, alpha, offset)
    return _GluTriton.apply(h_N2F, probs_N, alpha, offset)


__all__ = ["glu", "glu_reference", "glu_forward_triton", "glu_backward_triton"]
