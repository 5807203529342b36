"""Fused GLU activation with routing probabilities (reference.py has the definition).

Forward: one read of fc1's output h [N, 2F], one write of a [N, F]. Backward: one read of h and
da, writing d h, the activation a again where asked (the grouped experts' fc2 weight gradient
needs it; their forward's is not kept) and d p; a program takes RB rows and walks their F columns in steps of CB, summing d p in
fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _act(g, ALPHA: tl.constexpr):
    sg = tl.sigmoid(ALPHA * g)
    return g * sg, sg


@triton.jit
def glu_fwd_kernel(h_ptr, p_ptr, a_ptr, N, OFFSET, F: tl.constexpr, ALPHA: tl.constexpr, PROBS: tl.constexpr,
                   RB: tl.constexpr, CB: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * RB + tl.arange(0, RB)
    c = tl.program_id(1) * CB + tl.arange(0, CB)
    m = (r < N)[:, None] & (c < F)[None, :]
    src = h_ptr + r[:, None] * (2 * F) + c[None, :]
    g = tl.load(src, mask=m, other=0.0).to(tl.float32)
    u = tl.load(src + F, mask=m, other=0.0).to(tl.float32)
    act, _ = _act(g, ALPHA)
    a = act * (u + OFFSET)
    if PROBS:
        a = a * tl.load(p_ptr + r, mask=r < N, other=0.0).to(tl.float32)[:, None]
    tl.store(a_ptr + r[:, None] * F + c[None, :], a.to(a_ptr.dtype.element_ty), mask=m)


@triton.jit
def glu_bwd_kernel(h_ptr, p_ptr, da_ptr, dh_ptr, a_ptr, dp_ptr, N, OFFSET, F: tl.constexpr, ALPHA: tl.constexpr,
                   PROBS: tl.constexpr, WRITE_A: tl.constexpr, RB: tl.constexpr, CB: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * RB + tl.arange(0, RB)
    rm = r < N
    if PROBS:
        p = tl.load(p_ptr + r, mask=rm, other=0.0).to(tl.float32)
    else:
        p = tl.full([RB], 1.0, tl.float32)
    dp = tl.zeros([RB], tl.float32)
    for c0 in range(0, F, CB):
        c = c0 + tl.arange(0, CB)
        m = rm[:, None] & (c < F)[None, :]
        src = h_ptr + r[:, None] * (2 * F) + c[None, :]
        g = tl.load(src, mask=m, other=0.0).to(tl.float32)
        v = tl.load(src + F, mask=m, other=0.0).to(tl.float32) + OFFSET
        da = tl.load(da_ptr + r[:, None] * F + c[None, :], mask=m, other=0.0).to(tl.float32)
        act, sg = _act(g, ALPHA)
        dact = sg + ALPHA * g * sg * (1.0 - sg)
        dp += tl.sum(da * act * v, axis=1)
        dst = dh_ptr + r[:, None] * (2 * F) + c[None, :]
        tl.store(dst, (da * p[:, None] * v * dact).to(dh_ptr.dtype.element_ty), mask=m)
        tl.store(dst + F, (da * p[:, None] * act).to(dh_ptr.dtype.element_ty), mask=m)
        if WRITE_A:
            tl.store(a_ptr + r[:, None] * F + c[None, :], (act * v * p[:, None]).to(a_ptr.dtype.element_ty), mask=m)
    if PROBS:
        tl.store(dp_ptr + r, dp, mask=rm)


def _rows(h):
    if h.dim() != 2 or h.shape[1] % 2:
        raise ValueError(f"glu: fc1's output must be [N, 2F], got {tuple(h.shape)}")
    return h.contiguous(), h.shape[0], h.shape[1] // 2


def glu_forward_triton(h_N2F: torch.Tensor, probs_N: torch.Tensor | None, alpha: float = 1.0,
                       offset: float = 0.0) -> torch.Tensor:
    """a [N, F] in h's dtype."""
    h, N, F = _rows(h_N2F)
    a = torch.empty(N, F, dtype=h.dtype, device=h.device)
    if a.numel():
        RB, CB = 4, 512
        p = h if probs_N is None else probs_N.contiguous()
        glu_fwd_kernel[(triton.cdiv(N, RB), triton.cdiv(F, CB))](
            h, p, a, N, float(offset), F=F, ALPHA=float(alpha), PROBS=probs_N is not None, RB=RB, CB=CB, num_warps=4)
    return a


def glu_backward_triton(h_N2F: torch.Tensor, probs_N: torch.Tensor | None, da_NF: torch.Tensor,
                        alpha: float = 1.0, offset: float = 0.0, activation: bool = True):
    """(d h [N, 2F] in h's dtype, a [N, F] in h's dtype, d p fp32 [N] or None); with
    activation=False, a is None (not written)."""
    h, N, F = _rows(h_N2F)
    da = da_NF.contiguous()
    dh = torch.empty_like(h)
    a = torch.empty(N, F, dtype=h.dtype, device=h.device) if activation else None
    dp = None if probs_N is None else torch.empty(N, dtype=torch.float32, device=h.device)
    if N and F:
        RB, CB = 4, 512
        p = h if probs_N is None else probs_N.contiguous()
        glu_bwd_kernel[(triton.cdiv(N, RB),)](
            h, p, da, dh, h if a is None else a, h if dp is None else dp, N, float(offset), F=F, ALPHA=float(alpha),
            PROBS=probs_N is not None, WRITE_A=activation, RB=RB, CB=CB, num_warps=4)
    return dh, a, dp
