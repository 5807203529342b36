"""Rotary position embedding, the definition (megatron's unfused `bshd` RoPE, in fp32).

t [S, B, H, D], freqs fp32 [S, 1 or B, 1, R] (R <= D, even; the angles of each position and
channel, both halves as megatron's RotaryEmbedding makes them). With t = (t1, t2, t_pass)
split at R/2 and R, and (c1, c2), (s1, s2) the cosines and sines of freqs' two halves:

    y1 = t1 c1 - t2 s1        y2 = t2 c2 + t1 s2        y_pass = t_pass

computed in fp32 and rounded once to t's dtype (megatron rounds cos and sin to t's dtype first
and rounds each product; the fused kernel follows this definition).
"""

from __future__ import annotations

import torch


def rope_reference(t_SBHD: torch.Tensor, freqs_SB1R: torch.Tensor) -> torch.Tensor:
    R = freqs_SB1R.shape[-1]
    x = t_SBHD[..., :R].float()
    f = freqs_SB1R.float()
    rotated = torch.cat((-x[..., R // 2:], x[..., :R // 2]), dim=-1)
    y = x * torch.cos(f) + rotated * torch.sin(f)
    return torch.cat((y.to(t_SBHD.dtype), t_SBHD[..., R:]), dim=-1)
