"""Rotary position embedding: `rope(t, freqs)` (reference.py defines it; triton.py fuses it)."""

from __future__ import annotations

import torch

from .reference import rope_reference
from .triton import rope_triton


class _RopeTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, freqs):
        ctx.save_for_backward(freqs)
        return rope_triton(t, freqs)

    @staticmethod
    def backward(ctx, dy):
        (freqs,) = ctx.saved_tensors
        return rope_triton(dy, freqs, backward=True), None


def rope(t_SBHD: torch.Tensor, freqs_SB1R: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """t [S, B, H, D] rotated by freqs fp32 [S, 1 or B, 1, R] (R <= D, even): y [S, B, H, D] in t's
    dtype, differentiable in t. backend "auto" fuses on CUDA, "reference" / "triton" force one."""
    S, B, H, D = t_SBHD.shape
    R = freqs_SB1R.shape[-1]
    if R % 2 or R > D or freqs_SB1R.dim() != 4 or freqs_SB1R.shape[0] != S or freqs_SB1R.shape[1] not in (1, B) \
            or freqs_SB1R.shape[2] != 1:
        raise ValueError(f"rope: freqs {tuple(freqs_SB1R.shape)} do not fit t {tuple(t_SBHD.shape)} "
                         "(need [S, 1 or B, 1, R], R even and at most D)")
    if backend == "reference" or (backend == "auto" and not t_SBHD.is_cuda):
        return rope_reference(t_SBHD, freqs_SB1R)
    return _RopeTriton.apply(t_SBHD, freqs_SB1R)


__all__ = ["rope", "rope_reference", "rope_triton"]
