"""The gather path of sparse attention: kernels over selected key blocks, KV-outer with query
gathering, and their launchers (`sparse_forward`, `sparse_backward`).

Every (query, group, slot) triple that names a key block is one *entry*. Entries are sorted by
(query chunk, batch, group, block) into *buckets* (the inverse block -> queries index of
inverse_index.py). One program takes a run of tiles of one bucket (a *work item*): it loads
the key/value block once and multiplies it against each tile of QT gathered queries x H heads =
R matrix rows. Forward programs write a normalised partial output and a partial lse per entry,
and a combine kernel merges each query's K partials (no atomics, any block popularity). The
backward walks the same buckets: dK/dV accumulate in registers over the work item, dQ partials
are written per entry and summed per query; everything is deterministic.

B = batch, T = queries, TK = keys (query t sits at position QOFF + t; TK = QOFF + T), C = queries
of the current chunk, G = key/value heads (groups), H = query heads per group (HP: next power of
two), K = top-k slots, N = key blocks, BS = block size, D = head dim, E = entries of a chunk
(B*C*G*K), R = matrix rows of a tile.
The inverse index lists entries by their id over all queries, ((b*T + t)*G + g)*K + slot (the
flat index into block_idx [B, T, G, K]); a chunk's partial buffers are indexed by its own
triple id ((b*C + c)*G + g)*K + slot, c = t - t0.
With packed documents (DOCS) a bucket's block n is an entry of the document block table: its
keys are BSTART[b, n] .. BEND[b, n] - 1 (see inverse_index.py); without, n*BS .. TK - 1
capped at BS keys.
FP8 (fp8_probs): a tile's probabilities relative to its row's block max, exp(s - m) <= 1, are
rounded to float8 e4m3 of their value x 448 before they multiply V (the output and dV); the
partial lse, the softmax's gradient and the KL teacher's rows use the exact ones (straight
through). The backward's correction term is then the exact softmax's, sum_j p_j dp_j, not
rowsum(dO * O): `sparse_fp8_delta_kernel` adds the difference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_utils import E4M3_MAX, INTERPRET, LN2, LOG2E, e4m3_round, interpreting, mm
from .inverse_index import DocumentBlocks, decode_bucket, schedule
from .shared import (COMPILED, block_tables, bucket_items, geometry, kv_block, narrow_offsets, query_chunks,
                     softmax_delta, sparse_index)
from .tuning import DEFAULT_TUNING, Tuning


@triton.jit
def _tile_rows(ENTRY, start, i0, count, b, T, C, t0, HKV: tl.constexpr, SLOTS: tl.constexpr,
               H: tl.constexpr, HP: tl.constexpr, QT: tl.constexpr, WIDE: tl.constexpr = True):
    """Rows of a tile: entries start+i0 .. start+i0+QT-1, each as HP head rows. Returns each row's
    head, validity, query t and its entry's index in the chunk's partial buffers, the triple id
    ((b*C + t - t0)*G + g)*K + slot (ENTRY holds ids over all T queries). WIDE: the ids and what
    is computed from them in int64, else in int32 (`narrow_offsets`)."""
    r = tl.arange(0, QT * HP)
    qi = i0 + r // HP
    hh = r % HP
    row_ok = (qi < count) & (hh < H)
    trip = tl.load(ENTRY + start + qi, mask=row_ok, other=0)
    if WIDE:
        trip = trip.to(tl.int64)
    t = (trip // (SLOTS * HKV)) % T
    part = (b * C + t - t0) * (HKV * SLOTS) + trip % (HKV * SLOTS)
    return hh, row_ok, part, t


@triton.jit
def _fwd_tile(Q, PO, PLSE, ENTRY, kt, vt, j, b, g, start, i0, count, T, C, t0, QOFF, qk_scale,
              HQ: tl.constexpr, HKV: tl.constexpr, SLOTS: tl.constexpr, H: tl.constexpr, HP: tl.constexpr,
              QT: tl.constexpr, D: tl.constexpr, FP8: tl.constexpr, WIDE: tl.constexpr):
    """QT entries of one bucket against its whole key block: one softmax, no rescaling."""
    hh, row_ok, trip, t = _tile_rows(ENTRY, start, i0, count, b, T, C, t0, HKV, SLOTS, H, HP, QT, WIDE)
    d = tl.arange(0, D)
    row = (b * T + t) * HQ + g * H + hh
    q = tl.load(Q + row[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
    s = mm(q, tl.trans(kt)) * qk_scale
    # query t sits at position QOFF + t; j <= QOFF + t also keeps j < TK; rows past `count` see
    # nothing. A bucket lists its queries in order, so a full tile whose first query follows the
    # block's last key reads the whole block (every tile of every block but the local one): it
    # skips the mask (which took 1.8% of the kernel at 128K)
    t_first = tl.min(tl.where(row_ok, t, 2147483647), 0)
    if (i0 + QT > count) | (tl.max(j, 0) > QOFF + t_first):
        s = tl.where((j[None, :] <= QOFF + t[:, None]) & row_ok[:, None], s, float("-inf"))
    m = tl.max(s, 1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    p = tl.exp2(s - m_safe[:, None])
    l = tl.sum(p, 1)
    l_safe = tl.where(l == 0.0, 1.0, l)
    if FP8:
        # e4m3 values are exact in bf16/fp16: the 1/448 goes with the normaliser
        o = mm(e4m3_round(p * E4M3_MAX).to(vt.dtype), vt) * (1.0 / (l_safe * E4M3_MAX))[:, None]
    else:
        o = mm(p.to(vt.dtype), vt) * (1.0 / l_safe)[:, None]
    part = trip * H + hh
    tl.store(PO + part[:, None] * D + d[None, :], o.to(PO.dtype.element_ty), mask=row_ok[:, None])
    tl.store(PLSE + part, (m + tl.log2(l_safe)) * LN2, mask=row_ok)


@triton.jit
def sparse_fwd_kernel(Q, K, V, PO, PLSE, ENTRY, ITEM_BUCKET, ITEM_START, ITEM_COUNT, BSTART, BEND,
                      T, TK, C, t0, QOFF, NBLK, qk_scale,
                      HQ: tl.constexpr, HKV: tl.constexpr, SLOTS: tl.constexpr, H: tl.constexpr,
                      HP: tl.constexpr, QT: tl.constexpr, BS: tl.constexpr, D: tl.constexpr, DOCS: tl.constexpr,
                      FP8: tl.constexpr = False, WIDE: tl.constexpr = True):
    """One work item (a run of tiles of one bucket; the key/value block is loaded once): partial o
    (normalised, PO [E, H, D]) and lse (PLSE [E, H], natural log) of each entry. WIDE: int64
    offsets (else int32, where `narrow_offsets` says every one fits)."""
    pid = tl.program_id(0)
    bucket = tl.load(ITEM_BUCKET + pid)
    if bucket < 0:
        return
    start = tl.load(ITEM_START + pid)
    count = tl.load(ITEM_COUNT + pid)
    b, g, j, kt, vt = kv_block(K, V, bucket, TK, NBLK, BSTART, BEND, HKV, BS, D, DOCS)
    if not WIDE:
        b = b.to(tl.int32)
    # a for loop is software-pipelined (the next tile's gathered queries load during this one's
    # products); the interpreter takes the while loop (triton_utils)
    if not INTERPRET:
        for i0 in range(0, count, QT):
            _fwd_tile(Q, PO, PLSE, ENTRY, kt, vt, j, b, g, start, i0, count, T, C, t0, QOFF, qk_scale,
                      HQ, HKV, SLOTS, H, HP, QT, D, FP8, WIDE)
    else:
        i0 = count * 0
        while i0 < count:
            _fwd_tile(Q, PO, PLSE, ENTRY, kt, vt, j, b, g, start, i0, count, T, C, t0, QOFF, qk_scale,
                      HQ, HKV, SLOTS, H, HP, QT, D, FP8, WIDE)
            i0 += QT


@triton.jit
def sparse_fwd_combine_kernel(PO, PLSE, IDX, O, LSE, ROWSEL, T, C, t0,
                              HQ: tl.constexpr, HKV: tl.constexpr, SLOTS: tl.constexpr, KP: tl.constexpr,
                              H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, RC: tl.constexpr,
                              ROWS: tl.constexpr):
    """Merge the K partials of RC queries c of one (b, g), as R = RC*HP rows: o [R, D] and lse [R];
    empty support gives o = 0, lse = -inf. ROWS: only the (b, t, g) that ROWSEL [B, T, G] (bool)
    marks are written (the hybrid forward's gathered tiles; the tile kernel writes the others), and
    a program with none exits."""
    pid = tl.program_id(0).to(tl.int64)  # (b*cdiv(C, RC) + chunk of RC queries)*G + g
    g = pid % HKV
    CB = tl.cdiv(C, RC)
    b = pid // (HKV * CB)
    r = tl.arange(0, RC * HP)
    c = (pid // HKV) % CB * RC + r // HP
    h = r % HP
    ok = (c < C) & (h < H)
    qrow = (b * T + t0 + c) * HKV + g  # IDX is the whole [B, T, G, K]
    if ROWS:
        ok &= tl.load(ROWSEL + qrow, mask=ok, other=0).to(tl.int32) != 0
        if tl.max(ok.to(tl.int32), 0) == 0:
            return
    d = tl.arange(0, D)
    slot = tl.arange(0, KP)
    idx = tl.load(IDX + qrow[:, None] * SLOTS + slot[None, :], mask=ok[:, None] & (slot < SLOTS)[None, :], other=-1)
    trip0 = ((b * C + c) * HKV + g) * SLOTS
    plse = tl.load(PLSE + (trip0[:, None] + slot[None, :]) * H + h[:, None], mask=idx >= 0, other=float("-inf"))
    mx = tl.max(plse, 1)
    mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
    wsum = tl.sum(tl.exp(plse - mx_safe[:, None]), 1)
    lse = tl.where(wsum == 0.0, float("-inf"), mx_safe + tl.log(tl.where(wsum == 0.0, 1.0, wsum)))
    lse_safe = tl.where(wsum == 0.0, 0.0, lse)
    acc = tl.zeros([RC * HP, D], tl.float32)
    for s in range(SLOTS):
        hit = tl.load(IDX + qrow * SLOTS + s, mask=ok, other=-1) >= 0
        part = (trip0 + s) * H + h
        w = tl.exp(tl.load(PLSE + part, mask=hit, other=float("-inf")) - lse_safe)
        po = tl.load(PO + part[:, None] * D + d[None, :], mask=hit[:, None], other=0.0)
        acc += w[:, None] * po.to(tl.float32)
    row = (b * T + t0 + c) * HQ + g * H + h
    tl.store(O + row[:, None] * D + d[None, :], acc.to(O.dtype.element_ty), mask=ok[:, None])
    tl.store(LSE + row, lse, mask=ok)


@triton.jit
def _bwd_tile(Q, DO, LSE, DELTA, DQP, ENTRY, PBAR, kt, vt, dk, dv, j, b, g, start, i0, count, T, C, t0,
              QOFF, qk_scale, sm_scale, HQ: tl.constexpr, HKV: tl.constexpr, SLOTS: tl.constexpr, H: tl.constexpr,
              HP: tl.constexpr, QT: tl.constexpr, BS: tl.constexpr, D: tl.constexpr, TEACHER: tl.constexpr,
              QTC: tl.constexpr, FP8: tl.constexpr, WIDE: tl.constexpr):
    """QT entries of one bucket: dK/dV accumulate into dk, dv [BS, D]; dQ partials are stored.
    FP8: dV from the fp8 probabilities the forward used (`_fp8_probs`), the rest from P.

    Score tiles are computed transposed, [keys, rows] (S^T = K Q^T, ...): the block's keys are the
    products' M dimension, so a small tile of rows keeps them small in registers (faster than rows
    as M on an H200).

    TEACHER: P here is the final softmax (recomputed with the whole support's lse), so the
    indexer KL's teacher row of each entry, the mean of P over the group's heads, costs one small
    product with a constant [R, QTC] averaging matrix (QTC >= QT columns, one per entry: a
    product's least width), from the 16-bit copy of P that dV multiplies anyway, before dV. It
    is stored to PBAR [entries, BS] at the entry's id over all queries. Where it goes matters
    (the kernel runs at 255 registers): this way costs about 4 ms on 105 at 128K; its own fp16
    copy 1 ms more; after dV, or with its sums added here by atomics, 9 to 34 ms more
    (measured on an H200)."""
    hh, row_ok, trip, t = _tile_rows(ENTRY, start, i0, count, b, T, C, t0, HKV, SLOTS, H, HP, QT, WIDE)
    d = tl.arange(0, D)
    row = (b * T + t) * HQ + g * H + hh
    q = tl.load(Q + row[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + row[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
    lse2 = tl.load(LSE + row, mask=row_ok, other=0.0) * LOG2E
    delta = tl.load(DELTA + row, mask=row_ok, other=0.0)
    st = mm(kt, tl.trans(q)) * qk_scale
    vis = (j[:, None] <= QOFF + t[None, :]) & row_ok[None, :]
    pt = tl.where(vis, tl.exp2(st - lse2[None, :]), 0.0)
    pt16 = pt.to(do.dtype)
    if TEACHER:
        _teacher_rows(PBAR, ENTRY, pt16, start, i0, count, H, HP, QT, BS, QTC, WIDE)
    if FP8:
        dv += mm(_fp8_probs(st, vis, lse2).to(do.dtype), do)
    else:
        dv += mm(pt16, do)
    dst = pt * (mm(vt, tl.trans(do)) - delta[None, :])
    dk += mm(dst.to(q.dtype), q)
    dq = mm(tl.trans(dst.to(kt.dtype)), kt) * sm_scale
    part = trip * H + hh
    tl.store(DQP + part[:, None] * D + d[None, :], dq.to(DQP.dtype.element_ty), mask=row_ok[:, None])
    return dk, dv


@triton.jit
def _fp8_probs(st, vis, lse2):
    """The forward's fp8 probabilities of a transposed tile [keys, rows] (scores st in log2 units,
    vis the support, lse2 [rows] the log2 normaliser): e4m3 of exp2(st - m) x 448, m each row's
    max over the block, times exp2(m - lse2) / 448; zero off the support."""
    m = tl.max(tl.where(vis, st, float("-inf")), 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    pq = tl.where(vis, e4m3_round(tl.exp2(st - m_safe[None, :]) * E4M3_MAX), 0.0)
    return pq * (tl.exp2(m_safe - lse2) * (1.0 / E4M3_MAX))[None, :]


@triton.jit
def sparse_fp8_delta_kernel(Q, K, V, DO, LSE, CORR, ENTRY, ITEM_BUCKET, ITEM_START, ITEM_COUNT, BSTART, BEND,
                            T, TK, C, t0, QOFF, NBLK, qk_scale,
                            HQ: tl.constexpr, HKV: tl.constexpr, SLOTS: tl.constexpr, H: tl.constexpr,
                            HP: tl.constexpr, QT: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
                            DOCS: tl.constexpr):
    """fp8_probs' backward needs each row's sum_j p_j dp_j with p the exact softmax (straight
    through the rounding), while rowsum(dO * O) gives it with the fp8 probabilities that made O:
    per entry and head the difference over the block, sum_j (p_j - pq_j) dp_j, to CORR [E, H]
    (the caller sums each row's slots). One work item per program, as the backward."""
    pid = tl.program_id(0)
    bucket = tl.load(ITEM_BUCKET + pid)
    if bucket < 0:
        return
    start = tl.load(ITEM_START + pid)
    count = tl.load(ITEM_COUNT + pid)
    b, g, j, kt, vt = kv_block(K, V, bucket, TK, NBLK, BSTART, BEND, HKV, BS, D, DOCS)
    i0 = count * 0
    while i0 < count:
        hh, row_ok, trip, t = _tile_rows(ENTRY, start, i0, count, b, T, C, t0, HKV, SLOTS, H, HP, QT)
        d = tl.arange(0, D)
        row = (b * T + t) * HQ + g * H + hh
        q = tl.load(Q + row[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
        do = tl.load(DO + row[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
        lse2 = tl.load(LSE + row, mask=row_ok, other=0.0) * LOG2E
        st = mm(kt, tl.trans(q)) * qk_scale
        vis = (j[:, None] <= QOFF + t[None, :]) & row_ok[None, :]
        pt = tl.where(vis, tl.exp2(st - lse2[None, :]), 0.0)
        corr = tl.sum((pt - _fp8_probs(st, vis, lse2)) * mm(vt, tl.trans(do)), 0)
        tl.store(CORR + trip * H + hh, corr, mask=row_ok)
        i0 += QT


@triton.jit
def _teacher_rows(PBAR, ENTRY, pt, start, i0, count, H: tl.constexpr, HP: tl.constexpr, QT: tl.constexpr,
                  BS: tl.constexpr, QTC: tl.constexpr, WIDE: tl.constexpr):
    """Each entry's teacher row, the mean of pt [BS, QT*HP] over its heads, to PBAR [entries, BS]."""
    P_DT = PBAR.dtype.element_ty
    col = tl.arange(0, QTC)
    avg = tl.where(tl.arange(0, QT * HP)[:, None] // HP == col[None, :], 1.0 / H, 0.0).to(pt.dtype)
    pbar = mm(pt, avg)
    col_ok = (col < QT) & (i0 + col < count)
    e = tl.load(ENTRY + start + i0 + col, mask=col_ok, other=0)
    if WIDE:
        e = e.to(tl.int64)
    tl.store(PBAR + e[None, :] * BS + tl.arange(0, BS)[:, None], pbar.to(P_DT), mask=col_ok[None, :])


@triton.jit
def sparse_bwd_kernel(Q, K, V, DO, LSE, DELTA, DQP, DKP, DVP, ENTRY, ITEM_BUCKET, ITEM_START, ITEM_COUNT,
                      BSTART, BEND, PBAR, T, TK, C, t0, QOFF, NBLK, qk_scale, sm_scale,
                      HQ: tl.constexpr, HKV: tl.constexpr, SLOTS: tl.constexpr, H: tl.constexpr,
                      HP: tl.constexpr, QT: tl.constexpr, BS: tl.constexpr, D: tl.constexpr, DOCS: tl.constexpr,
                      TEACHER: tl.constexpr, QTC: tl.constexpr, FP8: tl.constexpr = False,
                      WIDE: tl.constexpr = True):
    """One work item (a run of tiles of one bucket): dK/dV partials [items, BS, D] (fp32), dQ partials
    per entry (DQP [E, H, D], input dtype, scaled); with TEACHER also the KL teacher's rows (`_bwd_tile`).
    WIDE: int64 offsets (else int32, where `narrow_offsets` says every one fits)."""
    pid = tl.program_id(0)
    bucket = tl.load(ITEM_BUCKET + pid)
    if bucket < 0:
        return
    start = tl.load(ITEM_START + pid)
    count = tl.load(ITEM_COUNT + pid)
    b, g, j, kt, vt = kv_block(K, V, bucket, TK, NBLK, BSTART, BEND, HKV, BS, D, DOCS)
    if not WIDE:
        b = b.to(tl.int32)
    dk = tl.zeros([BS, D], tl.float32)
    dv = tl.zeros([BS, D], tl.float32)
    if not INTERPRET:  # pipelined; the interpreter takes the while loop
        for i0 in range(0, count, QT):
            dk, dv = _bwd_tile(Q, DO, LSE, DELTA, DQP, ENTRY, PBAR, kt, vt, dk, dv, j, b, g, start, i0, count,
                               T, C, t0, QOFF, qk_scale, sm_scale, HQ, HKV, SLOTS, H, HP, QT, BS, D, TEACHER, QTC,
                               FP8, WIDE)
    else:
        i0 = count * 0
        while i0 < count:
            dk, dv = _bwd_tile(Q, DO, LSE, DELTA, DQP, ENTRY, PBAR, kt, vt, dk, dv, j, b, g, start, i0, count,
                               T, C, t0, QOFF, qk_scale, sm_scale, HQ, HKV, SLOTS, H, HP, QT, BS, D, TEACHER, QTC,
                               FP8, WIDE)
            i0 += QT
    d = tl.arange(0, D)
    out = pid.to(tl.int64) * BS * D + tl.arange(0, BS)[:, None] * D + d[None, :]
    tl.store(DKP + out, dk * sm_scale)
    tl.store(DVP + out, dv)


@triton.jit
def sparse_bwd_reduce_kernel(DKP, DVP, DK, DV, ITEM_FIRST, ITEM_NUM, BSTART, BEND, TK, NBLK,
                             HKV: tl.constexpr, BS: tl.constexpr, RB: tl.constexpr, D: tl.constexpr,
                             DOCS: tl.constexpr):
    """dK/dV (fp32 [B, TK, G, D], accumulated across query chunks) += the work items of one bucket,
    in order (deterministic). Only the block's own keys are written: another bucket owns the
    rest, and a read-modify-write of its rows here would race with it."""
    bucket = tl.program_id(0)
    nitem = tl.load(ITEM_NUM + bucket)
    if nitem == 0:
        return
    first = tl.load(ITEM_FIRST + bucket)
    b, g, n = decode_bucket(bucket, NBLK, HKV)
    b = b.to(tl.int64)
    rr = tl.program_id(1) * RB + tl.arange(0, RB)
    d = tl.arange(0, D)
    if DOCS:
        j = tl.load(BSTART + b * NBLK + n) + rr
        jmask = (j < tl.load(BEND + b * NBLK + n))[:, None]
    else:
        j = n * BS + rr
        jmask = (j < TK)[:, None]
    dst = ((b * TK + j) * HKV + g)[:, None] * D + d[None, :]
    acc_k = tl.load(DK + dst, mask=jmask, other=0.0)
    acc_v = tl.load(DV + dst, mask=jmask, other=0.0)
    it = first.to(tl.int64)
    while it < first + nitem:
        src = it * BS * D + rr[:, None] * D + d[None, :]
        acc_k += tl.load(DKP + src)
        acc_v += tl.load(DVP + src)
        it += 1
    tl.store(DK + dst, acc_k, mask=jmask)
    tl.store(DV + dst, acc_v, mask=jmask)


@triton.jit
def sparse_dq_combine_kernel(DQP, IDX, DQ, T, C, t0,
                             HQ: tl.constexpr, HKV: tl.constexpr, SLOTS: tl.constexpr,
                             H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr):
    """dq of one (b, c, g) [H, D] = sum of its valid slots' partials (zero on empty support)."""
    pid = tl.program_id(0).to(tl.int64)
    g = pid % HKV
    c = (pid // HKV) % C
    b = pid // (HKV * C)
    h = tl.arange(0, HP)
    hmask = h < H
    d = tl.arange(0, D)
    acc = tl.zeros([HP, D], tl.float32)
    trip0 = pid * SLOTS
    irow = ((b * T + t0 + c) * HKV + g) * SLOTS  # IDX is the whole [B, T, G, K]
    for s in range(SLOTS):
        if tl.load(IDX + irow + s) >= 0:
            part = (trip0 + s) * H + h
            acc += tl.load(DQP + part[:, None] * D + d[None, :], mask=hmask[:, None], other=0.0).to(tl.float32)
    row = (b * T + t0 + c) * HQ + g * H + h
    tl.store(DQ + row[:, None] * D + d[None, :], acc.to(DQ.dtype.element_ty), mask=hmask[:, None])


def sparse_forward(q, k, v, idx, block_size, scale, q_offset=0, index=None, tuning: Tuning = DEFAULT_TUNING,
                   docs: DocumentBlocks | None = None, out=None, rows=None, partials=None, fp8=False):
    """o [B, T, Hq, D] (q dtype), lse fp32 [B, T, Hq] and the inverse index (for the backward);
    idx cleaned int32 [B, T, G, K]; k, v [B, TK, G, D]; docs: packed documents' block table;
    out: contiguous (o, lse) to write into; rows: bool [B, T, G], contiguous: only these (b, t, g)
    are written (None: all); partials: `forward_partials`' buffers to use; fp8: the output from
    probabilities rounded to float8 e4m3 (see the module's docstring)."""
    B, T, Hq, G, H, HP, D = geometry(q, k, block_size)
    TK = k.shape[1]
    K = idx.shape[-1]
    N, bstart, bend, DOCS = block_tables(docs, TK, block_size, idx)
    if index is None:
        index = sparse_index(idx, H, D, q.element_size(), N, tuning, docs)
    o, lse = out if out is not None else (torch.empty_like(q),
                                          torch.empty(B, T, Hq, dtype=torch.float32, device=q.device))
    QT = max(tuning.fwd_rows, HP) // HP
    tb, ts, tc = schedule(index, QT * tuning.fwd_tiles)
    # one partial buffer, reused by every chunk (the stream orders a chunk's combine before the
    # next chunk's writes)
    po, plse = partials if partials is not None else (
        torch.empty(index.chunk_entries * H, D, dtype=q.dtype, device=q.device),
        torch.empty(index.chunk_entries * H, dtype=torch.float32, device=q.device))
    if po.shape[0] < index.chunk_entries * H or plse.shape[0] < index.chunk_entries * H:
        raise ValueError(f"the partial buffers hold {po.shape[0]} rows; a chunk of the index needs "
                         f"{index.chunk_entries * H}")
    wide = not narrow_offsets(tuning, q, po, idx)
    for c, t0, t1 in query_chunks(index, T):
        COMPILED["fwd"] = sparse_fwd_kernel[(tb.shape[1],)](
            q, k, v, po, plse, index.entry, tb[c], ts[c], tc[c], bstart, bend, T, TK, t1 - t0, t0, q_offset, N,
            scale * LOG2E.value, HQ=Hq, HKV=G, SLOTS=K, H=H, HP=HP, QT=QT, BS=block_size, D=D, DOCS=DOCS,
            FP8=fp8, WIDE=wide, num_warps=tuning.fwd_warps, num_stages=tuning.fwd_stages)
        # at most 64 rows a program (its fp32 accumulator in registers)
        rc = max(1, min(tuning.combine_queries if rows is None else tuning.combine_queries_rows, 64 // HP))
        sparse_fwd_combine_kernel[(B * triton.cdiv(t1 - t0, rc) * G,)](
            po, plse, idx, o, lse, idx if rows is None else rows, T, t1 - t0, t0,
            HQ=Hq, HKV=G, SLOTS=K, KP=triton.next_power_of_2(K), H=H, HP=HP, D=D, RC=rc, ROWS=rows is not None,
            num_warps=4)
    return o, lse, index


def _gluon_backward(tuning: Tuning, q, block_size: int, rows: int, fp8: bool):
    """The module of the Gluon backward where `sparse_backward` takes it (`Tuning.bwd_gluon` and
    `gluon_backward.usable`), else None; Gluon is imported only where it is asked for."""
    if not tuning.bwd_gluon:
        return None
    from . import gluon_backward

    return gluon_backward if gluon_backward.usable(q, block_size, rows, fp8) else None


def sparse_backward(do, q, k, v, o, lse, idx, block_size, scale, q_offset=0, index=None,
                    tuning: Tuning = DEFAULT_TUNING, docs: DocumentBlocks | None = None, teacher=None, out=None,
                    fp8=False):
    """(dq, dk, dv) of `sparse_forward` (given its inverse index, or building it), in the input dtype.
    fp8: of the forward with fp8 probabilities, straight through (see the module's docstring): each chunk's
    correction term first gets the exact softmax's share (`sparse_fp8_delta_kernel`).

    teacher: optional pbar [B*T*G*K, block_size]: the indexer KL's teacher rows, the mean of P
    over each group's heads, written by the kernel for every entry (an entry's id over all
    queries is its row).
    out: contiguous (dq, dk, dv) to use instead: dq written (q's dtype), dk and dv fp32
    accumulators [B, TK, G, D] added to (a caller summing several calls' key gradients); they are
    returned as they are."""
    B, T, Hq, G, H, HP, D = geometry(q, k, block_size)
    TK = k.shape[1]
    K = idx.shape[-1]
    N, bstart, bend, DOCS = block_tables(docs, TK, block_size, idx)
    if index is None:
        index = sparse_index(idx, H, D, q.element_size(), N, tuning, docs)
    delta = softmax_delta(do, o)
    if out is not None:
        dq, dk, dv = out
    else:
        dq = torch.empty_like(q)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    QT = max(tuning.bwd_rows, HP) // HP
    # entries per work item: enough tiles to amortise the dK/dV partial, few enough to spread
    # a popular block (the sink, the local block) over many programs
    per_item = QT * tuning.bwd_tiles
    ib, istart, icount = schedule(index, per_item)
    first, runs = bucket_items(index, per_item)
    # dq partials in the input dtype: each is one block's share, rounded once like torch's own
    # bf16 matmul output, and it halves the bytes of the pass that dominates the backward
    dqp = torch.empty(index.chunk_entries * H, D, dtype=q.dtype, device=q.device)
    dkp = torch.empty(ib.shape[1], block_size, D, dtype=torch.float32, device=q.device)
    dvp = torch.empty_like(dkp)
    rb = min(32, block_size)
    pbar = delta if teacher is None else teacher
    # the teacher's product has one column per entry of a tile, at least 16 on a GPU
    qtc = triton.next_power_of_2(QT if interpreting() else max(QT, 16))
    corr = torch.empty(index.chunk_entries * H, dtype=torch.float32, device=q.device) if fp8 else None
    wide = not narrow_offsets(tuning, q, dqp, idx, pbar)
    gluon = _gluon_backward(tuning, q, block_size, QT * HP, fp8)
    for c, t0, t1 in query_chunks(index, T):
        if fp8:
            corr.zero_()
            sparse_fp8_delta_kernel[(ib.shape[1],)](
                q, k, v, do, lse, corr, index.entry, ib[c], istart[c], icount[c], bstart, bend, T, TK, t1 - t0, t0,
                q_offset, N, scale * LOG2E.value, HQ=Hq, HKV=G, SLOTS=K, H=H, HP=HP, QT=QT, BS=block_size, D=D,
                DOCS=DOCS, num_warps=tuning.bwd_warps, num_stages=1)
            delta[:, t0:t1] += corr[:B * (t1 - t0) * G * K * H].view(B, t1 - t0, G, K, H).sum(3).view(B, t1 - t0, Hq)
        args = (q, k, v, do, lse, delta, dqp, dkp, dvp, index.entry, ib[c], istart[c], icount[c], bstart, bend,
                pbar, T, TK, t1 - t0, t0, q_offset, N, scale * LOG2E.value, scale)
        shape = dict(HQ=Hq, HKV=G, SLOTS=K, H=H, HP=HP, QT=QT, BS=block_size, D=D, DOCS=DOCS,
                     TEACHER=teacher is not None, QTC=qtc)
        if gluon is not None:
            COMPILED["bwd"] = gluon.gluon_bwd_kernel[(ib.shape[1],)](
                *args, **shape, STAGES=tuning.bwd_gluon_stages, LW=gluon.LOADER_WARPS, LOADER_REGS=gluon.LOADER_REGS,
                num_warps=8)
        else:
            COMPILED["bwd"] = sparse_bwd_kernel[(ib.shape[1],)](
                *args, **shape, FP8=fp8, WIDE=wide, num_warps=tuning.bwd_warps, num_stages=tuning.bwd_stages)
        sparse_bwd_reduce_kernel[(runs.shape[1], block_size // rb)](
            dkp, dvp, dk, dv, first[c], runs[c], bstart, bend, TK, N,
            HKV=G, BS=block_size, RB=rb, D=D, DOCS=DOCS, num_warps=4)
        sparse_dq_combine_kernel[(B * (t1 - t0) * G,)](
            dqp, idx, dq, T, t1 - t0, t0, HQ=Hq, HKV=G, SLOTS=K, H=H, HP=HP, D=D, num_warps=4)
    if out is not None:
        return dq, dk, dv
    return dq, dk.to(k.dtype), dv.to(v.dtype)
