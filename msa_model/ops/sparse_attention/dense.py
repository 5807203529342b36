"""The dense path of sparse attention (block_idx=None, the indexer warmup): dense causal kernels,
query-tile outer, and their launchers (`dense_forward`, `dense_backward`).

Forward: one program per (query tile of BM, query head), online softmax over key tiles of BN.
Backward: dK/dV shares per (key tile, query head), looping over the query tiles at or after the key
tile (register accumulation), then summed over each group's heads (no atomics); dQ per (query
tile, head).

B = batch, T = queries, TK = keys (query t sits at position QOFF + t; TK = QOFF + T), HQ = query
heads, HKV = key/value heads, H = heads per group, D = head dim.

Packed documents (DOCS): DOC [B, T] holds each query's document start s, and query t reads keys
s .. QOFF + t. Starts do not decrease along a row, so a query tile reads keys from its first
row's start on, and a key tile is read by queries up to QEND [B, key tiles] (the first query
whose document starts after the tile's last key). Every such tile is masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_utils import INTERPRET, LN2, LOG2E, interpreting, mm, row_documents
from .inverse_index import query_ends
from .shared import geometry, softmax_delta
from .tuning import DEFAULT_TUNING, Tuning


@triton.jit
def _fwd_step(q, K, V, b, g, k0, pos, start, TK, m, l, acc, qk_scale, HKV: tl.constexpr, BN: tl.constexpr,
              D: tl.constexpr, MASK: tl.constexpr, DOCS: tl.constexpr):
    d = tl.arange(0, D)
    j = k0 + tl.arange(0, BN)
    kv = ((b * TK + j) * HKV + g) * D
    if MASK:
        kmask = j < TK
        kt = tl.load(K + kv[:, None] + d[None, :], mask=kmask[:, None], other=0.0)
        vt = tl.load(V + kv[:, None] + d[None, :], mask=kmask[:, None], other=0.0)
    else:
        kt = tl.load(K + kv[:, None] + d[None, :])
        vt = tl.load(V + kv[:, None] + d[None, :])
    s = mm(q, tl.trans(kt)) * qk_scale
    if MASK:
        vis = j[None, :] <= pos[:, None]
        if DOCS:
            vis = vis & (j[None, :] >= start[:, None])
        s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    if DOCS:
        # a row whose document starts after this tile has seen no key yet: keep exp2 finite
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    alpha = tl.exp2(m - m_use)
    p = tl.exp2(s - m_use[:, None])
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + mm(p.to(vt.dtype), vt)
    return m_new, l, acc


@triton.jit
def dense_fwd_kernel(Q, K, V, O, LSE, DOC, T, TK, QOFF, qk_scale,
                     HQ: tl.constexpr, HKV: tl.constexpr, H: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, DOCS: tl.constexpr):
    """o [B, T, HQ, D] (q dtype) and lse [B, T, HQ] (fp32, natural log)."""
    mid = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // HQ).to(tl.int64)
    h = bh % HQ
    g = h // H
    tq = mid * BM + tl.arange(0, BM)
    qmask = tq < T
    d = tl.arange(0, D)
    row = (b * T + tq) * HQ + h
    q = tl.load(Q + row[:, None] * D + d[None, :], mask=qmask[:, None], other=0.0)
    m = tl.full([BM], float("-inf"), tl.float32)
    l = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    pos = QOFF + tq
    hi = QOFF + tl.minimum((mid + 1) * BM, T)
    if DOCS:
        # from the tile's first document start on, every tile is masked
        start, k_first = row_documents(DOC + b * T, tq, qmask, mid * BM, BN)
        lo = k_first
    else:
        start = pos
        k_first = 0
        # key tiles that end before the tile's first position need no mask (with QOFF = 0 that
        # is every tile before mid * BM, BM being a multiple of BN)
        lo = (QOFF + mid * BM) // BN * BN
    if not INTERPRET:
        for k0 in range(k_first, lo, BN):
            m, l, acc = _fwd_step(q, K, V, b, g, k0, pos, start, TK, m, l, acc, qk_scale, HKV, BN, D, False, DOCS)
        for k0 in range(lo, hi, BN):
            m, l, acc = _fwd_step(q, K, V, b, g, k0, pos, start, TK, m, l, acc, qk_scale, HKV, BN, D, True, DOCS)
    else:
        k0 = lo * 0 + k_first
        while k0 < lo:
            m, l, acc = _fwd_step(q, K, V, b, g, k0, pos, start, TK, m, l, acc, qk_scale, HKV, BN, D, False, DOCS)
            k0 += BN
        while k0 < hi:
            m, l, acc = _fwd_step(q, K, V, b, g, k0, pos, start, TK, m, l, acc, qk_scale, HKV, BN, D, True, DOCS)
            k0 += BN
    tl.store(O + row[:, None] * D + d[None, :], (acc / l[:, None]).to(O.dtype.element_ty), mask=qmask[:, None])
    tl.store(LSE + row, (m + tl.log2(l)) * LN2, mask=qmask)


@triton.jit
def _dkdv_step(Q, DO, LSE, DELTA, DOC, kt, vt, dk, dv, b, h, m0, j, T, QOFF, qk_scale, HQ: tl.constexpr,
               BM: tl.constexpr, D: tl.constexpr, DOCS: tl.constexpr):
    d = tl.arange(0, D)
    tq = m0 + tl.arange(0, BM)
    qmask = tq < T
    row = (b * T + tq) * HQ + h
    q = tl.load(Q + row[:, None] * D + d[None, :], mask=qmask[:, None], other=0.0)
    do = tl.load(DO + row[:, None] * D + d[None, :], mask=qmask[:, None], other=0.0)
    lse2 = tl.load(LSE + row, mask=qmask, other=0.0) * LOG2E
    delta = tl.load(DELTA + row, mask=qmask, other=0.0)
    s = mm(q, tl.trans(kt)) * qk_scale
    vis = (j[None, :] <= QOFF + tq[:, None]) & qmask[:, None]
    if DOCS:
        vis = vis & (j[None, :] >= tl.load(DOC + b * T + tq, mask=qmask, other=0)[:, None])
    p = tl.where(vis, tl.exp2(s - lse2[:, None]), 0.0)
    dv += mm(tl.trans(p.to(do.dtype)), do)
    dp = mm(do, tl.trans(vt))
    ds = p * (dp - delta[:, None])
    dk += mm(tl.trans(ds.to(q.dtype)), q)
    return dk, dv


@triton.jit
def dense_bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, DOC, QEND, T, TK, QOFF, qk_scale, sm_scale,
                          HQ: tl.constexpr, HKV: tl.constexpr, H: tl.constexpr,
                          BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, DOCS: tl.constexpr):
    """Per-head shares of dk, dv (fp32 [B, TK, HQ, D]) for one key tile of BN and one query head;
    the caller sums the heads of each group (one program per head keeps the grid wide)."""
    nid = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // HQ).to(tl.int64)
    h = bh % HQ
    g = h // H
    d = tl.arange(0, D)
    j = nid * BN + tl.arange(0, BN)
    kmask = j < TK
    kv = ((b * TK + j) * HKV + g) * D
    kt = tl.load(K + kv[:, None] + d[None, :], mask=kmask[:, None], other=0.0)
    vt = tl.load(V + kv[:, None] + d[None, :], mask=kmask[:, None], other=0.0)
    dk = tl.zeros([BN, D], tl.float32)
    dv = tl.zeros([BN, D], tl.float32)
    # the first query tile holding a position at or after the key tile's first key
    m_lo = (tl.maximum(nid * BN - QOFF, 0) // BM) * BM
    if DOCS:
        # queries of later documents cannot see the tile
        m_hi = tl.load(QEND + b * tl.cdiv(TK, BN) + nid)
    else:
        m_hi = T
    if not INTERPRET:
        for m0 in range(m_lo, m_hi, BM):
            dk, dv = _dkdv_step(Q, DO, LSE, DELTA, DOC, kt, vt, dk, dv, b, h, m0, j, T, QOFF, qk_scale, HQ, BM, D,
                                DOCS)
    else:
        m0 = m_lo
        while m0 < m_hi:
            dk, dv = _dkdv_step(Q, DO, LSE, DELTA, DOC, kt, vt, dk, dv, b, h, m0, j, T, QOFF, qk_scale, HQ, BM, D,
                                DOCS)
            m0 += BM
    out = ((b * TK + j) * HQ + h)[:, None] * D + d[None, :]
    tl.store(DK + out, dk * sm_scale, mask=kmask[:, None])
    tl.store(DV + out, dv, mask=kmask[:, None])


@triton.jit
def _dq_step(K, V, q, do, lse2, delta, dq, b, g, k0, pos, start, qmask, TK, qk_scale, HKV: tl.constexpr,
             BN: tl.constexpr, D: tl.constexpr, DOCS: tl.constexpr):
    d = tl.arange(0, D)
    j = k0 + tl.arange(0, BN)
    kmask = j < TK
    kv = ((b * TK + j) * HKV + g) * D
    kt = tl.load(K + kv[:, None] + d[None, :], mask=kmask[:, None], other=0.0)
    vt = tl.load(V + kv[:, None] + d[None, :], mask=kmask[:, None], other=0.0)
    s = mm(q, tl.trans(kt)) * qk_scale
    vis = (j[None, :] <= pos[:, None]) & qmask[:, None]
    if DOCS:
        vis = vis & (j[None, :] >= start[:, None])
    p = tl.where(vis, tl.exp2(s - lse2[:, None]), 0.0)
    dp = mm(do, tl.trans(vt))
    ds = p * (dp - delta[:, None])
    dq += mm(ds.to(kt.dtype), kt)
    return dq


@triton.jit
def dense_bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, DOC, T, TK, QOFF, qk_scale, sm_scale,
                        HQ: tl.constexpr, HKV: tl.constexpr, H: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, DOCS: tl.constexpr):
    """dq [B, T, HQ, D] for one query tile of BM and one head."""
    mid = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // HQ).to(tl.int64)
    h = bh % HQ
    g = h // H
    tq = mid * BM + tl.arange(0, BM)
    qmask = tq < T
    d = tl.arange(0, D)
    row = (b * T + tq) * HQ + h
    q = tl.load(Q + row[:, None] * D + d[None, :], mask=qmask[:, None], other=0.0)
    do = tl.load(DO + row[:, None] * D + d[None, :], mask=qmask[:, None], other=0.0)
    lse2 = tl.load(LSE + row, mask=qmask, other=0.0) * LOG2E
    delta = tl.load(DELTA + row, mask=qmask, other=0.0)
    dq = tl.zeros([BM, D], tl.float32)
    hi = QOFF + tl.minimum((mid + 1) * BM, T)
    pos = QOFF + tq
    if DOCS:
        start, k_first = row_documents(DOC + b * T, tq, qmask, mid * BM, BN)
    else:
        start = pos
        k_first = 0
    if not INTERPRET:
        for k0 in range(k_first, hi, BN):
            dq = _dq_step(K, V, q, do, lse2, delta, dq, b, g, k0, pos, start, qmask, TK, qk_scale, HKV, BN, D, DOCS)
    else:
        k0 = hi * 0 + k_first
        while k0 < hi:
            dq = _dq_step(K, V, q, do, lse2, delta, dq, b, g, k0, pos, start, qmask, TK, qk_scale, HKV, BN, D, DOCS)
            k0 += BN
    tl.store(DQ + row[:, None] * D + d[None, :], (dq * sm_scale).to(DQ.dtype.element_ty), mask=qmask[:, None])


def _dense_tiles(D: int) -> tuple[int, int]:
    if interpreting():
        return 32, 16
    return 128, 64


def dense_forward(q, k, v, scale, q_offset=0, doc_start=None):
    """Dense causal attention: o [B, T, Hq, D], lse fp32 [B, T, Hq]; with doc_start (int32
    [B, T], contiguous) each query reads its own document only."""
    B, T, Hq, G, H, _, D = geometry(q, k, 16)
    o = torch.empty_like(q)
    lse = torch.empty(B, T, Hq, dtype=torch.float32, device=q.device)
    BM, BN = _dense_tiles(D)
    dense_fwd_kernel[(triton.cdiv(T, BM), B * Hq)](
        q, k, v, o, lse, lse if doc_start is None else doc_start, T, k.shape[1], q_offset, scale * LOG2E.value,
        HQ=Hq, HKV=G, H=H, BM=BM, BN=BN, D=D, DOCS=doc_start is not None, num_warps=8, num_stages=3)
    return o, lse


def dense_backward(do, q, k, v, o, lse, scale, q_offset=0, tuning: Tuning = DEFAULT_TUNING, doc_start=None):
    B, T, Hq, G, H, _, D = geometry(q, k, 16)
    TK = k.shape[1]
    delta = softmax_delta(do, o)
    dq = torch.empty_like(q)
    BM, BN, warps, stages = (16, 32, 4, 1) if interpreting() else tuning.dense_dkdv
    dkp = torch.empty(B, TK, Hq, D, dtype=torch.float32, device=q.device)
    dvp = torch.empty_like(dkp)
    docs = lse if doc_start is None else doc_start
    qend = lse if doc_start is None else query_ends(doc_start, TK, BN)
    dense_bwd_dkdv_kernel[(triton.cdiv(TK, BN), B * Hq)](
        q, k, v, do, lse, delta, dkp, dvp, docs, qend, T, TK, q_offset, scale * LOG2E.value, scale,
        HQ=Hq, HKV=G, H=H, BM=BM, BN=BN, D=D, DOCS=doc_start is not None, num_warps=warps, num_stages=stages)
    dk = dkp.view(B, TK, G, H, D).sum(3).to(k.dtype)
    dv = dvp.view(B, TK, G, H, D).sum(3).to(v.dtype)
    BM, BN = (32, 16) if interpreting() else (128, 32)
    dense_bwd_dq_kernel[(triton.cdiv(T, BM), B * Hq)](
        q, k, v, do, lse, delta, dq, docs, T, TK, q_offset, scale * LOG2E.value, scale,
        HQ=Hq, HKV=G, H=H, BM=BM, BN=BN, D=D, DOCS=doc_start is not None, num_warps=8, num_stages=2)
    return dq, dk, dv
