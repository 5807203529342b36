"""The index branch's kernel in stages, for benchmarks: the block scores alone, the top-k of given
block scores (a kernel of its own), and the scoring without the top-k. select_blocks fuses them
(msa_model/ops/select_blocks/triton.py); bench/bench_select_blocks.py and bench_index_precision.py
time the stages, and tests/test_select_blocks_triton.py checks them against the reference.

B = batch, T = queries, G = GQA groups, N = key blocks, K = top-k blocks; in the kernel R = rows
of a program (BM queries x GP groups), KP = K rounded up to a power of two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from msa_model.ops.common import check_block_size, num_blocks
from msa_model.ops.select_blocks.triton import (BARE, SCORES, Tuning, default_tuning, launch_fused, leaving_slot,
                                                slot_keys, takes_candidate)


@triton.jit
def _topk_kernel(bs_ptr, out_ptr, T, N, s_bs_b, s_bs_t, s_bs_g, s_out_b, s_out_t, s_out_g,
                 G: tl.constexpr, GP: tl.constexpr, BLOCK: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                 BM: tl.constexpr, SINK: tl.constexpr):
    """One warp per program, one row per lane: the running top-k is kept transposed, [KP, R], so its
    slots sit in one thread and the min/argmin of an insertion need no cross-lane shuffles."""
    R: tl.constexpr = BM * GP
    qt = tl.cdiv(T, BM) - 1 - tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    t0 = qt * BM
    r_R = tl.arange(0, R)
    t_R = t0 + r_R // GP
    g_R = r_R % GP
    valid_R = (t_R < T) & (g_R < G)
    nloc_R = t_R // BLOCK
    slot_K = tl.arange(0, KP)
    topv_KR = tl.where(slot_K[:, None] < K, float("-inf"), float("inf")) + tl.zeros([KP, R], tl.float32)
    topv_KR = tl.where(slot_K[:, None] == 0, float("inf"), topv_KR)
    topi_KR = tl.where(slot_K[:, None] == 0, nloc_R[None, :], -1)
    if SINK:
        if K > 1:
            sink_KR = (slot_K[:, None] == 1) & (nloc_R[None, :] != 0)
            topv_KR = tl.where(sink_KR, float("inf"), topv_KR)
            topi_KR = tl.where(sink_KR, 0, topi_KR)
    row_R = b * s_bs_b + t_R.to(tl.int64) * s_bs_t + g_R * s_bs_g
    n_vis = tl.minimum((tl.minimum(t0 + BM, T) - 1) // BLOCK + 1, N)
    c_C = tl.arange(0, 4)
    # a while loop: the interpreter cannot take a program-dependent bound in range()
    c0 = n_vis * 0
    while c0 < n_vis:
        n_C = c0 + c_C
        # only causally visible blocks are read: later ones hold no visible key
        vis_CR = valid_R[None, :] & (n_C[:, None] <= nloc_R[None, :]) & (n_C[:, None] < N)
        x_CR = tl.load(bs_ptr + row_R[None, :] + n_C[:, None], mask=vis_CR, other=float("-inf"))
        drop_CR = n_C[:, None] == nloc_R[None, :]
        if SINK:
            drop_CR = drop_CR | (n_C[:, None] == 0)
        x_CR = tl.where(drop_CR, float("-inf"), x_CR)
        for jc in tl.static_range(4):
            x_R = tl.max(tl.where(c_C[:, None] == jc, x_CR, float("-inf")), axis=0)
            low_R = tl.min(topv_KR, axis=0)
            out_R = leaving_slot(topv_KR, topi_KR, low_R, slot_K, KP, 0)
            n_R = tl.zeros_like(out_R) + c0 + jc
            take_R = takes_candidate(x_R, n_R, low_R, out_R, KP)
            take_KR = (slot_keys(topi_KR, slot_K, KP, 0) == out_R[None, :]) & take_R[None, :]
            topv_KR = tl.where(take_KR, x_R[None, :], topv_KR)
            topi_KR = tl.where(take_KR, n_R[None, :], topi_KR)
        c0 += 4
    out_R = b * s_out_b + t_R.to(tl.int64) * s_out_t + g_R * s_out_g
    tl.store(out_ptr + out_R[None, :] + slot_K[:, None], topi_KR, mask=valid_R[None, :] & (slot_K[:, None] < K))


def block_scores_triton(iq_BTGI: torch.Tensor, ik_BTI: torch.Tensor, block_size: int,
                        tuning: Tuning | None = None) -> torch.Tensor:
    """float32 [B, T, G, N] block scores max_{visible j in n} iq[t,g].ik[j]; -inf where no key is visible.

    Materializes B*T*G*N floats: for timing the top-k stage and for short sequences only.
    """
    B, T, G, _ = iq_BTGI.shape
    out = torch.full((B, T, G, num_blocks(T, block_size)), float("-inf"), dtype=torch.float32,
                     device=iq_BTGI.device)
    if T == 0:
        return out
    return launch_fused(iq_BTGI, ik_BTI, out, block_size, 1, False, SCORES, tuning)


def topk_blocks_triton(block_scores_BTGN: torch.Tensor, block_size: int, topk: int, force_sink: bool = False,
                       tuning: Tuning | None = None) -> torch.Tensor:
    """The selection stage alone: int32 [B, T, G, topk] from float32 block scores [B, T, G, N].

    Same rules as select_blocks (local block forced, block 0 too if `force_sink`, only blocks
    n <= t // block_size considered, -1 padding); blocks past the causal horizon are never read.
    """
    B, T, G, N = block_scores_BTGN.shape
    check_block_size(block_size, triton="select_blocks")
    if N != num_blocks(T, block_size):
        raise ValueError(f"block scores have {N} blocks; T={T} with block_size={block_size} needs "
                         f"{num_blocks(T, block_size)}")
    bs = block_scores_BTGN.float()
    if bs.stride(-1) != 1:
        bs = bs.contiguous()
    out = torch.empty((B, T, G, topk), dtype=torch.int32, device=bs.device)
    if T == 0:
        return out
    cfg = tuning or default_tuning(bs.device)
    GP = triton.next_power_of_2(G)
    BM = max(1, cfg.topk_rows // GP)
    _topk_kernel[(triton.cdiv(T, BM), B)](
        bs, out, T, N, bs.stride(0), bs.stride(1), bs.stride(2), *out.stride()[:3],
        G=G, GP=GP, BLOCK=block_size, K=topk, KP=triton.next_power_of_2(topk), BM=BM, SINK=bool(force_sink),
        num_warps=1, num_stages=cfg.topk_stages,
    )
    return out


def score_only_triton(iq_BTGI: torch.Tensor, ik_BTI: torch.Tensor, block_size: int,
                      tuning: Tuning | None = None, precision: str = "input") -> torch.Tensor:
    """The scoring and block-max work of select_blocks without the top-k: for timing breakdowns only.

    Returns float32 [B, T * GP] (GP = G rounded up to a power of two) of each row's best block score.
    """
    B, T, G, _ = iq_BTGI.shape
    out = torch.empty((B, T * triton.next_power_of_2(G)), dtype=torch.float32, device=iq_BTGI.device)
    return launch_fused(iq_BTGI, ik_BTI, out, block_size, 1, False, BARE, tuning, precision=precision)
