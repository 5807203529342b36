"""Fused Triton kernels of the index branch: scores, block max and exp-free top-k in one pass.

B = batch, T = queries, TK = keys (query t sits at position QOFF + t; TK = QOFF + T), G = GQA
groups (= Hkv), Di = index head dim, N = key blocks of `block_size` tokens, K = top-k blocks. Inside
kernels: R = rows of a program (BM queries x GP
groups, row r is query t0 + r // GP, group r % GP), C = key columns of a tile, NB = blocks per tile.

One program owns BM consecutive queries and every group: the G index queries of a token share
the single index key, so they stack into one [R, Di] operand of the score matmul. It walks the
causally visible key tiles, reduces each [R, C] score tile to block maxima in registers and
merges them into a running top-k per row; scores and block scores never reach memory.

Packed documents (DOCS): a row's blocks count from its document's start, so they no longer line
up with the key tiles and differ between rows of one program. Each tile's scores are then split
per row into the (at most NB + 1) document-relative blocks it touches; a block that continues
into the next tile is carried over and offered to the top-k once it is complete.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import as_int32, check_block_size, num_blocks
from ..triton_utils import INTERPRET, dot
from .fp8 import check_precision, quantize_index
from .tuning import Tuning, default_tuning

# what the fused kernel emits (MODE): the selection, the raw block scores (stage one of a
# two-stage path, used to time the top-k stage alone), or only a max of block scores (to time
# scoring); bench/select_blocks_stages.py launches the last two
SELECT, SCORES, BARE = 0, 1, 2


@triton.jit
def leaving_slot(topv_KR, topi_KR, low_R, slot_K, KP: tl.constexpr, AXIS: tl.constexpr):
    """The slot a better candidate replaces, as its key (`slot_keys`): of the slots holding the
    minimum, the one with the largest block id, so that equal scores keep the lowest ids whatever
    order the blocks come in; of empty slots (id -1), the first, so that slots fill in order.
    AXIS: the slot axis."""
    if AXIS == 1:
        return tl.max(tl.where(topv_KR == low_R[:, None], slot_keys(topi_KR, slot_K, KP, 1), -2147483647), axis=1)
    else:
        return tl.max(tl.where(topv_KR == low_R[None, :], slot_keys(topi_KR, slot_K, KP, 0), -2147483647), axis=0)


@triton.jit
def slot_keys(topi_KR, slot_K, KP: tl.constexpr, AXIS: tl.constexpr):
    """id*KP + (KP - 1 - slot) per slot: unique (kept ids are distinct, empty slots hold -1 and
    differ by slot), ordered by id, then by slot reversed."""
    if AXIS == 1:
        return topi_KR * KP + (KP - 1 - slot_K[None, :])
    else:
        return topi_KR * KP + (KP - 1 - slot_K[:, None])


@triton.jit
def takes_candidate(x_R, n_R, low_R, out_R, KP: tl.constexpr):
    """Whether candidate (x, n) enters: a larger score than the minimum, or an equal one and a
    lower block id than the leaving slot's (n < id iff n*KP + KP - 1 < its key id*KP + r, r < KP)."""
    return (x_R > low_R) | ((x_R == low_R) & (n_R * KP + (KP - 1) < out_R))


@triton.jit
def _update(topv_RK, topi_RK, low_R, x_R, n_R, slot_K):
    KP: tl.constexpr = slot_K.shape[0]
    out_R = leaving_slot(topv_RK, topi_RK, low_R, slot_K, KP, 1)
    take_RK = (slot_keys(topi_RK, slot_K, KP, 1) == out_R[:, None]) & takes_candidate(x_R, n_R, low_R, out_R, KP)[:, None]
    topv_RK = tl.where(take_RK, x_R[:, None], topv_RK)
    topi_RK = tl.where(take_RK, n_R[:, None], topi_RK)
    return topv_RK, topi_RK, tl.min(topv_RK, axis=1)


@triton.jit
def _insert(topv_RK, topi_RK, low_R, x_R, n_R, slot_K, TRACK: tl.constexpr = False, SKIP: tl.constexpr = False):
    """Put candidate (x, n) of each row in place of the row's smallest kept value if it is larger.

    Without TRACK the minimum is found anew (low_R passes through unused). TRACK keeps it in low_R
    with the state, and SKIP then first asks whether any row of the program takes its candidate,
    updating only if one does. Far into a long row few candidates win (after n blocks a random
    one enters a row's top-k with probability about k / n), so the update is mostly skipped; in
    shorter rows the question (a reduction over the program) costs more than it saves, and a
    kernel that tracks the minimum runs slower: only fp8-score
    kernels over more than `Tuning.skip_from` blocks track it (`_skips`)."""
    if TRACK:
        if SKIP:
            # a candidate equal to a row's minimum may enter too (a lower block id): ask for >=
            if tl.max(((x_R > low_R) | ((x_R == low_R) & (x_R > float("-inf")))).to(tl.int32), axis=0) > 0:
                topv_RK, topi_RK, low_R = _update(topv_RK, topi_RK, low_R, x_R, n_R, slot_K)
        else:
            topv_RK, topi_RK, low_R = _update(topv_RK, topi_RK, low_R, x_R, n_R, slot_K)
    else:
        topv_RK, topi_RK, _ = _update(topv_RK, topi_RK, tl.min(topv_RK, axis=1), x_R, n_R, slot_K)
    return topv_RK, topi_RK, low_R


@triton.jit
def _init_topk(nloc_R, R: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, SINK: tl.constexpr,
               LOCAL: tl.constexpr):
    """Running top-k state: the forced blocks sit in the first slots with +inf, never displaced.

    Slot l < LOCAL holds block nloc - l (the local block first); a slot whose block would be
    before block 0 stays empty, which only happens when every visible block is already forced."""
    slot_K = tl.arange(0, KP)
    # padding slots (K not a power of two) hold +inf so they are never the minimum
    topv_RK = tl.where(slot_K[None, :] < K, float("-inf"), float("inf")) + tl.zeros([R, KP], tl.float32)
    topi_RK = tl.full([R, KP], -1, tl.int32)
    forced_RK = nloc_R[:, None] - slot_K[None, :]
    local_RK = (slot_K[None, :] < LOCAL) & (forced_RK >= 0)
    topv_RK = tl.where(local_RK, float("inf"), topv_RK)
    topi_RK = tl.where(local_RK, forced_RK, topi_RK)
    if SINK:
        if K > LOCAL:
            sink_RK = (slot_K[None, :] == LOCAL) & (nloc_R[:, None] >= LOCAL)
            topv_RK = tl.where(sink_RK, float("inf"), topv_RK)
            topi_RK = tl.where(sink_RK, 0, topi_RK)
    return topv_RK, topi_RK, tl.min(topv_RK, axis=1), slot_K


@triton.jit
def _store_topk(out_ptr, topi_RK, slot_K, row_off_R, valid_R, K: tl.constexpr):
    """Write the kept block ids. Slots fill in order and are never emptied, so -1 padding is last."""
    tl.store(out_ptr + row_off_R[:, None] + slot_K[None, :], topi_RK, mask=valid_R[:, None] & (slot_K[None, :] < K))


@triton.jit
def _block_max(s_RC, R: tl.constexpr, C: tl.constexpr, BLOCK: tl.constexpr):
    """[R, C] scores -> [R, C // BLOCK] per-block maxima."""
    if C == BLOCK:
        bm_RN = tl.max(s_RC, axis=1)[:, None]
    else:
        bm_RN = tl.max(tl.reshape(s_RC, [R, C // BLOCK, BLOCK]), axis=2)
    return bm_RN


@triton.jit
def _tile_scores(q_RD, ik_base, s_ik_t, kt, TK, C: tl.constexpr, DI: tl.constexpr, DP: tl.constexpr,
                 PREC: tl.constexpr):
    """Scores [R, C] of the rows against key tile kt (keys j_C [C]; keys past TK score 0)."""
    j_C = kt * C + tl.arange(0, C)
    d_D = tl.arange(0, DP)
    k_CD = tl.load(ik_base + j_C[:, None].to(tl.int64) * s_ik_t + d_D[None, :],
                   mask=(j_C[:, None] < TK) & (d_D[None, :] < DI), other=0.0)
    return dot(q_RD, tl.trans(k_CD), PREC), j_C


@triton.jit
def _score_tile(q_RD, ik_base, ks_base, s_ik_t, kt, p_R, TK, N, R: tl.constexpr, C: tl.constexpr,
                DI: tl.constexpr, DP: tl.constexpr, BLOCK: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr,
                KSCALE: tl.constexpr):
    """Block maxima [R, C // BLOCK] of key tile kt; keys after a row's position p_R (or past TK)
    count -inf. KSCALE: fp8 keys, each block's maxima times its scale (ks_base [N]; a positive
    factor commutes with the max)."""
    s_RC, j_C = _tile_scores(q_RD, ik_base, s_ik_t, kt, TK, C, DI, DP, PREC)
    if CAUSAL:
        s_RC = tl.where(j_C[None, :] <= p_R[:, None], s_RC, float("-inf"))
    bm_RN = _block_max(s_RC, R, C, BLOCK)
    if KSCALE:
        n_N = kt * (C // BLOCK) + tl.arange(0, C // BLOCK)
        bm_RN = bm_RN * tl.load(ks_base + n_N, mask=n_N < N, other=1.0)[None, :]
    return bm_RN


@triton.jit
def _consume(bm_RN, kt, topv_RK, topi_RK, low_R, seen_R, slot_K, nloc_R, out_ptr, row_R, valid_R, N,
             R: tl.constexpr, NB: tl.constexpr, SINK: tl.constexpr,
             MODE: tl.constexpr, LOCAL: tl.constexpr, TRACK: tl.constexpr, SKIP: tl.constexpr):
    """Fold one tile's block maxima into the running top-k (or store them at the rows' offsets
    row_R of out_ptr, or only keep a max)."""
    if MODE == 0:
        for jb in tl.static_range(NB):
            if NB == 1:
                x_R = tl.reshape(bm_RN, [R])
            else:
                x_R = tl.max(tl.where(tl.arange(0, NB)[None, :] == jb, bm_RN, float("-inf")), axis=1)
            n = kt * NB + jb
            # forced blocks already sit in the top-k: keep them from taking a second slot
            drop_R = (n <= nloc_R) & (n > nloc_R - LOCAL)
            if SINK:
                drop_R = drop_R | (n == 0)
            x_R = tl.where(drop_R, float("-inf"), x_R)
            topv_RK, topi_RK, low_R = _insert(topv_RK, topi_RK, low_R, x_R, tl.zeros([R], tl.int32) + n, slot_K,
                                              TRACK, SKIP)
    elif MODE == 1:
        n_N = kt * NB + tl.arange(0, NB)
        tl.store(out_ptr + row_R[:, None] + n_N[None, :], bm_RN, mask=valid_R[:, None] & (n_N[None, :] < N))
    else:
        seen_R = tl.maximum(seen_R, tl.max(bm_RN, axis=1))
    return topv_RK, topi_RK, low_R, seen_R


@triton.jit
def _tiles(kt0, kt1, q_RD, ik_base, ks_base, s_ik_t, p_R, TK, N, topv_RK, topi_RK, low_R, seen_R, slot_K, nloc_R,
           out_ptr, row_R, valid_R, R: tl.constexpr, C: tl.constexpr, DI: tl.constexpr, DP: tl.constexpr,
           BLOCK: tl.constexpr, SINK: tl.constexpr, MODE: tl.constexpr, LOCAL: tl.constexpr, PREC: tl.constexpr,
           KSCALE: tl.constexpr, CAUSAL: tl.constexpr, TRACK: tl.constexpr, SKIP: tl.constexpr):
    """Key tiles kt0 .. kt1 - 1 of a program whose rows are one document each: each tile's block
    maxima folded into the state (CAUSAL: the tiles reach a row's position; TRACK, SKIP: see
    `_insert`). The compiler software-pipelines the for loop; the interpreter takes the while loop
    (triton_utils)."""
    if INTERPRET:
        kt = kt1 * 0 + kt0
        while kt < kt1:
            bm_RN = _score_tile(q_RD, ik_base, ks_base, s_ik_t, kt, p_R, TK, N, R, C, DI, DP, BLOCK, CAUSAL, PREC,
                                KSCALE)
            topv_RK, topi_RK, low_R, seen_R = _consume(bm_RN, kt, topv_RK, topi_RK, low_R, seen_R, slot_K, nloc_R,
                                                       out_ptr, row_R, valid_R, N, R, C // BLOCK, SINK, MODE, LOCAL,
                                                       TRACK, SKIP)
            kt += 1
    else:
        for kt in range(kt0, kt1):
            bm_RN = _score_tile(q_RD, ik_base, ks_base, s_ik_t, kt, p_R, TK, N, R, C, DI, DP, BLOCK, CAUSAL, PREC,
                                KSCALE)
            topv_RK, topi_RK, low_R, seen_R = _consume(bm_RN, kt, topv_RK, topi_RK, low_R, seen_R, slot_K, nloc_R,
                                                       out_ptr, row_R, valid_R, N, R, C // BLOCK, SINK, MODE, LOCAL,
                                                       TRACK, SKIP)
    return topv_RK, topi_RK, low_R, seen_R


@triton.jit
def _offer(topv_RK, topi_RK, low_R, x_R, n_R, nloc_R, slot_K, SINK: tl.constexpr, LOCAL: tl.constexpr):
    """Offer block n_R (score x_R) of each row to its running top-k; forced blocks (the LOCAL
    blocks ending with the local one, the sink) and n < 0 (no block) are not candidates."""
    drop_R = ((n_R <= nloc_R) & (n_R > nloc_R - LOCAL)) | (n_R < 0)
    if SINK:
        drop_R = drop_R | (n_R == 0)
    return _insert(topv_RK, topi_RK, low_R, tl.where(drop_R, float("-inf"), x_R), n_R, slot_K)


@triton.jit
def _doc_tile(q_RD, ik_base, ks_base, s_ik_t, kt, TK, start_R, p_R, nloc_R, topv_RK, topi_RK, low_R, slot_K,
              carry_n_R, carry_x_R, C: tl.constexpr, DI: tl.constexpr, DP: tl.constexpr, BLOCK: tl.constexpr,
              SINK: tl.constexpr, PREC: tl.constexpr, LOCAL: tl.constexpr, KSCALE: tl.constexpr):
    """One key tile with packed documents: row r sees keys start_R .. p_R, and key j is in its
    block (j - start_R) // BLOCK. The tile's NB + 1 possible blocks per row are reduced one by
    one; the block in progress (carry_n_R, its max so far carry_x_R) is offered to the top-k when
    a later block with a visible key begins. KSCALE: fp8 keys, each key's score times its
    (sequence) block's scale."""
    NB: tl.constexpr = C // BLOCK
    s_RC, j_C = _tile_scores(q_RD, ik_base, s_ik_t, kt, TK, C, DI, DP, PREC)
    if KSCALE:
        s_RC = s_RC * tl.load(ks_base + j_C // BLOCK, mask=j_C < TK, other=1.0)[None, :]
    vis_RC = (j_C[None, :] <= p_R[:, None]) & (j_C[None, :] >= start_R[:, None])
    s_RC = tl.where(vis_RC, s_RC, float("-inf"))
    # keys before the document's start are -inf, so their (clamped) block does not matter
    n_RC = tl.maximum(j_C[None, :] - start_R[:, None], 0) // BLOCK
    n0_R = tl.maximum(kt * C - start_R, 0) // BLOCK
    for i in tl.static_range(NB + 1):
        n_R = n0_R + i
        x_R = tl.max(tl.where(n_RC == n_R[:, None], s_RC, float("-inf")), axis=1)
        fresh_R = (n_R != carry_n_R) & (x_R > float("-inf"))
        topv_RK, topi_RK, low_R = _offer(topv_RK, topi_RK, low_R, tl.where(fresh_R, carry_x_R, float("-inf")),
                                         carry_n_R, nloc_R, slot_K, SINK, LOCAL)
        carry_x_R = tl.where(fresh_R, x_R, tl.where(n_R == carry_n_R, tl.maximum(carry_x_R, x_R), carry_x_R))
        carry_n_R = tl.where(fresh_R, n_R, carry_n_R)
    return topv_RK, topi_RK, low_R, carry_n_R, carry_x_R


@triton.jit
def _fused_kernel(iq_ptr, ik_ptr, ks_ptr, out_ptr, doc_ptr, T, TK, QOFF, N, skip_tile,
                  s_iq_b, s_iq_t, s_iq_g, s_ik_b, s_ik_t, s_out_b, s_out_t, s_out_g,
                  G: tl.constexpr, GP: tl.constexpr, DI: tl.constexpr, DP: tl.constexpr,
                  BLOCK: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, BM: tl.constexpr,
                  C: tl.constexpr, SINK: tl.constexpr, MODE: tl.constexpr, PREC: tl.constexpr,
                  DOCS: tl.constexpr, LOCAL: tl.constexpr, KSCALE: tl.constexpr, SKIP: tl.constexpr):
    R: tl.constexpr = BM * GP
    # the last query tiles read the most keys: start them first
    qt = tl.cdiv(T, BM) - 1 - tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    t0 = qt * BM
    r_R = tl.arange(0, R)
    t_R = t0 + r_R // GP
    g_R = r_R % GP
    valid_R = (t_R < T) & (g_R < G)
    # the rows' offsets in the output (MODE 0 and 1)
    row_R = b * s_out_b + t_R.to(tl.int64) * s_out_t + g_R * s_out_g
    d_D = tl.arange(0, DP)
    q_RD = tl.load(iq_ptr + b * s_iq_b + t_R[:, None].to(tl.int64) * s_iq_t + g_R[:, None] * s_iq_g + d_D[None, :],
                   mask=valid_R[:, None] & (d_D[None, :] < DI), other=0.0)
    ik_base = ik_ptr + b * s_ik_b
    # fp8 keys: the [B, N] block scales of the sequence's blocks
    ks_base = ks_ptr + b * N
    # causal positions of the rows
    p_R = QOFF + t_R
    if DOCS:
        start_R = tl.load(doc_ptr + b * T + t_R, mask=valid_R, other=0)
        nloc_R = (p_R - start_R) // BLOCK
    else:
        nloc_R = p_R // BLOCK
    topv_RK, topi_RK, low_R, slot_K = _init_topk(nloc_R, R, K, KP, SINK, LOCAL)
    seen_R = tl.full([R], float("-inf"), tl.float32)

    p_last = QOFF + tl.minimum(t0 + BM, T) - 1
    # tiles that end before the tile's first position need no causal mask and hold no local block
    n_full = (QOFF + t0) // C
    n_tiles = p_last // C + 1
    # the compiler software-pipelines the for loops; the interpreter takes the while loop (triton_utils)
    if DOCS:
        carry_n_R = tl.full([R], -1, tl.int32)
        carry_x_R = tl.full([R], float("-inf"), tl.float32)
        # starts do not decrease along a row: the program's keys begin at its first query's document
        kt_first = tl.load(doc_ptr + b * T + t0) // C
        if INTERPRET:
            kt = kt_first
            while kt < n_tiles:
                topv_RK, topi_RK, low_R, carry_n_R, carry_x_R = _doc_tile(
                    q_RD, ik_base, ks_base, s_ik_t, kt, TK, start_R, p_R, nloc_R, topv_RK, topi_RK, low_R, slot_K,
                    carry_n_R, carry_x_R, C, DI, DP, BLOCK, SINK, PREC, LOCAL, KSCALE)
                kt += 1
        else:
            for kt in range(kt_first, n_tiles):
                topv_RK, topi_RK, low_R, carry_n_R, carry_x_R = _doc_tile(
                    q_RD, ik_base, ks_base, s_ik_t, kt, TK, start_R, p_R, nloc_R, topv_RK, topi_RK, low_R, slot_K,
                    carry_n_R, carry_x_R, C, DI, DP, BLOCK, SINK, PREC, LOCAL, KSCALE)
        # the last block in progress (a row's local block, which is forced: offered for completeness)
        topv_RK, topi_RK, low_R = _offer(topv_RK, topi_RK, low_R, carry_x_R, carry_n_R, nloc_R, slot_K, SINK, LOCAL)
    else:
        # tiles before the diagonal need no causal mask; with SKIP, those from skip_tile on update
        # the top-k only when some row wins (the diagonal tiles, a row's most recent blocks, always)
        n_plain = n_full
        if SKIP:
            n_plain = tl.minimum(n_full, skip_tile)
        topv_RK, topi_RK, low_R, seen_R = _tiles(
            0, n_plain, q_RD, ik_base, ks_base, s_ik_t, p_R, TK, N, topv_RK, topi_RK, low_R, seen_R, slot_K, nloc_R,
            out_ptr, row_R, valid_R, R, C, DI, DP, BLOCK, SINK, MODE, LOCAL, PREC, KSCALE, False, SKIP, False)
        if SKIP:
            topv_RK, topi_RK, low_R, seen_R = _tiles(
                n_plain, n_full, q_RD, ik_base, ks_base, s_ik_t, p_R, TK, N, topv_RK, topi_RK, low_R, seen_R, slot_K,
                nloc_R, out_ptr, row_R, valid_R, R, C, DI, DP, BLOCK, SINK, MODE, LOCAL, PREC, KSCALE, False, True,
                True)
        topv_RK, topi_RK, low_R, seen_R = _tiles(
            n_full, n_tiles, q_RD, ik_base, ks_base, s_ik_t, p_R, TK, N, topv_RK, topi_RK, low_R, seen_R, slot_K,
            nloc_R, out_ptr, row_R, valid_R, R, C, DI, DP, BLOCK, SINK, MODE, LOCAL, PREC, KSCALE, True, SKIP, False)

    if MODE == 0:
        _store_topk(out_ptr, topi_RK, slot_K, row_R, valid_R, K)
    elif MODE == 2:
        tl.store(out_ptr + b * s_out_b + t_R.to(tl.int64) * GP + g_R, seen_R, mask=valid_R)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _skips(mode, precision, doc_start, n_blocks, cfg) -> bool:
    """Whether the kernel tracks each row's minimum and skips top-k updates no row wins (`_insert`):
    for fp8 scores over more than `cfg.skip_from` blocks. With products in the input precision
    the tracking costs more than the skips save at every length measured, up to 1M keys."""
    return mode == SELECT and precision == "fp8" and doc_start is None and n_blocks > cfg.skip_from


def launch_fused(iq_BTGI, ik_BTI, out, block_size, topk, force_sink, mode, tuning, q_offset=0, doc_start=None,
                  local_blocks=1, precision="input"):
    """Launch the fused kernel over iq [B, T, G, Di] and ik [B, TK, Di] into `out`, which `mode` says
    what to write to: SELECT the top-k ids (int32 [B, T, G, topk]), SCORES the block scores (fp32
    [B, T, G, N]), BARE each row's best block score (fp32 [B, T * GP])."""
    B, T, G, Di = iq_BTGI.shape
    TK = ik_BTI.shape[1]
    check_block_size(block_size, triton="select_blocks")
    check_precision(precision, iq_BTGI.device)
    ik_scale = None
    if precision == "fp8":
        iq_BTGI, ik_BTI, ik_scale = quantize_index(iq_BTGI, ik_BTI, block_size)
    # fp32 inputs get full-precision products (tf32 could swap near-tied blocks)
    prec = "ieee" if iq_BTGI.dtype == torch.float32 else "tf32"
    cfg = tuning or default_tuning(iq_BTGI.device)
    GP = _next_pow2(G)
    BM = max(2, cfg.rows // GP)
    C = max(cfg.cols, block_size)
    iq_BTGI = iq_BTGI.contiguous()
    ik_BTI = ik_BTI.contiguous()
    grid = (triton.cdiv(T, BM), B)
    s_out = out.stride()[:3] if mode != BARE else (T * GP, 0, 0)
    if doc_start is not None:
        doc_start = as_int32(doc_start)
    _fused_kernel[grid](
        iq_BTGI, ik_BTI, out if ik_scale is None else ik_scale, out, out if doc_start is None else doc_start, T, TK,
        q_offset, num_blocks(TK, block_size), max(0, cfg.skip_from * block_size // C),
        iq_BTGI.stride(0), iq_BTGI.stride(1), iq_BTGI.stride(2), ik_BTI.stride(0), ik_BTI.stride(1),
        *s_out,
        G=G, GP=GP, DI=Di, DP=max(16, _next_pow2(Di)), BLOCK=block_size, K=topk, KP=_next_pow2(topk),
        BM=BM, C=C, SINK=bool(force_sink), MODE=mode,
        PREC=prec, DOCS=doc_start is not None, LOCAL=int(local_blocks), KSCALE=ik_scale is not None,
        SKIP=_skips(mode, precision, doc_start, num_blocks(TK, block_size), cfg),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def select_blocks_triton(iq_BTGI: torch.Tensor, ik_BTI: torch.Tensor, block_size: int, topk: int,
                         force_sink: bool = False, tuning: Tuning | None = None, q_offset: int = 0,
                         doc_start: torch.Tensor | None = None, local_blocks: int = 1,
                         precision: str = "input") -> torch.Tensor:
    """Fused index scoring, block max and top-k.

    iq_BTGI: [B, T, G, Di] and ik_BTI: [B, TK, Di], bf16, fp16 or fp32 (scores accumulate in fp32;
    fp32 inputs use full-precision products); query t sits at position q_offset + t and
    TK = q_offset + T. Returns int32 [B, T, G, topk]: per (b, t, g) the `local_blocks` blocks
    ending with the local one, block 0 too if `force_sink`, and the best other causally visible
    blocks by max_j iq[t,g].ik[j] over visible keys j of the block. Slot 0 holds the local block,
    -1 padding comes last, the rest is in no particular order. With doc_start int [B, T] (packed
    documents) a query sees its own document only and its block ids count from the document's
    start (the local block is then (q_offset + t - doc_start[t]) // block_size).
    `precision="fp8"`: the scores are products of iq and ik quantized to float8 e4m3, on the fp8
    tensor cores (`fp8.py`).
    """
    B, T, G, _ = iq_BTGI.shape
    if ik_BTI.shape[1] != q_offset + T:
        raise ValueError(f"index keys cover {ik_BTI.shape[1]} tokens; q_offset + T = {q_offset + T}")
    out = torch.empty((B, T, G, topk), dtype=torch.int32, device=iq_BTGI.device)
    if T == 0:
        return out
    return launch_fused(iq_BTGI, ik_BTI, out, block_size, topk, force_sink, SELECT, tuning, int(q_offset),
                         doc_start, local_blocks, precision)


