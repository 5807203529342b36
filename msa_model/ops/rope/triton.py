"""Fused rotary position embedding: one read and one write of t, forward and backward.

A program takes one (s, b) row: its H heads x R/2 channel pairs, the row's angles loaded once and
their cosines and sines computed in fp32 (reference.py has the definition). The backward is the
transposed rotation: dt1 = dy1 c1 + dy2 s2, dt2 = dy2 c2 - dy1 s1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def rope_kernel(t_ptr, f_ptr, y_ptr, B, H, st_s, st_b, st_h, sf_s, sf_b,
                D: tl.constexpr, R: tl.constexpr, HB: tl.constexpr, RH: tl.constexpr, DP: tl.constexpr,
                BACKWARD: tl.constexpr):
    # 64-bit offsets: S*B*H*D passes 2^31 past 256K tokens of 64 heads of 128
    row = tl.program_id(0).to(tl.int64)
    s, b = row // B, row % B
    h = tl.program_id(1) * HB + tl.arange(0, HB)
    c = tl.arange(0, RH)
    hm = h < H
    cm = c < R // 2
    f1 = tl.load(f_ptr + s * sf_s + b * sf_b + c, mask=cm, other=0.0).to(tl.float32)
    f2 = tl.load(f_ptr + s * sf_s + b * sf_b + R // 2 + c, mask=cm, other=0.0).to(tl.float32)
    c1, s1, c2, s2 = tl.cos(f1), tl.sin(f1), tl.cos(f2), tl.sin(f2)
    src = t_ptr + s * st_s + b * st_b + h[:, None] * st_h
    # the output is contiguous [S, B, H, D]
    dst = y_ptr + (row * H + h[:, None]) * D
    m = hm[:, None] & cm[None, :]
    x1 = tl.load(src + c[None, :], mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + R // 2 + c[None, :], mask=m, other=0.0).to(tl.float32)
    if BACKWARD:
        y1 = x1 * c1[None, :] + x2 * s2[None, :]
        y2 = x2 * c2[None, :] - x1 * s1[None, :]
    else:
        y1 = x1 * c1[None, :] - x2 * s1[None, :]
        y2 = x2 * c2[None, :] + x1 * s2[None, :]
    tl.store(dst + c[None, :], y1.to(y_ptr.dtype.element_ty), mask=m)
    tl.store(dst + R // 2 + c[None, :], y2.to(y_ptr.dtype.element_ty), mask=m)
    if R < D:
        p = R + tl.arange(0, DP)
        pm = hm[:, None] & (p < D)[None, :]
        tl.store(dst + p[None, :], tl.load(src + p[None, :], mask=pm), mask=pm)


def rope_triton(t_SBHD: torch.Tensor, freqs_SB1R: torch.Tensor, backward: bool = False) -> torch.Tensor:
    """y contiguous [S, B, H, D] in t's dtype (the transposed rotation with backward=True); t may be
    strided except in its last dimension."""
    S, B, H, D = t_SBHD.shape
    R = freqs_SB1R.shape[-1]
    if t_SBHD.stride(-1) != 1:
        t_SBHD = t_SBHD.contiguous()
    f = freqs_SB1R if freqs_SB1R.stride(-1) == 1 else freqs_SB1R.contiguous()
    y = torch.empty(S, B, H, D, dtype=t_SBHD.dtype, device=t_SBHD.device)
    if y.numel() == 0:
        return y
    RH = triton.next_power_of_2(R // 2)
    # heads a program: about 4096 channel pairs
    HB = min(triton.next_power_of_2(H), max(1, 4096 // RH))
    sf_b = f.stride(1) if f.shape[1] > 1 else 0
    rope_kernel[(S * B, triton.cdiv(H, HB))](
        t_SBHD, f, y, B, H, t_SBHD.stride(0), t_SBHD.stride(1), t_SBHD.stride(2), f.stride(0), sf_b,
        D=D, R=R, HB=HB, RH=RH, DP=triton.next_power_of_2(max(1, D - R)), BACKWARD=backward,
        num_warps=4)
    return y
