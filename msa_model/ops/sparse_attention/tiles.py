"""The tile path of sparse attention: kernels over the union of a query tile's blocks
(query-outer) and their launchers (`tile_union`, `tile_forward`, `tile_backward`).

Neighbouring queries of a trained indexer select mostly the same key blocks. A *tile* is QT
consecutive queries of one (b, g); its *union* is the distinct blocks its queries selected. A
program takes a tile's QT queries x the group's H heads as R = QT*HP matrix rows and walks its
union once, masking per row the blocks that row's query did not select (and, as everywhere, the
causal future). So every key/value block is loaded once per tile rather than once per query, and
the forward needs no per-entry partials nor a combine, at the price of the masked share of each
product: (union size) / (blocks per query) times the exact FLOPs. Where queries' selections
differ (random sets) the gather kernels of gather.py are faster; the hybrid forward (hybrid.py) chooses per tile.

The backward is FlashAttention-2's split: dQ query-outer over the union (as the forward), dK/dV
key-outer over the tiles whose union holds a block (the inverse index of the unions, with the
gather path's schedule and reduction), recomputing the probabilities from the forward's lse.

B = batch, T = queries (query t at position QOFF + t; TK = QOFF + T), G = groups, H = query heads
per group (HP: next power of two), K = slots (KP: next power of two), NT = tiles, U = union slots
per tile (QT*K, the largest union), BS = block size, D = head dim, R = QT*HP rows.
Block ids are the cleaned block_idx's, or with packed documents the table ids of
inverse_index.py (`base + n`), in IDS [B, T, G, K]; UNION [B, G, NT, U] lists each tile's
distinct ids, those every query of the tile selected first (UFULL [B, G, NT] of them), each part
ascending, then -1; UCOUNT [B, G, NT] their number.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..triton_utils import INTERPRET, LN2, LOG2E, interpreting, mm
from .gather import sparse_bwd_reduce_kernel
from .inverse_index import DocumentBlocks, build_inverse_index, decode_bucket, schedule
from .reference import TileUnion, table_ids, tile_union_reference
from .shared import (COMPILED, block_tables, bucket_items, equal_chunks, geometry, kv_block, partial_budget,
                     softmax_delta)
from .tuning import DEFAULT_TUNING, Tuning


@triton.jit
def tile_union_kernel(IDS, UNION, UCOUNT, UFULL, T, NT, HKV: tl.constexpr, SLOTS: tl.constexpr, QT: tl.constexpr,
                      U: tl.constexpr, LP: tl.constexpr):
    """One tile's union (program (tile, b*G + g)) of its U = QT*K ids (LP: next power of two):
    sorted, a distinct id is the first of its run, and one every query selected has QT copies in
    a row (a query names a block at most once). Each distinct id goes to its place by prefix
    sums: the every-query ones from 0, then the others, both ascending; -1 fills the rest."""
    tile = tl.program_id(0)
    bg = tl.program_id(1)
    b = (bg // HKV).to(tl.int64)
    g = bg % HKV
    e = tl.arange(0, LP)
    t = tile * QT + e // SLOTS
    ids = tl.load(IDS + ((b * T + t) * HKV + g) * SLOTS + e % SLOTS, mask=(e < U) & (t < T), other=-1)
    NONE: tl.constexpr = 2147483647  # -1 sorted last
    s = tl.sort(tl.where(ids >= 0, ids, NONE))
    prev = tl.gather(s, tl.maximum(e - 1, 0), 0)
    first = (s != NONE) & ((e == 0) | (s != prev))
    every = first & (e + QT - 1 < LP) & (tl.gather(s, tl.minimum(e + QT - 1, LP - 1), 0) == s)
    rest = first & ~every
    full = tl.sum(every.to(tl.int32), 0)
    place = tl.where(every, tl.cumsum(every.to(tl.int32), 0) - 1, full + tl.cumsum(rest.to(tl.int32), 0) - 1)
    count = tl.sum(first.to(tl.int32), 0)
    out = bg.to(tl.int64) * NT + tile
    tl.store(UNION + out * U + place, s, mask=first)
    tl.store(UNION + out * U + e, tl.full([LP], -1, tl.int32), mask=(e >= count) & (e < U))
    tl.store(UCOUNT + out, count)
    tl.store(UFULL + out, full)


@triton.jit
def _tile_rows(Q, IDS, b, g, tile, T, HQ: tl.constexpr, HKV: tl.constexpr, SLOTS: tl.constexpr,
               KP: tl.constexpr, H: tl.constexpr, HP: tl.constexpr, QT: tl.constexpr, D: tl.constexpr):
    """A tile's rows: query t [R], row validity, the rows' offsets in q-shaped tensors (row*D), q
    [R, D] and each row's query's selected ids [R, KP] (-1 where none)."""
    r = tl.arange(0, QT * HP)
    t = tile * QT + r // HP
    hh = r % HP
    row_ok = (t < T) & (hh < H)
    row = (b * T + t) * HQ + g * H + hh
    d = tl.arange(0, D)
    q = tl.load(Q + row[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
    slot = tl.arange(0, KP)
    ids = tl.load(IDS + ((b * T + t) * HKV + g)[:, None] * SLOTS + slot[None, :],
                  mask=row_ok[:, None] & (slot < SLOTS)[None, :], other=-1)
    return t, row_ok, row, q, ids


@triton.jit
def _kv_rows(K, V, b, g, n, part, TK, NBLK, BSTART, BEND, HKV: tl.constexpr, BS: tl.constexpr, KB: tl.constexpr,
             D: tl.constexpr, DOCS: tl.constexpr):
    """Key positions j [KB] and the key and value rows [KB, D] of part `part` (KB keys) of block n
    (zero past the block's end)."""
    if DOCS:
        j = tl.load(BSTART + b * NBLK + n) + part * KB + tl.arange(0, KB)
        end = tl.load(BEND + b * NBLK + n)
    else:
        j = n * BS + part * KB + tl.arange(0, KB)
        end = TK
    d = tl.arange(0, D)
    kv = ((b * TK + j) * HKV + g) * D
    kt = tl.load(K + kv[:, None] + d[None, :], mask=(j < end)[:, None], other=0.0)
    vt = tl.load(V + kv[:, None] + d[None, :], mask=(j < end)[:, None], other=0.0)
    return j, kt, vt


@triton.jit
def _selected(ids, n):
    """[R]: whether each row's query selected block n."""
    return tl.max((ids == n).to(tl.int32), 1) > 0


@triton.jit
def _kv_step(KD, VD, b, g, n, part, TK, NBLK, BSTART, BS: tl.constexpr, KB: tl.constexpr, D: tl.constexpr,
             DOCS: tl.constexpr):
    """Key positions j [KB] and the key and value rows [KB, D] of step `part` (KB keys) of block n,
    through TMA tensor descriptors of k and v viewed as [B*TK, G*D]. Rows past the block's end
    are whatever follows (the next document's keys, the next batch row's, zeros past the tensor):
    later than every query that selected the block, so the causal mask keeps them out of the
    scores. Their values enter as p = 0 times the value, as do a block's values for the rows of
    the tile that did not select it: the tile path takes finite keys and values (an infinite
    value makes those rows NaN; zeroing the rows past a block's end in the masked loop was 3-7%
    slower)."""
    if DOCS:
        start = tl.load(BSTART + b * NBLK + n)
    else:
        start = n * BS
    start += part * KB
    row = (b * TK + start).to(tl.int32)
    return start + tl.arange(0, KB), KD.load([row, g * D]), VD.load([row, g * D])


@triton.jit
def _fwd_block(q, hit, t, m, l, acc, KD, VD, b, g, n, TK, QOFF, NBLK, BSTART, qk_scale,
               BS: tl.constexpr, KB: tl.constexpr, D: tl.constexpr, DOCS: tl.constexpr, MASK: tl.constexpr):
    """One union block of the online softmax (exp2 domain), KB keys at a time. A row reads key j
    iff its query selected the block and j is not in its future; keys past a block's end are
    later than every query that selected the block. MASK=False: every row reads the whole block."""
    for part in tl.static_range(BS // KB):
        j, kt, vt = _kv_step(KD, VD, b, g, n, part, TK, NBLK, BSTART, BS, KB, D, DOCS)
        s = mm(q, tl.trans(kt)) * qk_scale
        if MASK:
            s = tl.where(hit[:, None] & (j[None, :] <= QOFF + t[:, None]), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + mm(p.to(vt.dtype), vt)
        m = m_new
    return m, l, acc


@triton.jit
def _whole_blocks(UNION, ub, nfull, QOFF, first, NBLK, BSTART, b, BS: tl.constexpr, UP: tl.constexpr,
                  DOCS: tl.constexpr):
    """How many of the union's first nfull blocks (those every query of the tile selected,
    ascending) end before the tile's first query, at position QOFF + first: these every row
    reads whole. A block's end here is the last of the BS keys the kernel loads from its start
    (a document's cut last block loads the keys after its end: it never counts, so the mask
    keeps them out). Ascending, they are a prefix of the nfull."""
    u = tl.arange(0, UP)
    n = tl.load(UNION + ub + u, mask=u < nfull, other=0)
    if DOCS:
        last = tl.load(BSTART + b * NBLK + n, mask=u < nfull, other=0) + BS - 1
    else:
        last = n * BS + BS - 1
    return tl.sum(((u < nfull) & (last <= QOFF + first)).to(tl.int32), 0)


@triton.jit
def tile_fwd_kernel(Q, KD, VD, O, LSE, IDS, UNION, UCOUNT, UFULL, BSTART, T, TK, QOFF, NBLK, NT, LIMIT,
                    qk_scale, HQ: tl.constexpr, HKV: tl.constexpr, SLOTS: tl.constexpr, KP: tl.constexpr,
                    H: tl.constexpr, HP: tl.constexpr, QT: tl.constexpr, U: tl.constexpr, BS: tl.constexpr,
                    KB: tl.constexpr, D: tl.constexpr, DOCS: tl.constexpr, UP: tl.constexpr, STAGES: tl.constexpr,
                    MASKED_STAGES: tl.constexpr):
    """One tile (program (tile, b*G + g)) whose union has at most LIMIT blocks (others exit: the
    gather path covers them): o [R, D] and lse [R] (natural log; -inf and o = 0 on an empty
    support), written directly. The blocks every row reads whole come first and skip the mask
    (as FlexAttention's full blocks), in a loop of their own. Keys and values come through the
    TMA descriptors KD, VD (`_kv_step`)."""
    tile = tl.program_id(0)
    bg = tl.program_id(1)
    count = tl.load(UCOUNT + bg.to(tl.int64) * NT + tile)
    if count > LIMIT:
        return
    b = (bg // HKV).to(tl.int64)
    g = bg % HKV
    t, row_ok, row, q, ids = _tile_rows(Q, IDS, b, g, tile, T, HQ, HKV, SLOTS, KP, H, HP, QT, D)
    ub = (bg.to(tl.int64) * NT + tile) * U
    whole = _whole_blocks(UNION, ub, tl.load(UFULL + bg.to(tl.int64) * NT + tile), QOFF, tile * QT, NBLK, BSTART,
                          b, BS, UP, DOCS)
    m = tl.full([QT * HP], float("-inf"), tl.float32)
    l = tl.zeros([QT * HP], tl.float32)
    acc = tl.zeros([QT * HP, D], tl.float32)
    if not INTERPRET:  # pipelined; the interpreter takes the while loops (triton_utils)
        for u in tl.range(0, whole, num_stages=STAGES):
            n = tl.load(UNION + ub + u)
            m, l, acc = _fwd_block(q, row_ok, t, m, l, acc, KD, VD, b, g, n, TK, QOFF, NBLK, BSTART, qk_scale,
                                   BS, KB, D, DOCS, False)
        for u in tl.range(whole, count, num_stages=MASKED_STAGES):
            n = tl.load(UNION + ub + u)
            m, l, acc = _fwd_block(q, _selected(ids, n), t, m, l, acc, KD, VD, b, g, n, TK, QOFF, NBLK, BSTART,
                                   qk_scale, BS, KB, D, DOCS, True)
    else:
        u = count * 0
        while u < count:
            n = tl.load(UNION + ub + u)
            if u < whole:
                m, l, acc = _fwd_block(q, row_ok, t, m, l, acc, KD, VD, b, g, n, TK, QOFF, NBLK, BSTART, qk_scale,
                                       BS, KB, D, DOCS, False)
            else:
                m, l, acc = _fwd_block(q, _selected(ids, n), t, m, l, acc, KD, VD, b, g, n, TK, QOFF, NBLK, BSTART,
                                       qk_scale, BS, KB, D, DOCS, True)
            u += 1
    empty = l == 0.0
    l_safe = tl.where(empty, 1.0, l)
    d = tl.arange(0, D)
    tl.store(O + row[:, None] * D + d[None, :], (acc / l_safe[:, None]).to(O.dtype.element_ty), mask=row_ok[:, None])
    tl.store(LSE + row, tl.where(empty, float("-inf"), (m + tl.log2(l_safe)) * LN2), mask=row_ok)


@triton.jit
def _row_stats(LSE, DELTA, DO, row, row_ok, D: tl.constexpr):
    """dO [R, D], lse in log2 units and delta of a tile's rows (0 where a row has no support)."""
    d = tl.arange(0, D)
    do = tl.load(DO + row[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
    lse = tl.load(LSE + row, mask=row_ok, other=0.0)
    lse2 = tl.where(lse == float("-inf"), 0.0, lse * LOG2E)
    delta = tl.load(DELTA + row, mask=row_ok, other=0.0)
    return do, lse2, delta


@triton.jit
def _dq_block(q, do, lse2, delta, hit, t, dq, K, V, b, g, n, TK, QOFF, NBLK, BSTART, BEND, qk_scale,
              HKV: tl.constexpr, BS: tl.constexpr, KB: tl.constexpr, D: tl.constexpr, DOCS: tl.constexpr):
    for part in tl.static_range(BS // KB):
        j, kt, vt = _kv_rows(K, V, b, g, n, part, TK, NBLK, BSTART, BEND, HKV, BS, KB, D, DOCS)
        vis = hit[:, None] & (j[None, :] <= QOFF + t[:, None])
        p = tl.where(vis, tl.exp2(mm(q, tl.trans(kt)) * qk_scale - lse2[:, None]), 0.0)
        ds = p * (mm(do, tl.trans(vt)) - delta[:, None])
        dq += mm(ds.to(kt.dtype), kt)
    return dq


@triton.jit
def tile_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, IDS, UNION, UCOUNT, BSTART, BEND, T, TK, QOFF, NBLK, NT,
                   qk_scale, sm_scale,
                   HQ: tl.constexpr, HKV: tl.constexpr, SLOTS: tl.constexpr, KP: tl.constexpr, H: tl.constexpr,
                   HP: tl.constexpr, QT: tl.constexpr, U: tl.constexpr, BS: tl.constexpr, KB: tl.constexpr,
                   D: tl.constexpr, DOCS: tl.constexpr):
    """dQ [R, D] of one tile over its union (P recomputed from lse), written directly."""
    tile = tl.program_id(0)
    bg = tl.program_id(1)
    b = (bg // HKV).to(tl.int64)
    g = bg % HKV
    t, row_ok, row, q, ids = _tile_rows(Q, IDS, b, g, tile, T, HQ, HKV, SLOTS, KP, H, HP, QT, D)
    do, lse2, delta = _row_stats(LSE, DELTA, DO, row, row_ok, D)
    ub = (bg.to(tl.int64) * NT + tile) * U
    count = tl.load(UCOUNT + bg.to(tl.int64) * NT + tile)
    dq = tl.zeros([QT * HP, D], tl.float32)
    if not INTERPRET:
        for u in range(0, count):
            n = tl.load(UNION + ub + u)
            dq = _dq_block(q, do, lse2, delta, _selected(ids, n), t, dq, K, V, b, g, n, TK, QOFF, NBLK, BSTART,
                           BEND, qk_scale, HKV, BS, KB, D, DOCS)
    else:
        u = count * 0
        while u < count:
            n = tl.load(UNION + ub + u)
            dq = _dq_block(q, do, lse2, delta, _selected(ids, n), t, dq, K, V, b, g, n, TK, QOFF, NBLK, BSTART,
                           BEND, qk_scale, HKV, BS, KB, D, DOCS)
            u += 1
    d = tl.arange(0, D)
    tl.store(DQ + row[:, None] * D + d[None, :], (dq * sm_scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _dkdv_tile(Q, DO, LSE, DELTA, IDS, ENTRY, i, start, kt, vt, j, n, dk, dv, b, g, T, NT, QOFF, qk_scale,
               HQ: tl.constexpr, HKV: tl.constexpr, SLOTS: tl.constexpr, KP: tl.constexpr, H: tl.constexpr,
               HP: tl.constexpr, QT: tl.constexpr, U: tl.constexpr, D: tl.constexpr):
    """One tile against the work item's block, transposed ([keys, rows], as the gather backward)."""
    tile = ((tl.load(ENTRY + start + i).to(tl.int64) // (U * HKV)) % NT).to(tl.int32)
    t, row_ok, row, q, ids = _tile_rows(Q, IDS, b, g, tile, T, HQ, HKV, SLOTS, KP, H, HP, QT, D)
    do, lse2, delta = _row_stats(LSE, DELTA, DO, row, row_ok, D)
    vis = _selected(ids, n)[None, :] & (j[:, None] <= QOFF + t[None, :])
    pt = tl.where(vis, tl.exp2(mm(kt, tl.trans(q)) * qk_scale - lse2[None, :]), 0.0)
    dv += mm(pt.to(do.dtype), do)
    dst = pt * (mm(vt, tl.trans(do)) - delta[None, :])
    dk += mm(dst.to(q.dtype), q)
    return dk, dv


@triton.jit
def tile_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DKP, DVP, IDS, ENTRY, ITEM_BUCKET, ITEM_START, ITEM_COUNT,
                     BSTART, BEND, T, TK, QOFF, NBLK, NT, qk_scale, sm_scale,
                     HQ: tl.constexpr, HKV: tl.constexpr, SLOTS: tl.constexpr, KP: tl.constexpr, H: tl.constexpr,
                     HP: tl.constexpr, QT: tl.constexpr, U: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
                     DOCS: tl.constexpr):
    """One work item (a run of the tiles whose union holds one block): dK/dV partials [items, BS, D]
    (fp32), reduced per bucket by gather.py's `sparse_bwd_reduce_kernel`. The union index's
    entries are ((b*NT + tile)*G + g)*U + slot."""
    pid = tl.program_id(0)
    bucket = tl.load(ITEM_BUCKET + pid)
    if bucket < 0:
        return
    start = tl.load(ITEM_START + pid)
    count = tl.load(ITEM_COUNT + pid)
    b, g, j, kt, vt = kv_block(K, V, bucket, TK, NBLK, BSTART, BEND, HKV, BS, D, DOCS)
    _, _, n = decode_bucket(bucket, NBLK, HKV)
    dk = tl.zeros([BS, D], tl.float32)
    dv = tl.zeros([BS, D], tl.float32)
    if not INTERPRET:
        for i in range(0, count):
            dk, dv = _dkdv_tile(Q, DO, LSE, DELTA, IDS, ENTRY, i, start, kt, vt, j, n, dk, dv, b, g, T, NT, QOFF,
                                qk_scale, HQ, HKV, SLOTS, KP, H, HP, QT, U, D)
    else:
        i = count * 0
        while i < count:
            dk, dv = _dkdv_tile(Q, DO, LSE, DELTA, IDS, ENTRY, i, start, kt, vt, j, n, dk, dv, b, g, T, NT, QOFF,
                                qk_scale, HQ, HKV, SLOTS, KP, H, HP, QT, U, D)
            i += 1
    d = tl.arange(0, D)
    out = pid.to(tl.int64) * BS * D + tl.arange(0, BS)[:, None] * D + d[None, :]
    tl.store(DKP + out, dk * sm_scale)
    tl.store(DVP + out, dv)


def tile_union_triton(idx: torch.Tensor, queries: int, docs: DocumentBlocks | None = None) -> TileUnion:
    """`tile_union_reference` in one kernel (`tile_union_kernel`), a program per tile."""
    B, T, G, K = idx.shape
    ids = table_ids(idx, docs)
    NT = triton.cdiv(T, queries)
    U = queries * K
    blocks = torch.empty(B, G, NT, U, dtype=torch.int32, device=idx.device)
    count = torch.empty(B, G, NT, dtype=torch.int32, device=idx.device)
    full = torch.empty_like(count)
    if B * G * NT:
        tile_union_kernel[(NT, B * G)](ids, blocks, count, full, T, NT, HKV=G, SLOTS=K, QT=queries, U=U,
                                       LP=triton.next_power_of_2(U), num_warps=4)
    return TileUnion(ids, blocks, count, full, queries)


def tile_union(idx: torch.Tensor, queries: int, docs: DocumentBlocks | None = None) -> TileUnion:
    """Each tile's union (`tile_union_reference`), with no host synchronisation: the kernel on GPU
    tensors, the reference elsewhere (the kernel's sort takes the interpreter about 0.1 s a tile,
    so CPU tests run the kernel on a few tiles only)."""
    return (tile_union_triton if idx.is_cuda else tile_union_reference)(idx, queries, docs)


def tile_queries(tuning: Tuning, H: int) -> int:
    """Queries per tile: `tuning.tile_rows` rows of the group's HP heads each, at least 16 rows on a
    GPU (a matrix product's least inner dimension, which the dK/dV kernel's products over rows need)."""
    HP = triton.next_power_of_2(H)
    return max(1, tuning.tile_rows // HP, 1 if interpreting() else triton.cdiv(16, HP))


def _stages(stages: int, D: int) -> int:
    """Pipeline stages of a tile kernel: each holds a key and a value step ([KB, D] each) in shared
    memory, so heads wider than 128 take one (two of D = 256 would not fit in an H200's 227 KiB
    with the tile's other buffers)."""
    return stages if D <= 128 else 1


def _tile_keys(keys: int, block_size: int, D: int) -> int:
    """Keys a step of a tile kernel: at most a block, and for heads wider than 128 at most 32 (the
    forward's two loops each keep a key and a value step in shared memory beside the tile's
    [rows, D] queries)."""
    return min(keys, block_size, 32 if D > 128 else keys)


def _tile_args(q, k, union: TileUnion, block_size, docs):
    B, T, Hq, G, H, HP, D = geometry(q, k, block_size)
    TK = k.shape[1]
    K = union.ids.shape[-1]
    N, bstart, bend, DOCS = block_tables(docs, TK, block_size, union.ids)
    NT, U = union.blocks.shape[2:]
    return (B, T, TK, G, N, NT, bstart, bend,
            dict(HQ=Hq, HKV=G, SLOTS=K, KP=triton.next_power_of_2(K), H=H, HP=HP, QT=union.queries, U=U,
                 BS=block_size, D=D, DOCS=DOCS))


def _rows_descriptor(x: torch.Tensor, rows: int) -> TensorDescriptor:
    """A TMA descriptor of contiguous x [B, TK, G, D] viewed as [B*TK, G*D], loading [rows, D]
    (a TMA copy needs a 16-byte aligned start: an unaligned view is copied first)."""
    B, TK, G, D = x.shape
    if x.data_ptr() % 16:
        x = x.clone()
    return TensorDescriptor.from_tensor(x.view(B * TK, G * D), [rows, D])


def tile_forward(q, k, v, union: TileUnion, block_size, scale, q_offset=0, tuning: Tuning = DEFAULT_TUNING,
                 docs: DocumentBlocks | None = None, limit: int | None = None, out=None):
    """o [B, T, Hq, D] and lse fp32 [B, T, Hq] of the tile path, one program per (tile, b, g). Only
    tiles whose union holds at most `limit` blocks (None: all) are written, into `out` (o, lse)
    when given."""
    B, T, TK, G, N, NT, bstart, bend, meta = _tile_args(q, k, union, block_size, docs)
    o, lse = out if out is not None else (torch.empty_like(q),
                                          torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device))
    KB = _tile_keys(tuning.tile_keys, block_size, meta["D"])
    COMPILED["tile_fwd"] = tile_fwd_kernel[(NT, B * G)](
        q, _rows_descriptor(k, KB), _rows_descriptor(v, KB), o, lse, union.ids, union.blocks, union.count,
        union.full, bstart, T, TK, q_offset, N, NT, meta["U"] if limit is None else limit, scale * LOG2E.value,
        **meta, KB=KB, UP=triton.next_power_of_2(meta["U"]),
        STAGES=_stages(tuning.tile_stages, meta["D"]),
        MASKED_STAGES=_stages(tuning.tile_masked_stages, meta["D"]), num_warps=tuning.tile_warps)
    return o, lse


def tile_backward(do, q, k, v, o, lse, union: TileUnion, block_size, scale, q_offset=0,
                  tuning: Tuning = DEFAULT_TUNING, docs: DocumentBlocks | None = None):
    """(dq, dk, dv) of `tile_forward`: dQ per tile over its union; dK/dV per block over the tiles
    whose union holds it (an inverse index of the unions, chunked over tiles so that the work
    items' fp32 partials stay under the gather path's partial budget), reduced in order."""
    B, T, TK, G, N, NT, bstart, bend, meta = _tile_args(q, k, union, block_size, docs)
    delta = softmax_delta(do, o)
    dq = torch.empty_like(q)
    COMPILED["tile_dq"] = tile_dq_kernel[(NT, B * G)](
        q, k, v, do, lse, delta, dq, union.ids, union.blocks, union.count, bstart, bend, T, TK, q_offset, N, NT,
        scale * LOG2E.value, scale, **meta, KB=_tile_keys(tuning.tile_dq_keys, block_size, meta["D"]),
        num_warps=tuning.tile_warps, num_stages=_stages(tuning.tile_dq_stages, meta["D"]))
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    per_item = tuning.tile_dkdv_tiles
    U, D = meta["U"], meta["D"]
    item_bytes = 2 * block_size * D * 4
    budget = partial_budget(tuning, q.numel() * q.element_size())
    chunk = equal_chunks(NT, triton.cdiv(B * G * U, per_item) * item_bytes, budget)
    index = build_inverse_index(union.blocks.permute(0, 2, 1, 3).contiguous(), N, chunk)
    ib, istart, icount = schedule(index, per_item)
    first, runs = bucket_items(index, per_item)
    dkp = torch.empty(ib.shape[1], block_size, D, dtype=torch.float32, device=q.device)
    dvp = torch.empty_like(dkp)
    rb = min(32, block_size)
    for c in range(index.n_chunks):
        COMPILED["tile_dkdv"] = tile_dkdv_kernel[(ib.shape[1],)](
            q, k, v, do, lse, delta, dkp, dvp, union.ids, index.entry, ib[c], istart[c], icount[c], bstart, bend,
            T, TK, q_offset, N, NT, scale * LOG2E.value, scale, **meta,
            num_warps=tuning.tile_dkdv_warps, num_stages=1)
        sparse_bwd_reduce_kernel[(runs.shape[1], block_size // rb)](
            dkp, dvp, dk, dv, first[c], runs[c], bstart, bend, TK, N,
            HKV=G, BS=block_size, RB=rb, D=D, DOCS=meta["DOCS"], num_warps=4)
    return dq, dk.to(k.dtype), dv.to(v.dtype)
