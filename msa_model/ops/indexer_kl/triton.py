"""Fused Triton kernels of the indexer KL loss, sparse (top-k blocks) and dense (warmup) modes.

Legend: B = batch, T = queries, TK = keys (query t sits at position QOFF + t; TK = QOFF + T),
G = groups (= Hkv), H = heads per group, D = head dim, Di = index head dim, K = top-k slots,
N = key blocks, E = B*T*G*K (query, group, slot) entries, M = queries in a tile, R = M*HS teacher rows (HS heads of each query), J = keys in a tile.

Per (query t, group g) with support S, teacher p[j] = mean_h exp(q_h.k_j*scale - lse_h) (left
unnormalised, its sum is s_sum), student z[j] = (iq.ik_j)*index_scale. The loss row

    KL = sum_j (p/s_sum)(log(p/s_sum) - z + lse_z)
       = a/s_sum - log s_sum - bz/s_sum + lse_z,  a = sum p log p, bz = sum p z,

is a function of five running sums over the support, so one pass over the keys gives it, with
lse_z kept online. Its gradient in z is dz = exp(z - lse_z) - p/s_sum (times grad*index_scale/count).

- dense: the forward takes two query-outer passes over the causal keys. The first finds lse_z
  (the student alone, 1/H of the work); the second, knowing lse_z, needs no online softmax and
  so runs on key-major tiles (keys are the products' long side, as in the backward), summing
  the loss terms and d iq = sum_j dz_j ik_j per query. H200, 32K, 2026-11-29: 47 ms against
  76 ms for one online pass on row-major tiles. The backward is key-outer for d ik. Memory O(T).
- sparse: every selection differs per query, so query-outer would re-read a key block (k and ik,
  J*(D+Di) values) for each (t, g, slot) while key-outer reads q's G*D values: key-outer it is, on
  an inverse index (for each (b, g, n): the entries that selected block n). The forward writes the
  five sums per entry, a combine reduces them over the K slots, and (when gradients are needed and
  they fit in TUNING.teacher_bytes) each entry's teacher row. The backward reads those rows and
  recomputes only the student (else both), keeps d ik in registers and adds d iq with atomics
  (fp32, order not fixed).
d ik is written per group and summed over groups afterwards (ik is shared by all groups).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


import torch
import triton
import triton.language as tl

from ..sparse_attention.triton import InverseIndex, build_inverse_index, clean_block_idx, schedule

LOG2E = 1.4426950408889634
# Triton's interpreter (CPU tests) cannot take tensors as range() bounds and multiplies bf16
# as raw integers; the kernels work around both when it runs them
_INTERP = os.environ.get("TRITON_INTERPRET", "0") == "1"
INTERPRETING = tl.constexpr(_INTERP)


@triton.jit
def _dot(a, b, PREC: tl.constexpr):
    if INTERPRETING:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _teacher_student(q_ptr, lse_ptr, iq_ptr, b, g, t_M, t_R, row_M, row_R, k_JD, ik_JI, kpos_J,
                     sq_b, sq_t, sq_h, sl_b, sl_t, sl_h, si_b, si_t, si_h, scale_log2, index_scale,
                     H: tl.constexpr, HS: tl.constexpr, M: tl.constexpr, D: tl.constexpr,
                     DI: tl.constexpr, J: tl.constexpr, PREC: tl.constexpr):
    """Key-major tiles for queries t_M against keys kpos_J: teacher p [J, M] (unnormalised group
    mean), student z [J, M] (-inf off the support), the support mask [J, M] and the iq tile [M, Di].

    Scores are S^T = K Q^T over R = M*HS rows (HS heads of each query; t_R / row_R repeat t_M /
    row_M HS times, row r is query r // HS, because Triton cannot gather a register tensor). The
    mean over a query's heads is a product with a constant [R, M] averaging matrix, so the [J, R]
    probabilities feed a matrix product from registers instead of a reduction across threads
    (H200, 2026-11-29: sparse KL forward 60 -> 39 ms at 128K). kpos_J is a key's position minus
    QOFF (key j is visible to query t iff j - QOFF <= t), huge where a key column does not exist.
    """
    offs_d = tl.arange(0, D)
    offs_i = tl.arange(0, DI)
    r_R = tl.arange(0, M * HS)
    t_R64 = t_R.to(tl.int64)
    # probabilities <= 1 go to the averaging product in fp16 (fp32 when the inputs are fp32)
    P_DT = tl.float32 if q_ptr.dtype.element_ty == tl.float32 else tl.float16
    avg_RM = tl.where(r_R[:, None] // HS == tl.arange(0, M)[None, :], 1.0 / H, 0.0).to(P_DT)
    valid_JR = (kpos_J[:, None] <= t_R[None, :]) & row_R[None, :]
    p_JM = tl.zeros((J, M), dtype=tl.float32)
    for hs in tl.static_range(H // HS):
        head_R = g * H + hs * HS + r_R % HS
        q_RD = tl.load(q_ptr + b * sq_b + t_R64[:, None] * sq_t + head_R[:, None] * sq_h + offs_d[None, :],
                       mask=row_R[:, None], other=0.0)
        lse_R = tl.load(lse_ptr + b * sl_b + t_R64 * sl_t + head_R * sl_h, mask=row_R, other=0.0)
        # an empty support has lse = -inf; its column is all masked, any finite stand-in will do
        lse_R = tl.where(lse_R == float("-inf"), 0.0, lse_R)
        s_JR = _dot(k_JD, tl.trans(q_RD), PREC)
        e_JR = tl.where(valid_JR, tl.exp2(s_JR * scale_log2 - lse_R[None, :] * 1.4426950408889634), 0.0)
        p_JM += _dot(e_JR.to(P_DT), avg_RM, PREC)
    iq_MI = tl.load(iq_ptr + b * si_b + t_M.to(tl.int64)[:, None] * si_t + g * si_h + offs_i[None, :],
                    mask=row_M[:, None], other=0.0)
    valid_JM = (kpos_J[:, None] <= t_M[None, :]) & row_M[None, :]
    z_JM = tl.where(valid_JM, _dot(ik_JI, tl.trans(iq_MI), PREC) * index_scale, float("-inf"))
    return p_JM, z_JM, valid_JM, iq_MI


@triton.jit
def _student_lse_step(j0, m_M, l_M, iq_MI, ik_ptr, b, TK, QOFF, t_M, row_M, sik_b, sik_t, index_scale,
                      J: tl.constexpr, DI: tl.constexpr, PREC: tl.constexpr):
    kpos_J = j0 + tl.arange(0, J)
    ikT_IJ = tl.load(ik_ptr + b * sik_b + kpos_J.to(tl.int64)[None, :] * sik_t + tl.arange(0, DI)[:, None],
                     mask=(kpos_J < TK)[None, :], other=0.0)
    z_MJ = _dot(iq_MI, ikT_IJ, PREC) * index_scale
    z_MJ = tl.where(row_M[:, None] & (kpos_J[None, :] - QOFF <= t_M[:, None]), z_MJ, float("-inf"))
    m_new = tl.maximum(m_M, tl.max(z_MJ, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    l_M = l_M * tl.exp(m_M - m_safe) + tl.sum(tl.exp(z_MJ - m_safe[:, None]), axis=1)
    return m_new, l_M


@triton.jit
def _student_lse_kernel(iq_ptr, ik_ptr, lsez_ptr, T, TK, QOFF, si_b, si_t, si_h, sik_b, sik_t, index_scale,
                        G: tl.constexpr, M: tl.constexpr, J: tl.constexpr, DI: tl.constexpr, PREC: tl.constexpr):
    """Dense mode, first pass: the student's normaliser lse_z [B, T, G] over all causal keys
    (query-outer, online; 1/H of the teacher's work)."""
    pid_m = tl.program_id(0)
    pid_bg = tl.program_id(1)
    b = pid_bg // G
    g = pid_bg % G
    t_M = pid_m * M + tl.arange(0, M)
    row_M = t_M < T
    iq_MI = tl.load(iq_ptr + b * si_b + t_M.to(tl.int64)[:, None] * si_t + g * si_h + tl.arange(0, DI)[None, :],
                    mask=row_M[:, None], other=0.0)
    m_M = tl.full((M,), float("-inf"), tl.float32)
    l_M = tl.zeros((M,), tl.float32)
    hi = QOFF + tl.minimum((pid_m + 1) * M, T)
    if INTERPRETING:
        j0 = 0
        while j0 < hi:
            m_M, l_M = _student_lse_step(j0, m_M, l_M, iq_MI, ik_ptr, b, TK, QOFF, t_M, row_M, sik_b, sik_t,
                                         index_scale, J, DI, PREC)
            j0 += J
    else:
        for j0 in range(0, hi, J):
            m_M, l_M = _student_lse_step(j0, m_M, l_M, iq_MI, ik_ptr, b, TK, QOFF, t_M, row_M, sik_b, sik_t,
                                         index_scale, J, DI, PREC)
    m_safe = tl.where(m_M == float("-inf"), 0.0, m_M)
    lse_z = tl.where(l_M > 0, m_safe + tl.log(tl.maximum(l_M, 1.1754943508222875e-38)), float("-inf"))
    tl.store(lsez_ptr + (b * T + t_M.to(tl.int64)) * G + g, lse_z, mask=row_M)


@triton.jit
def _dense_keys_step(j0, s_M, a_M, bz_M, accq_IM, accp_IM, lsez_M, q_ptr, k_ptr, lse_ptr, iq_ptr, ik_ptr, b, g, TK,
                     QOFF, t_M, t_R, row_M, row_R, sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sl_b, sl_t, sl_h,
                     si_b, si_t, si_h, sik_b, sik_t, scale_log2, index_scale, H: tl.constexpr, HS: tl.constexpr,
                     M: tl.constexpr, J: tl.constexpr, D: tl.constexpr, DI: tl.constexpr, PREC: tl.constexpr):
    """One key tile of the dense forward's second pass (key-major tiles, lse_z known)."""
    offs_j = tl.arange(0, J)
    kin_J = j0 + offs_j < TK
    kpos_J = tl.where(kin_J, j0 + offs_j - QOFF, 2147483647)
    kpos64 = (j0 + offs_j).to(tl.int64)
    k_JD = tl.load(k_ptr + b * sk_b + kpos64[:, None] * sk_t + g * sk_h + tl.arange(0, D)[None, :],
                   mask=kin_J[:, None], other=0.0)
    ik_JI = tl.load(ik_ptr + b * sik_b + kpos64[:, None] * sik_t + tl.arange(0, DI)[None, :],
                    mask=kin_J[:, None], other=0.0)
    p_JM, z_JM, valid_JM, iq_MI = _teacher_student(
        q_ptr, lse_ptr, iq_ptr, b, g, t_M, t_R, row_M, row_R, k_JD, ik_JI, kpos_J,
        sq_b, sq_t, sq_h, sl_b, sl_t, sl_h, si_b, si_t, si_h, scale_log2, index_scale,
        H, HS, M, D, DI, J, PREC)
    dt = iq_MI.dtype
    qz_JM = tl.where(valid_JM, tl.exp(z_JM - lsez_M[None, :]), 0.0)
    s_M += tl.sum(p_JM, axis=0)
    a_M += tl.sum(p_JM * tl.log(tl.maximum(p_JM, 1.1754943508222875e-38)), axis=0)
    bz_M += tl.sum(tl.where(valid_JM, p_JM * z_JM, 0.0), axis=0)
    ikT_IJ = tl.trans(ik_JI)
    accq_IM += _dot(ikT_IJ, qz_JM.to(dt), PREC)
    accp_IM += _dot(ikT_IJ, p_JM.to(dt), PREC)
    return s_M, a_M, bz_M, accq_IM, accp_IM


@triton.jit
def _dense_keys_kernel(q_ptr, k_ptr, lse_ptr, iq_ptr, ik_ptr, kl_ptr, lsez_ptr, invs_ptr, diq_ptr, T, TK, QOFF,
                       sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sl_b, sl_t, sl_h, si_b, si_t, si_h, sik_b, sik_t,
                       scale_log2, index_scale, G: tl.constexpr, H: tl.constexpr, HS: tl.constexpr,
                       M: tl.constexpr, J: tl.constexpr, D: tl.constexpr, DI: tl.constexpr,
                       PREC: tl.constexpr):
    """Dense mode, second pass: a tile of M queries against every causal key tile, on key-major
    tiles (keys are the products' long side) with lse_z from the first pass, so no online
    softmax runs along keys. Writes kl, 1/s_sum [B, T, G] and the unscaled d iq [B, T, G, Di]
    (fp32): d iq = sum_j softmax(z)_j ik_j - (sum_j p_j ik_j) / s_sum, both sums kept apart so
    the teacher's normaliser applies exactly at the end."""
    pid_m = tl.program_id(0)
    pid_bg = tl.program_id(1)
    b = pid_bg // G
    g = pid_bg % G
    t_M = pid_m * M + tl.arange(0, M)
    t_R = pid_m * M + tl.arange(0, M * HS) // HS
    row_M = t_M < T
    row_R = t_R < T
    o_M = (b * T + t_M.to(tl.int64)) * G + g
    lse_z = tl.load(lsez_ptr + o_M, mask=row_M, other=0.0)
    lsez_M = tl.where(lse_z == float("-inf"), 0.0, lse_z)
    s_M = tl.zeros((M,), tl.float32)
    a_M = tl.zeros((M,), tl.float32)
    bz_M = tl.zeros((M,), tl.float32)
    accq_IM = tl.zeros((DI, M), tl.float32)
    accp_IM = tl.zeros((DI, M), tl.float32)
    hi = QOFF + tl.minimum((pid_m + 1) * M, T)
    if INTERPRETING:
        j0 = 0
        while j0 < hi:
            s_M, a_M, bz_M, accq_IM, accp_IM = _dense_keys_step(
                j0, s_M, a_M, bz_M, accq_IM, accp_IM, lsez_M, q_ptr, k_ptr, lse_ptr, iq_ptr, ik_ptr, b, g, TK, QOFF,
                t_M, t_R, row_M, row_R, sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sl_b, sl_t, sl_h, si_b, si_t, si_h,
                sik_b, sik_t, scale_log2, index_scale, H, HS, M, J, D, DI, PREC)
            j0 += J
    else:
        for j0 in range(0, hi, J):
            s_M, a_M, bz_M, accq_IM, accp_IM = _dense_keys_step(
                j0, s_M, a_M, bz_M, accq_IM, accp_IM, lsez_M, q_ptr, k_ptr, lse_ptr, iq_ptr, ik_ptr, b, g, TK, QOFF,
                t_M, t_R, row_M, row_R, sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sl_b, sl_t, sl_h, si_b, si_t, si_h,
                sik_b, sik_t, scale_log2, index_scale, H, HS, M, J, D, DI, PREC)
    s_safe = tl.maximum(s_M, 1.1754943508222875e-38)
    inv_s = 1.0 / s_safe
    kl = tl.where(s_M > 0, (a_M - bz_M) * inv_s - tl.log(s_safe) + lse_z, 0.0)
    tl.store(kl_ptr + o_M, kl, mask=row_M)
    tl.store(invs_ptr + o_M, inv_s, mask=row_M)
    diq_IM = accq_IM - accp_IM * inv_s[None, :]
    tl.store(diq_ptr + o_M[None, :] * DI + tl.arange(0, DI)[:, None], diq_IM, mask=row_M[None, :])


@triton.jit
def _sparse_fwd_step(start, hi, q_ptr, lse_ptr, iq_ptr, ent_ptr, part_ptr, pbar_ptr, b, g, T, E, k_JD, ik_JI,
                     kpos_J, sq_b, sq_t, sq_h, sl_b, sl_t, sl_h, si_b, si_t, si_h, scale_log2, index_scale,
                     G: tl.constexpr, K: tl.constexpr, H: tl.constexpr, HS: tl.constexpr, M: tl.constexpr,
                     J: tl.constexpr, D: tl.constexpr, DI: tl.constexpr, PREC: tl.constexpr, STORE: tl.constexpr):
    """M entries of one key block's list: writes their five sums (and, with STORE, the teacher row
    p [J] of each entry to pbar [E, J], so the backward need not recompute it)."""
    offs_j = tl.arange(0, J)
    idx_M = start + tl.arange(0, M)
    row_M = idx_M < hi
    e_M = tl.load(ent_ptr + idx_M, mask=row_M, other=0)
    t_M = e_M // (G * K) - b * T
    idx_R = start + tl.arange(0, M * HS) // HS
    row_R = idx_R < hi
    t_R = tl.load(ent_ptr + idx_R, mask=row_R, other=0) // (G * K) - b * T
    p_JM, z_JM, valid_JM, iq_MI = _teacher_student(
        q_ptr, lse_ptr, iq_ptr, b, g, t_M, t_R, row_M, row_R, k_JD, ik_JI, kpos_J,
        sq_b, sq_t, sq_h, sl_b, sl_t, sl_h, si_b, si_t, si_h, scale_log2, index_scale,
        H, HS, M, D, DI, J, PREC)
    mz = tl.max(z_JM, axis=0)
    mz_safe = tl.where(mz == float("-inf"), 0.0, mz)
    lz = tl.sum(tl.exp(z_JM - mz_safe[None, :]), axis=0)
    s = tl.sum(p_JM, axis=0)
    a = tl.sum(p_JM * tl.log(tl.maximum(p_JM, 1.1754943508222875e-38)), axis=0)
    bz = tl.sum(tl.where(valid_JM, p_JM * z_JM, 0.0), axis=0)
    e64 = e_M.to(tl.int64)
    tl.store(part_ptr + e64, mz, mask=row_M)
    tl.store(part_ptr + E + e64, lz, mask=row_M)
    tl.store(part_ptr + 2 * E + e64, s, mask=row_M)
    tl.store(part_ptr + 3 * E + e64, a, mask=row_M)
    tl.store(part_ptr + 4 * E + e64, bz, mask=row_M)
    if STORE:
        p_st = p_JM
        if pbar_ptr.dtype.element_ty == tl.float16:
            p_st = tl.minimum(p_st, 65504.0)
        tl.store(pbar_ptr + e64[None, :] * J + offs_j[:, None], p_st.to(pbar_ptr.dtype.element_ty),
                 mask=row_M[None, :])


@triton.jit
def _sparse_fwd_kernel(q_ptr, k_ptr, lse_ptr, iq_ptr, ik_ptr, ent_ptr, tb_ptr, ts_ptr, tc_ptr, part_ptr, pbar_ptr,
                       T, TK, QOFF, E, N,
                       sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sl_b, sl_t, sl_h, si_b, si_t, si_h, sik_b, sik_t,
                       scale_log2, index_scale, BLOCK: tl.constexpr, G: tl.constexpr, K: tl.constexpr,
                       H: tl.constexpr, HS: tl.constexpr, M: tl.constexpr, J: tl.constexpr, D: tl.constexpr,
                       DI: tl.constexpr, PREC: tl.constexpr, STORE: tl.constexpr):
    """Key-outer: program p takes a run of entries ent[ts[p] : ts[p] + tc[p]] that all selected
    block n of bucket tb[p] = (b*G + g)*N + n (-1: spare program) and writes their five sums
    (max z, sum exp(z - max z), s_sum, a, bz) to part [5, E] at each entry's index."""
    pid = tl.program_id(0)
    bucket = tl.load(tb_ptr + pid)
    if bucket >= 0:
        pid_bg = bucket // N
        n = bucket % N
        b = pid_bg // G
        g = pid_bg % G
        lo = tl.load(ts_ptr + pid)
        hi = lo + tl.load(tc_ptr + pid)
        offs_j = tl.arange(0, J)
        offs_d = tl.arange(0, D)
        offs_i = tl.arange(0, DI)
        kin_J = (offs_j < BLOCK) & (n * BLOCK + offs_j < TK)
        kpos_J = tl.where(kin_J, n * BLOCK + offs_j - QOFF, 2147483647)
        kpos64 = (n * BLOCK + offs_j).to(tl.int64)
        k_JD = tl.load(k_ptr + b * sk_b + kpos64[:, None] * sk_t + g * sk_h + offs_d[None, :],
                       mask=kin_J[:, None], other=0.0)
        ik_JI = tl.load(ik_ptr + b * sik_b + kpos64[:, None] * sik_t + offs_i[None, :],
                        mask=kin_J[:, None], other=0.0)
        if INTERPRETING:
            start = lo
            while start < hi:
                _sparse_fwd_step(start, hi, q_ptr, lse_ptr, iq_ptr, ent_ptr, part_ptr, pbar_ptr, b, g, T, E,
                                 k_JD, ik_JI, kpos_J, sq_b, sq_t, sq_h, sl_b, sl_t, sl_h, si_b, si_t, si_h,
                                 scale_log2, index_scale, G, K, H, HS, M, J, D, DI, PREC, STORE)
                start += M
        else:
            for start in range(lo, hi, M):
                _sparse_fwd_step(start, hi, q_ptr, lse_ptr, iq_ptr, ent_ptr, part_ptr, pbar_ptr, b, g, T, E,
                                 k_JD, ik_JI, kpos_J, sq_b, sq_t, sq_h, sl_b, sl_t, sl_h, si_b, si_t, si_h,
                                 scale_log2, index_scale, G, K, H, HS, M, J, D, DI, PREC, STORE)


@triton.jit
def _bwd_step(start, hi, dik_JI, q_ptr, lse_ptr, iq_ptr, lsez_ptr, invs_ptr, ent_ptr, diq_ptr, b, g, T,
              k_JD, ik_JI, kpos_J, sq_b, sq_t, sq_h, sl_b, sl_t, sl_h, si_b, si_t, si_h, scale_log2,
              index_scale, G: tl.constexpr, K: tl.constexpr, H: tl.constexpr, HS: tl.constexpr,
              M: tl.constexpr, J: tl.constexpr, D: tl.constexpr, DI: tl.constexpr, SPARSE: tl.constexpr,
              PREC: tl.constexpr):
    """M queries (list entries when sparse, consecutive tokens when dense) against one key block."""
    dt = iq_ptr.dtype.element_ty
    offs_i = tl.arange(0, DI)
    idx_M = start + tl.arange(0, M)
    row_M = idx_M < hi
    idx_R = start + tl.arange(0, M * HS) // HS
    row_R = idx_R < hi
    if SPARSE:
        t_M = tl.load(ent_ptr + idx_M, mask=row_M, other=0) // (G * K) - b * T
        t_R = tl.load(ent_ptr + idx_R, mask=row_R, other=0) // (G * K) - b * T
    else:
        t_M = idx_M
        t_R = idx_R
    p_JM, z_JM, valid_JM, iq_MI = _teacher_student(
        q_ptr, lse_ptr, iq_ptr, b, g, t_M, t_R, row_M, row_R, k_JD, ik_JI, kpos_J,
        sq_b, sq_t, sq_h, sl_b, sl_t, sl_h, si_b, si_t, si_h, scale_log2, index_scale,
        H, HS, M, D, DI, J, PREC)
    o_M = (b * T + t_M.to(tl.int64)) * G + g
    lse_z = tl.load(lsez_ptr + o_M, mask=row_M, other=0.0)
    lse_z = tl.where(lse_z == float("-inf"), 0.0, lse_z)
    inv_s = tl.load(invs_ptr + o_M, mask=row_M, other=0.0)
    dz_JM = tl.where(valid_JM, tl.exp(z_JM - lse_z[None, :]) - p_JM * inv_s[None, :], 0.0).to(dt)
    dik_JI += _dot(dz_JM, iq_MI, PREC)
    if SPARSE:
        dq_IM = _dot(tl.trans(ik_JI), dz_JM, PREC)
        tl.atomic_add(diq_ptr + o_M[None, :] * DI + offs_i[:, None], dq_IM, mask=row_M[None, :], sem="relaxed")
    return dik_JI


@triton.jit
def _bwd_kernel(q_ptr, k_ptr, lse_ptr, iq_ptr, ik_ptr, lsez_ptr, invs_ptr, ent_ptr, tb_ptr, ts_ptr, tc_ptr, dik_ptr,
                diq_ptr, B, T, TK, QOFF, N,
                sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sl_b, sl_t, sl_h, si_b, si_t, si_h, sik_b,
                sik_t, scale_log2, index_scale, BLOCK: tl.constexpr, G: tl.constexpr, K: tl.constexpr,
                H: tl.constexpr, HS: tl.constexpr, M: tl.constexpr, J: tl.constexpr, D: tl.constexpr,
                DI: tl.constexpr, SPARSE: tl.constexpr, PREC: tl.constexpr):
    """Key-outer backward over the keys of block n (BLOCK keys).

    dense: program (n, b*G+g) streams every query after the block and stores group g's unscaled
    d ik to dik [G, B, TK, Di] (deterministic). sparse: program p takes a run of a bucket's
    entries (as the forward) and adds its d ik into dik [B, TK, Di] and d iq into diq [B, T, G, Di]
    with fp32 atomics (a popular block is split over several programs).
    """
    if SPARSE:
        pid = tl.program_id(0)
        bucket = tl.load(tb_ptr + pid)
        live = bucket >= 0
        bucket = tl.maximum(bucket, 0)
        pid_bg = bucket // N
        n = bucket % N
        lo = tl.load(ts_ptr + pid)
        hi = tl.where(live, lo + tl.load(tc_ptr + pid), lo)
    else:
        n = tl.program_id(0)
        pid_bg = tl.program_id(1)
        live = True
        # queries before the block cannot see it
        lo = tl.maximum(n * BLOCK - QOFF, 0)
        hi = T
    b = pid_bg // G
    g = pid_bg % G
    offs_j = tl.arange(0, J)
    offs_d = tl.arange(0, D)
    offs_i = tl.arange(0, DI)
    kin_J = (offs_j < BLOCK) & (n * BLOCK + offs_j < TK)
    kpos_J = tl.where(kin_J, n * BLOCK + offs_j - QOFF, 2147483647)
    kpos64 = (n * BLOCK + offs_j).to(tl.int64)
    k_JD = tl.load(k_ptr + b * sk_b + kpos64[:, None] * sk_t + g * sk_h + offs_d[None, :],
                   mask=kin_J[:, None], other=0.0)
    ik_JI = tl.load(ik_ptr + b * sik_b + kpos64[:, None] * sik_t + offs_i[None, :],
                    mask=kin_J[:, None], other=0.0)
    dik_JI = tl.zeros((J, DI), tl.float32)
    if INTERPRETING:
        start = lo
        while start < hi:
            dik_JI = _bwd_step(start, hi, dik_JI, q_ptr, lse_ptr, iq_ptr, lsez_ptr, invs_ptr, ent_ptr, diq_ptr, b,
                               g, T, k_JD, ik_JI, kpos_J, sq_b, sq_t, sq_h, sl_b, sl_t, sl_h, si_b, si_t,
                               si_h, scale_log2, index_scale, G, K, H, HS, M, J, D, DI, SPARSE, PREC)
            start += M
    else:
        for start in range(lo, hi, M):
            dik_JI = _bwd_step(start, hi, dik_JI, q_ptr, lse_ptr, iq_ptr, lsez_ptr, invs_ptr, ent_ptr, diq_ptr, b,
                               g, T, k_JD, ik_JI, kpos_J, sq_b, sq_t, sq_h, sl_b, sl_t, sl_h, si_b, si_t,
                               si_h, scale_log2, index_scale, G, K, H, HS, M, J, D, DI, SPARSE, PREC)
    if SPARSE:
        o_J = b * TK + kpos64
        tl.atomic_add(dik_ptr + o_J[:, None] * DI + offs_i[None, :], dik_JI, mask=kin_J[:, None] & live,
                      sem="relaxed")
    else:
        o_J = (g * B + b) * TK + kpos64
        tl.store(dik_ptr + o_J[:, None] * DI + offs_i[None, :], dik_JI, mask=kin_J[:, None])


@triton.jit
def _stored_bwd_step(start, hi, dik_JI, iq_ptr, pbar_ptr, lsez_ptr, invs_ptr, ent_ptr, diq_ptr, b, g, T, ikT_IJ, ik_JI,
                     kpos_J, si_b, si_t, si_h, index_scale, G: tl.constexpr, K: tl.constexpr, M: tl.constexpr,
                     J: tl.constexpr, DI: tl.constexpr, PREC: tl.constexpr):
    """M entries of one key block's list, teacher read from pbar [E, J]: only the student is recomputed."""
    dt = iq_ptr.dtype.element_ty
    offs_i = tl.arange(0, DI)
    idx_M = start + tl.arange(0, M)
    row_M = idx_M < hi
    e_M = tl.load(ent_ptr + idx_M, mask=row_M, other=0)
    t_M = e_M // (G * K) - b * T
    t_M64 = t_M.to(tl.int64)
    valid_MJ = row_M[:, None] & (kpos_J[None, :] <= t_M[:, None])
    iq_MI = tl.load(iq_ptr + b * si_b + t_M64[:, None] * si_t + g * si_h + offs_i[None, :],
                    mask=row_M[:, None], other=0.0)
    p_MJ = tl.load(pbar_ptr + e_M.to(tl.int64)[:, None] * J + tl.arange(0, J)[None, :], mask=valid_MJ,
                   other=0.0).to(tl.float32)
    z_MJ = _dot(iq_MI, ikT_IJ, PREC) * index_scale
    o_M = (b * T + t_M64) * G + g
    lse_z = tl.load(lsez_ptr + o_M, mask=row_M, other=0.0)
    lse_z = tl.where(lse_z == float("-inf"), 0.0, lse_z)
    inv_s = tl.load(invs_ptr + o_M, mask=row_M, other=0.0)
    dz_MJ = tl.where(valid_MJ, tl.exp(z_MJ - lse_z[:, None]) - p_MJ * inv_s[:, None], 0.0).to(dt)
    dik_JI += _dot(tl.trans(dz_MJ), iq_MI, PREC)
    dq_MI = _dot(dz_MJ, ik_JI, PREC)
    tl.atomic_add(diq_ptr + o_M[:, None] * DI + offs_i[None, :], dq_MI, mask=row_M[:, None], sem="relaxed")
    return dik_JI


@triton.jit
def _stored_bwd_kernel(iq_ptr, ik_ptr, pbar_ptr, lsez_ptr, invs_ptr, ent_ptr, tb_ptr, ts_ptr, tc_ptr, dik_ptr, diq_ptr,
                       T, TK, QOFF, N, si_b, si_t, si_h, sik_b, sik_t, index_scale, BLOCK: tl.constexpr,
                       G: tl.constexpr,
                       K: tl.constexpr, M: tl.constexpr, J: tl.constexpr, DI: tl.constexpr, PREC: tl.constexpr):
    """Sparse backward with the teacher stored by the forward: program p takes a run of a bucket's
    entries (as `_bwd_kernel`); d ik [B, TK, Di] and d iq [B, T, G, Di] by fp32 atomics."""
    pid = tl.program_id(0)
    bucket = tl.load(tb_ptr + pid)
    if bucket >= 0:
        pid_bg = bucket // N
        n = bucket % N
        b = pid_bg // G
        g = pid_bg % G
        lo = tl.load(ts_ptr + pid)
        hi = lo + tl.load(tc_ptr + pid)
        offs_j = tl.arange(0, J)
        offs_i = tl.arange(0, DI)
        kin_J = (offs_j < BLOCK) & (n * BLOCK + offs_j < TK)
        kpos_J = tl.where(kin_J, n * BLOCK + offs_j - QOFF, 2147483647)
        kpos64 = (n * BLOCK + offs_j).to(tl.int64)
        ik_JI = tl.load(ik_ptr + b * sik_b + kpos64[:, None] * sik_t + offs_i[None, :],
                        mask=kin_J[:, None], other=0.0)
        ikT_IJ = tl.trans(ik_JI)
        dik_JI = tl.zeros((J, DI), tl.float32)
        if INTERPRETING:
            start = lo
            while start < hi:
                dik_JI = _stored_bwd_step(start, hi, dik_JI, iq_ptr, pbar_ptr, lsez_ptr, invs_ptr, ent_ptr, diq_ptr,
                                          b, g, T, ikT_IJ, ik_JI, kpos_J, si_b, si_t, si_h, index_scale, G, K, M,
                                          J, DI, PREC)
                start += M
        else:
            for start in range(lo, hi, M):
                dik_JI = _stored_bwd_step(start, hi, dik_JI, iq_ptr, pbar_ptr, lsez_ptr, invs_ptr, ent_ptr, diq_ptr,
                                          b, g, T, ikT_IJ, ik_JI, kpos_J, si_b, si_t, si_h, index_scale, G, K, M,
                                          J, DI, PREC)
        o_J = b * TK + kpos64
        tl.atomic_add(dik_ptr + o_J[:, None] * DI + offs_i[None, :], dik_JI, mask=kin_J[:, None], sem="relaxed")


def _heads_per_dot(H: int, M: int, rows: int) -> int:
    """Largest power of two dividing H with M * HS <= rows: the teacher's dot has M*HS rows."""
    hs = 1
    while H % (2 * hs) == 0 and M * 2 * hs <= rows:
        hs *= 2
    return hs


def _check_dims(D: int, Di: int) -> None:
    for name, d in (("head dim", D), ("index head dim", Di)):
        if d < 16 or d & (d - 1):
            raise ValueError(f"the Triton indexer KL needs a power-of-two {name} >= 16, got {d}")


def _strides(q, k, lse, iq, ik):
    return (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            lse.stride(0), lse.stride(1), lse.stride(2), iq.stride(0), iq.stride(1), iq.stride(2),
            ik.stride(0), ik.stride(1))


def _precision(q, iq) -> str:
    # fp32 inputs get true fp32 dots (tf32 would cost ~3e-4 relative error); bf16/fp16 ignore this
    return "ieee" if torch.float32 in (q.dtype, iq.dtype) else "tf32"


def inverse_index(block_idx: torch.Tensor, block_size: int, q_offset: int = 0) -> InverseIndex:
    """For each bucket (b, g, n): the entries e = ((b*T + t)*G + g)*K + slot whose slot selects
    block n, t ascending (`InverseIndex` of sparse_attention's Triton path).

    block_idx int [B, T, G, K] (-1 = empty; repeats in a row and blocks after the query's own
    are dropped, as the reference's support does); query t sits at position q_offset + t, so
    the blocks are those of q_offset + T keys.
    """
    B, T, G, K = block_idx.shape
    N = triton.cdiv(q_offset + T, block_size)
    if B * T * G * K >= 2**31 or B * G * N >= 2**31:
        raise ValueError("block_idx too large for int32 entry ids")
    return build_inverse_index(clean_block_idx(block_idx, block_size, q_offset), N)


def _programs(index: InverseIndex, per_program: int):
    """(bucket, start, count) per program of the KL's index, which is one query chunk (row 0 of
    `schedule`)."""
    return tuple(x[0] for x in schedule(index, per_program))


@dataclass
class Tuning:
    """Tile sizes: M queries per tile, teacher dots of up to `rows` rows (M x heads), J keys per
    dense tile, `per_program` entries per sparse program (a popular block is split into such runs),
    pipeline stages of the sparse forward (`fwd_stages`), the dense kernels (`dense_stages`) and
    the sparse backward that recomputes the teacher (`stages`). The dense forward's second pass
    has its own `dense_M`, `dense_rows`, `dense_fwd_j` and `dense_warps`; its first pass (the
    student's lse) takes `lse_M` queries against `lse_J` keys per step.

    Sparse mode keeps the forward's teacher rows (fp16, or fp32 for fp32 inputs; E x J values)
    for the backward when they fit in `teacher_bytes` (0: always recompute) and in
    `teacher_q_ratio` times the bytes of q (they live from this layer's forward to its backward,
    like its other activations: at most about what the layer keeps anyway; a caller that reruns
    the forward just before the backward lifts this second bound); the backward then
    recomputes only the student, with tiles of `stored_M` entries. Defaults chosen on an H200
    (bench/bench_msa_layer.py tune, 2026-11-29)."""
    M: int = 16
    rows: int = 128
    dense_rows: int = 128
    dense_M: int = 16
    dense_warps: int = 8
    dense_fwd_j: int = 128
    lse_M: int = 64
    lse_J: int = 64
    dense_bwd_j: int = 128
    fwd_per_program: int = 256
    bwd_per_program: int = 512
    warps: int = 8
    stages: int = 1
    fwd_stages: int = 2
    dense_stages: int = 2
    teacher_bytes: int = 4 << 30
    teacher_q_ratio: float = 1.0
    stored_M: int = 64
    stored_warps: int = 4
    stored_stages: int = 2


TUNING = Tuning()


def _dense_forward(q, k, lse, iq, ik, scale, index_scale, cfg, q_offset):
    B, T, Hq, D = q.shape
    G, Di = k.shape[2], iq.shape[3]
    H = Hq // G
    kl = torch.empty(B, T, G, dtype=torch.float32, device=q.device)
    lse_z = torch.empty_like(kl)
    inv_s = torch.empty_like(kl)
    diq = torch.empty(B, T, G, Di, dtype=torch.float32, device=q.device)
    strides = _strides(q, k, lse, iq, ik)
    _student_lse_kernel[(triton.cdiv(T, cfg.lse_M), B * G)](
        iq, ik, lse_z, T, k.shape[1], q_offset, *strides[9:], index_scale, G=G, M=cfg.lse_M, J=cfg.lse_J, DI=Di,
        PREC=_precision(q, iq), num_warps=4, num_stages=2)
    HS = _heads_per_dot(H, cfg.dense_M, cfg.dense_rows)
    _dense_keys_kernel[(triton.cdiv(T, cfg.dense_M), B * G)](
        q, k, lse, iq, ik, kl, lse_z, inv_s, diq, T, k.shape[1], q_offset, *strides, scale * LOG2E, index_scale,
        G=G, H=H, HS=HS, M=cfg.dense_M, J=cfg.dense_fwd_j, D=D, DI=Di, PREC=_precision(q, iq),
        num_warps=cfg.dense_warps, num_stages=cfg.dense_stages)
    return kl, lse_z, inv_s, diq


def _combine(part, B, T, G, K):
    """Reduce the per-slot sums [5, E] to kl, lse_z, 1/s_sum, each fp32 [B, T, G]."""
    mz, lz, s, a, bz = part.view(5, B, T, G, K).unbind(0)
    mx = mz.amax(-1)
    mx = torch.where(torch.isinf(mx), torch.zeros_like(mx), mx)
    lse_z = mx + torch.log((lz * torch.exp(mz - mx[..., None])).sum(-1))
    s_sum = s.sum(-1)
    s_safe = s_sum.clamp_min(torch.finfo(torch.float32).tiny)
    inv_s = 1.0 / s_safe
    kl = (a.sum(-1) - bz.sum(-1)) * inv_s - torch.log(s_safe) + lse_z
    kl = torch.where(s_sum > 0, kl, torch.zeros_like(kl))
    return kl, lse_z, inv_s


def _sparse_forward(q, k, lse, iq, ik, index, K, block_size, scale, index_scale, cfg, store, q_offset):
    """kl, lse_z, 1/s_sum (fp32 [B, T, G]) and, with `store`, the teacher rows pbar [E, J]."""
    B, T, Hq, D = q.shape
    G, Di = k.shape[2], iq.shape[3]
    H = Hq // G
    E = B * T * G * K
    J = triton.next_power_of_2(block_size)
    HS = _heads_per_dot(H, cfg.M, cfg.rows)
    # entries no program visits (empty slots) keep sums that contribute nothing
    part = torch.zeros(5, E, dtype=torch.float32, device=q.device)
    part[0].fill_(float("-inf"))
    # only the entries of the inverse index are written, and only they are read back
    pbar = torch.empty(E, J, dtype=_teacher_dtype(q), device=q.device) if store else None
    tb, ts, tc = _programs(index, cfg.fwd_per_program)
    _sparse_fwd_kernel[(tb.numel(),)](
        q, k, lse, iq, ik, index.entry, tb, ts, tc, part, part if pbar is None else pbar, T, k.shape[1], q_offset, E,
        index.n_blocks,
        *_strides(q, k, lse, iq, ik), scale * LOG2E, index_scale, BLOCK=block_size, G=G, K=K, H=H, HS=HS, M=cfg.M,
        J=J, D=D, DI=Di, PREC=_precision(q, iq), STORE=store, num_warps=cfg.warps,
        num_stages=cfg.fwd_stages)
    return (*_combine(part, B, T, G, K), pbar)


def _teacher_dtype(q) -> torch.dtype:
    return torch.float32 if q.dtype == torch.float32 else torch.float16


def _store_teacher(q, G, K, block_size, cfg, needs_grad: bool, keep: bool | None) -> bool:
    """Whether the forward keeps the teacher rows for the backward. keep=None: when they fit both
    budgets; True: when they fit `teacher_bytes` (the caller recomputes the forward right before
    the backward, so they are short-lived); False: never."""
    B, T = q.shape[:2]
    nbytes = B * T * G * K * triton.next_power_of_2(block_size) * _teacher_dtype(q).itemsize
    fits = nbytes <= cfg.teacher_bytes and (keep or nbytes <= cfg.teacher_q_ratio * q.numel() * q.element_size())
    return needs_grad and keep is not False and fits


def _stored_backward(iq, ik, pbar, lse_z, inv_s, index, K, block_size, index_scale, cfg, q_offset):
    """Unscaled d ik fp32 [B, TK, Di] and d iq fp32 [B, T, G, Di] from the stored teacher rows."""
    B, T, G, Di = iq.shape
    TK = ik.shape[1]
    dik = torch.zeros(B, TK, Di, dtype=torch.float32, device=iq.device)
    diq = torch.zeros(B, T, G, Di, dtype=torch.float32, device=iq.device)
    tb, ts, tc = _programs(index, cfg.bwd_per_program)
    _stored_bwd_kernel[(tb.numel(),)](
        iq, ik, pbar, lse_z, inv_s, index.entry, tb, ts, tc, dik, diq, T, TK, q_offset, index.n_blocks,
        iq.stride(0), iq.stride(1), iq.stride(2), ik.stride(0), ik.stride(1), index_scale,
        BLOCK=block_size, G=G, K=K, M=cfg.stored_M, J=triton.next_power_of_2(block_size),
        DI=Di, PREC=_precision(iq, iq), num_warps=cfg.stored_warps, num_stages=cfg.stored_stages)
    return dik, diq


def _backward(q, k, lse, iq, ik, lse_z, inv_s, index, K, block_size, scale, index_scale, cfg, q_offset):
    """Unscaled d ik fp32 [B, TK, Di] and, in sparse mode (index given), d iq fp32 [B, T, G, Di]."""
    B, T, Hq, D = q.shape
    TK = k.shape[1]
    G, Di = k.shape[2], iq.shape[3]
    H = Hq // G
    HS = _heads_per_dot(H, cfg.M, cfg.rows)
    common = dict(G=G, K=K, H=H, HS=HS, M=cfg.M, D=D, DI=Di, PREC=_precision(q, iq), num_warps=cfg.warps,
                  num_stages=cfg.stages)
    if index is None:
        block = cfg.dense_bwd_j
        N = triton.cdiv(TK, block)
        dik = torch.empty(G, B, TK, Di, dtype=torch.float32, device=q.device)
        unused = lse_z
        _bwd_kernel[(N, B * G)](q, k, lse, iq, ik, lse_z, inv_s, unused, unused, unused, unused, dik, unused,
                                B, T, TK, q_offset, N, *_strides(q, k, lse, iq, ik), scale * LOG2E, index_scale,
                                BLOCK=block, J=triton.next_power_of_2(block), SPARSE=False,
                                **{**common, "num_stages": cfg.dense_stages})
        return dik.sum(0), None
    dik = torch.zeros(B, TK, Di, dtype=torch.float32, device=q.device)
    diq = torch.zeros(B, T, G, Di, dtype=torch.float32, device=q.device)
    tb, ts, tc = _programs(index, cfg.bwd_per_program)
    _bwd_kernel[(tb.numel(),)](q, k, lse, iq, ik, lse_z, inv_s, index.entry, tb, ts, tc, dik, diq, B, T, TK,
                               q_offset, index.n_blocks, *_strides(q, k, lse, iq, ik), scale * LOG2E, index_scale,
                               BLOCK=block_size, J=triton.next_power_of_2(block_size), SPARSE=True, **common)
    return dik, diq


class IndexerKLTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, iq, ik, block_idx, lse, block_size, scale, index_scale, q_offset, keep_teacher):
        B, T, Hq, D = q.shape
        G, Di = k.shape[2], iq.shape[3]
        _check_dims(D, Di)
        q, k, iq, ik = (x.contiguous() for x in (q, k, iq, ik))
        lse = lse.float().contiguous()
        cfg = TUNING
        index = None
        K = 1
        diq = pbar = None
        if block_idx is None:
            kl, lse_z, inv_s, diq = _dense_forward(q, k, lse, iq, ik, scale, index_scale, cfg, q_offset)
        else:
            K = block_idx.shape[-1]
            index = inverse_index(block_idx, block_size, q_offset)
            store = _store_teacher(q, G, K, block_size, cfg, any(ctx.needs_input_grad[2:4]), keep_teacher)
            kl, lse_z, inv_s, pbar = _sparse_forward(q, k, lse, iq, ik, index, K, block_size, scale, index_scale,
                                                     cfg, store, q_offset)
        # with the teacher rows kept, the backward needs neither q, k nor lse
        if pbar is not None:
            q = k = lse = None
        ctx.save_for_backward(q, k, iq, ik, lse, lse_z, inv_s, diq, pbar)
        ctx.index = index
        ctx.args = (K, block_size, scale, index_scale, cfg, q_offset)
        return (kl.sum(dtype=torch.float64) / (B * T * G)).float()

    @staticmethod
    def backward(ctx, grad):
        q, k, iq, ik, lse, lse_z, inv_s, diq, pbar = ctx.saved_tensors
        K, block_size, scale, index_scale, cfg, q_offset = ctx.args
        B, T, G = lse_z.shape
        if pbar is not None:
            dik, diq_sparse = _stored_backward(iq, ik, pbar, lse_z, inv_s, ctx.index, K, block_size, index_scale, cfg,
                                               q_offset)
        else:
            dik, diq_sparse = _backward(q, k, lse, iq, ik, lse_z, inv_s, ctx.index, K, block_size, scale,
                                        index_scale, cfg, q_offset)
        ctx.index = None
        diq = diq_sparse if diq is None else diq
        coef = grad.float() * (index_scale / (B * T * G))
        d_iq = (diq * coef).to(iq.dtype) if ctx.needs_input_grad[2] else None
        d_ik = (dik * coef).to(ik.dtype) if ctx.needs_input_grad[3] else None
        return None, None, d_iq, d_ik, None, None, None, None, None, None, None


def indexer_kl_loss_triton(q: torch.Tensor, k: torch.Tensor, iq: torch.Tensor, ik: torch.Tensor,
                           block_idx: torch.Tensor | None, lse: torch.Tensor, block_size: int, scale: float,
                           index_scale: float, q_offset: int = 0, keep_teacher: bool | None = None) -> torch.Tensor:
    """Fused indexer KL: fp32 scalar, differentiable in iq [B, T, G, Di] and ik [B, TK, Di] only.

    q [B, T, Hq, D] and k [B, TK, G, D] (same dtype), lse fp32 [B, T, Hq] are constants;
    block_idx int [B, T, G, K] (-1 = empty) or None for the dense warmup support. Query t sits
    at position q_offset + t and TK = q_offset + T (the keys of the causal prefix).
    `keep_teacher`: the sparse forward's teacher rows for the backward (see `Tuning`).
    """
    if k.shape[1] != q_offset + q.shape[1] or ik.shape[1] != k.shape[1]:
        raise ValueError(f"k and ik must cover q_offset + T = {q_offset + q.shape[1]} tokens, got "
                         f"{k.shape[1]} and {ik.shape[1]}")
    return IndexerKLTriton.apply(q.detach(), k.detach(), iq, ik, block_idx, lse.detach(), block_size,
                                 float(scale), float(index_scale), int(q_offset), keep_teacher)
