"""Triton kernels of the indexer KL loss (launchers and autograd in triton.py, the math there).

Legend: B = batch, T = queries, TK = keys (query t sits at position QOFF + t; TK = QOFF + T),
G = groups (= Hkv), H = heads per group, D = head dim, Di = index head dim, K = top-k slots,
N = key blocks, E = B*T*G*K (query, group, slot) entries, M = queries in a tile, R = M*HS teacher
rows (HS heads of each query), J = keys in a tile.

Packed documents (DOCS): in sparse mode a bucket's block n is an entry of the document block
table, keys BSTART[b, n] .. BEND[b, n] - 1 (ops/sparse_attention/inverse_index.py); its keys all belong to the
document of the queries that selected it, so no other mask is needed. In dense mode DOC [B, T]
holds each query's document start s and query t reads keys s .. QOFF + t: query-outer kernels
start at their first row's s, the key-outer backward stops at QEND [B, N], the first query whose
document starts after the block.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..sparse_attention.inverse_index import decode_bucket
from ..triton_utils import FP32_TINY, INTERPRET, LOG2E, dot, row_documents


@triton.jit
def _key_positions(j0, j_end, QOFF, J: tl.constexpr):
    """A key tile: keys j0 .. j0 + J - 1, present below j_end (kin_J). kpos_J is a key's position
    minus QOFF (key j is causally visible to query t iff j - QOFF <= t), huge where a key is not
    present; kpos64 the positions as int64 offsets."""
    j_J = j0 + tl.arange(0, J)
    kin_J = j_J < j_end
    kpos_J = tl.where(kin_J, j_J - QOFF, 2147483647)
    return kin_J, kpos_J, j_J.to(tl.int64)


@triton.jit
def _block_range(b, n, TK, N, bstart_ptr, bend_ptr, BLOCK: tl.constexpr, DOCS: tl.constexpr):
    """First key and one past the last key of block n of row b: the document table's entry, or
    the sequence's block n."""
    if DOCS:
        j0 = tl.load(bstart_ptr + b * N + n)
        j_end = tl.load(bend_ptr + b * N + n)
    else:
        j0 = n * BLOCK
        j_end = tl.minimum(n * BLOCK + BLOCK, TK)
    return j0, j_end


@triton.jit
def _work_item(tb_ptr, ts_ptr, tc_ptr, TK, N, bstart_ptr, bend_ptr, G: tl.constexpr, BLOCK: tl.constexpr,
               DOCS: tl.constexpr):
    """This program's run of a bucket's entries (see ops/sparse_attention/inverse_index.py): whether it has one
    (spare programs do not), the bucket's b, g and block n, the entries lo .. hi - 1 (none when
    spare) and the block's keys j0 .. j_end - 1."""
    pid = tl.program_id(0)
    bucket = tl.load(tb_ptr + pid)
    live = bucket >= 0
    b, g, n = decode_bucket(tl.maximum(bucket, 0), N, G)
    lo = tl.load(ts_ptr + pid)
    hi = tl.where(live, lo + tl.load(tc_ptr + pid), lo)
    j0, j_end = _block_range(b, n, TK, N, bstart_ptr, bend_ptr, BLOCK, DOCS)
    return live, b, g, n, lo, hi, j0, j_end


@triton.jit
def _key_rows(ptr, kpos64, s_t, kin_J, W: tl.constexpr):
    """Rows [J, W] at positions kpos64 of a [.., T, .., W] tensor whose row stride is s_t (zero
    where a key is not present)."""
    return tl.load(ptr + kpos64[:, None] * s_t + tl.arange(0, W)[None, :], mask=kin_J[:, None], other=0.0)


@triton.jit
def _teacher_student(q_ptr, lse_ptr, iq_ptr, b, g, t_M, t_R, row_M, row_R, k_JD, ik_JI, kpos_J, start_M, start_R,
                     sq_b, sq_t, sq_h, sl_b, sl_t, sl_h, si_b, si_t, si_h, scale_log2, index_scale,
                     H: tl.constexpr, HS: tl.constexpr, M: tl.constexpr, D: tl.constexpr,
                     DI: tl.constexpr, J: tl.constexpr, PREC: tl.constexpr, DOC_MASK: tl.constexpr):
    """Key-major tiles for queries t_M against keys kpos_J: teacher p [J, M] (unnormalised group
    mean), student z [J, M] (-inf off the support), the support mask [J, M] and the iq tile [M, Di].

    Scores are S^T = K Q^T over R = M*HS rows (HS heads of each query; t_R / row_R repeat t_M /
    row_M HS times, row r is query r // HS, because Triton cannot gather a register tensor). The
    mean over a query's heads is a product with a constant [R, M] averaging matrix, so the [J, R]
    probabilities feed a matrix product from registers instead of a reduction across threads,
    which made the sparse forward about a third faster (bench/RESULTS.md, "Figures behind code
    choices"). kpos_J is a key's position minus QOFF (key j is visible to query t iff
    j - QOFF <= t), huge where a key column does not exist. With DOC_MASK, start_M / start_R
    are the rows' document starts minus QOFF, and keys before them are off the support.
    """
    offs_d = tl.arange(0, D)
    r_R = tl.arange(0, M * HS)
    t_R64 = t_R.to(tl.int64)
    # probabilities <= 1 go to the averaging product in fp16 (fp32 when the inputs are fp32)
    P_DT = tl.float32 if q_ptr.dtype.element_ty == tl.float32 else tl.float16
    avg_RM = tl.where(r_R[:, None] // HS == tl.arange(0, M)[None, :], 1.0 / H, 0.0).to(P_DT)
    valid_JR = (kpos_J[:, None] <= t_R[None, :]) & row_R[None, :]
    if DOC_MASK:
        valid_JR = valid_JR & (kpos_J[:, None] >= start_R[None, :])
    p_JM = tl.zeros((J, M), dtype=tl.float32)
    for hs in tl.static_range(H // HS):
        head_R = g * H + hs * HS + r_R % HS
        q_RD = tl.load(q_ptr + b * sq_b + t_R64[:, None] * sq_t + head_R[:, None] * sq_h + offs_d[None, :],
                       mask=row_R[:, None], other=0.0)
        lse_R = tl.load(lse_ptr + b * sl_b + t_R64 * sl_t + head_R * sl_h, mask=row_R, other=0.0)
        # an empty support has lse = -inf; its column is all masked, any finite stand-in will do
        lse_R = tl.where(lse_R == float("-inf"), 0.0, lse_R)
        s_JR = dot(k_JD, tl.trans(q_RD), PREC)
        e_JR = tl.where(valid_JR, tl.exp2(s_JR * scale_log2 - lse_R[None, :] * LOG2E), 0.0)
        p_JM += dot(e_JR.to(P_DT), avg_RM, PREC)
    z_JM, valid_JM, iq_MI = _student(iq_ptr, b, g, t_M, row_M, ik_JI, kpos_J, start_M, si_b, si_t, si_h,
                                     index_scale, DI, PREC, DOC_MASK)
    return p_JM, z_JM, valid_JM, iq_MI


@triton.jit
def _student(iq_ptr, b, g, t_M, row_M, ik_JI, kpos_J, start_M, si_b, si_t, si_h, index_scale, DI: tl.constexpr,
             PREC: tl.constexpr, DOC_MASK: tl.constexpr):
    """Key-major student logits z [J, M] (-inf off the support), the support mask [J, M] and the
    iq tile [M, Di] of queries t_M (see `_teacher_student`)."""
    iq_MI = tl.load(iq_ptr + b * si_b + t_M.to(tl.int64)[:, None] * si_t + g * si_h + tl.arange(0, DI)[None, :],
                    mask=row_M[:, None], other=0.0)
    valid_JM = (kpos_J[:, None] <= t_M[None, :]) & row_M[None, :]
    if DOC_MASK:
        valid_JM = valid_JM & (kpos_J[:, None] >= start_M[None, :])
    z_JM = tl.where(valid_JM, dot(ik_JI, tl.trans(iq_MI), PREC) * index_scale, float("-inf"))
    return z_JM, valid_JM, iq_MI


@triton.jit
def _student_lse_step(j0, m_M, l_M, iq_MI, ik_ptr, b, TK, QOFF, t_M, row_M, start_M, sik_b, sik_t, index_scale,
                      J: tl.constexpr, DI: tl.constexpr, PREC: tl.constexpr, DOCS: tl.constexpr):
    kpos_J = j0 + tl.arange(0, J)
    ikT_IJ = tl.load(ik_ptr + b * sik_b + kpos_J.to(tl.int64)[None, :] * sik_t + tl.arange(0, DI)[:, None],
                     mask=(kpos_J < TK)[None, :], other=0.0)
    z_MJ = dot(iq_MI, ikT_IJ, PREC) * index_scale
    vis_MJ = row_M[:, None] & (kpos_J[None, :] - QOFF <= t_M[:, None])
    if DOCS:
        vis_MJ = vis_MJ & (kpos_J[None, :] >= start_M[:, None])
    z_MJ = tl.where(vis_MJ, z_MJ, float("-inf"))
    m_new = tl.maximum(m_M, tl.max(z_MJ, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    l_M = l_M * tl.exp(m_M - m_safe) + tl.sum(tl.exp(z_MJ - m_safe[:, None]), axis=1)
    return m_new, l_M


@triton.jit
def kl_student_lse_kernel(iq_ptr, ik_ptr, lsez_ptr, doc_ptr, T, TK, QOFF, si_b, si_t, si_h, sik_b, sik_t, index_scale,
                          G: tl.constexpr, M: tl.constexpr, J: tl.constexpr, DI: tl.constexpr, PREC: tl.constexpr,
                          DOCS: tl.constexpr):
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
    if DOCS:
        start_M, j_first = row_documents(doc_ptr + b * T, t_M, row_M, pid_m * M, J)
    else:
        start_M = t_M
        j_first = 0
    if INTERPRET:
        j0 = j_first
        while j0 < hi:
            m_M, l_M = _student_lse_step(j0, m_M, l_M, iq_MI, ik_ptr, b, TK, QOFF, t_M, row_M, start_M, sik_b, sik_t,
                                         index_scale, J, DI, PREC, DOCS)
            j0 += J
    else:
        for j0 in range(j_first, hi, J):
            m_M, l_M = _student_lse_step(j0, m_M, l_M, iq_MI, ik_ptr, b, TK, QOFF, t_M, row_M, start_M, sik_b, sik_t,
                                         index_scale, J, DI, PREC, DOCS)
    m_safe = tl.where(m_M == float("-inf"), 0.0, m_M)
    lse_z = tl.where(l_M > 0, m_safe + tl.log(tl.maximum(l_M, FP32_TINY)), float("-inf"))
    tl.store(lsez_ptr + (b * T + t_M.to(tl.int64)) * G + g, lse_z, mask=row_M)


@triton.jit
def _dense_keys_step(j0, s_M, a_M, bz_M, accq_IM, accp_IM, lsez_M, q_ptr, k_ptr, lse_ptr, iq_ptr, ik_ptr, b, g, TK,
                     QOFF, t_M, t_R, row_M, row_R, start_M, start_R, sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sl_b, sl_t,
                     sl_h, si_b, si_t, si_h, sik_b, sik_t, scale_log2, index_scale, H: tl.constexpr,
                     HS: tl.constexpr, M: tl.constexpr, J: tl.constexpr, D: tl.constexpr, DI: tl.constexpr,
                     PREC: tl.constexpr, DOCS: tl.constexpr):
    """One key tile of the dense forward's second pass (key-major tiles, lse_z known)."""
    kin_J, kpos_J, kpos64 = _key_positions(j0, TK, QOFF, J)
    k_JD = _key_rows(k_ptr + b * sk_b + g * sk_h, kpos64, sk_t, kin_J, D)
    ik_JI = _key_rows(ik_ptr + b * sik_b, kpos64, sik_t, kin_J, DI)
    p_JM, z_JM, valid_JM, iq_MI = _teacher_student(
        q_ptr, lse_ptr, iq_ptr, b, g, t_M, t_R, row_M, row_R, k_JD, ik_JI, kpos_J, start_M, start_R,
        sq_b, sq_t, sq_h, sl_b, sl_t, sl_h, si_b, si_t, si_h, scale_log2, index_scale,
        H, HS, M, D, DI, J, PREC, DOCS)
    dt = iq_MI.dtype
    qz_JM = tl.where(valid_JM, tl.exp(z_JM - lsez_M[None, :]), 0.0)
    s_M += tl.sum(p_JM, axis=0)
    a_M += tl.sum(p_JM * tl.log(tl.maximum(p_JM, FP32_TINY)), axis=0)
    bz_M += tl.sum(tl.where(valid_JM, p_JM * z_JM, 0.0), axis=0)
    ikT_IJ = tl.trans(ik_JI)
    accq_IM += dot(ikT_IJ, qz_JM.to(dt), PREC)
    accp_IM += dot(ikT_IJ, p_JM.to(dt), PREC)
    return s_M, a_M, bz_M, accq_IM, accp_IM


@triton.jit
def kl_dense_keys_kernel(q_ptr, k_ptr, lse_ptr, iq_ptr, ik_ptr, kl_ptr, lsez_ptr, invs_ptr, diq_ptr, doc_ptr, T, TK,
                         QOFF, sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sl_b, sl_t, sl_h, si_b, si_t, si_h, sik_b, sik_t,
                         scale_log2, index_scale, G: tl.constexpr, H: tl.constexpr, HS: tl.constexpr,
                         M: tl.constexpr, J: tl.constexpr, D: tl.constexpr, DI: tl.constexpr, PREC: tl.constexpr,
                         DOCS: tl.constexpr):
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
    if DOCS:
        # in kpos units (position - QOFF), as _teacher_student compares them
        start_M, j_first = row_documents(doc_ptr + b * T, t_M, row_M, pid_m * M, J)
        start_M -= QOFF
        start_R = tl.load(doc_ptr + b * T + t_R, mask=row_R, other=0) - QOFF
    else:
        start_M = t_M
        start_R = t_R
        j_first = 0
    if INTERPRET:
        j0 = j_first
        while j0 < hi:
            s_M, a_M, bz_M, accq_IM, accp_IM = _dense_keys_step(
                j0, s_M, a_M, bz_M, accq_IM, accp_IM, lsez_M, q_ptr, k_ptr, lse_ptr, iq_ptr, ik_ptr, b, g, TK, QOFF,
                t_M, t_R, row_M, row_R, start_M, start_R, sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sl_b, sl_t, sl_h,
                si_b, si_t, si_h, sik_b, sik_t, scale_log2, index_scale, H, HS, M, J, D, DI, PREC, DOCS)
            j0 += J
    else:
        for j0 in range(j_first, hi, J):
            s_M, a_M, bz_M, accq_IM, accp_IM = _dense_keys_step(
                j0, s_M, a_M, bz_M, accq_IM, accp_IM, lsez_M, q_ptr, k_ptr, lse_ptr, iq_ptr, ik_ptr, b, g, TK, QOFF,
                t_M, t_R, row_M, row_R, start_M, start_R, sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sl_b, sl_t, sl_h,
                si_b, si_t, si_h, sik_b, sik_t, scale_log2, index_scale, H, HS, M, J, D, DI, PREC, DOCS)
    s_safe = tl.maximum(s_M, FP32_TINY)
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
                     J: tl.constexpr, D: tl.constexpr, DI: tl.constexpr, PREC: tl.constexpr, STORE: tl.constexpr,
                     TEACHER: tl.constexpr):
    """M entries of one key block's list: writes their five sums (and, with STORE, the teacher row
    p [J] of each entry to pbar [E, J], so the backward need not recompute it). Without TEACHER
    only the student's two (max z, sum exp(z - max z)) are written."""
    offs_j = tl.arange(0, J)
    idx_M = start + tl.arange(0, M)
    row_M = idx_M < hi
    e_M = tl.load(ent_ptr + idx_M, mask=row_M, other=0)
    t_M = e_M // (G * K) - b * T
    # a table block holds keys of the entries' own document only: no document mask
    if TEACHER:
        idx_R = start + tl.arange(0, M * HS) // HS
        row_R = idx_R < hi
        t_R = tl.load(ent_ptr + idx_R, mask=row_R, other=0) // (G * K) - b * T
        p_JM, z_JM, valid_JM, iq_MI = _teacher_student(
            q_ptr, lse_ptr, iq_ptr, b, g, t_M, t_R, row_M, row_R, k_JD, ik_JI, kpos_J, t_M, t_R,
            sq_b, sq_t, sq_h, sl_b, sl_t, sl_h, si_b, si_t, si_h, scale_log2, index_scale,
            H, HS, M, D, DI, J, PREC, False)
    else:
        z_JM, valid_JM, iq_MI = _student(iq_ptr, b, g, t_M, row_M, ik_JI, kpos_J, t_M, si_b, si_t, si_h,
                                         index_scale, DI, PREC, False)
    mz = tl.max(z_JM, axis=0)
    mz_safe = tl.where(mz == float("-inf"), 0.0, mz)
    lz = tl.sum(tl.exp(z_JM - mz_safe[None, :]), axis=0)
    e64 = e_M.to(tl.int64)
    tl.store(part_ptr + e64, mz, mask=row_M)
    tl.store(part_ptr + E + e64, lz, mask=row_M)
    if TEACHER:
        s = tl.sum(p_JM, axis=0)
        a = tl.sum(p_JM * tl.log(tl.maximum(p_JM, FP32_TINY)), axis=0)
        bz = tl.sum(tl.where(valid_JM, p_JM * z_JM, 0.0), axis=0)
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
def kl_sparse_fwd_kernel(q_ptr, k_ptr, lse_ptr, iq_ptr, ik_ptr, ent_ptr, tb_ptr, ts_ptr, tc_ptr, part_ptr, pbar_ptr,
                         bstart_ptr, bend_ptr, T, TK, QOFF, E, N, sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sl_b, sl_t,
                         sl_h, si_b, si_t, si_h, sik_b, sik_t, scale_log2, index_scale, BLOCK: tl.constexpr,
                         G: tl.constexpr, K: tl.constexpr, H: tl.constexpr, HS: tl.constexpr, M: tl.constexpr,
                         J: tl.constexpr, D: tl.constexpr, DI: tl.constexpr, PREC: tl.constexpr, STORE: tl.constexpr,
                         DOCS: tl.constexpr, TEACHER: tl.constexpr):
    """Key-outer: program p takes a run of entries ent[ts[p] : ts[p] + tc[p]] that all selected
    block n of bucket tb[p] = (b*G + g)*N + n (-1: spare program) and writes their five sums
    (max z, sum exp(z - max z), s_sum, a, bz) to part [5, E] at each entry's index. Without
    TEACHER (the teacher then comes from the attention's backward) only the first two, into
    part [2, E]; q, k and lse are not read."""
    live, b, g, n, lo, hi, j0, j_end = _work_item(tb_ptr, ts_ptr, tc_ptr, TK, N, bstart_ptr, bend_ptr, G, BLOCK, DOCS)
    if live:
        kin_J, kpos_J, kpos64 = _key_positions(j0, j_end, QOFF, J)
        if TEACHER:
            k_JD = _key_rows(k_ptr + b * sk_b + g * sk_h, kpos64, sk_t, kin_J, D)
        else:
            k_JD = kin_J
        ik_JI = _key_rows(ik_ptr + b * sik_b, kpos64, sik_t, kin_J, DI)
        if INTERPRET:
            start = lo
            while start < hi:
                _sparse_fwd_step(start, hi, q_ptr, lse_ptr, iq_ptr, ent_ptr, part_ptr, pbar_ptr, b, g, T, E,
                                 k_JD, ik_JI, kpos_J, sq_b, sq_t, sq_h, sl_b, sl_t, sl_h, si_b, si_t, si_h,
                                 scale_log2, index_scale, G, K, H, HS, M, J, D, DI, PREC, STORE, TEACHER)
                start += M
        else:
            for start in range(lo, hi, M):
                _sparse_fwd_step(start, hi, q_ptr, lse_ptr, iq_ptr, ent_ptr, part_ptr, pbar_ptr, b, g, T, E,
                                 k_JD, ik_JI, kpos_J, sq_b, sq_t, sq_h, sl_b, sl_t, sl_h, si_b, si_t, si_h,
                                 scale_log2, index_scale, G, K, H, HS, M, J, D, DI, PREC, STORE, TEACHER)


@triton.jit
def _bwd_step(start, hi, dik_JI, q_ptr, lse_ptr, iq_ptr, lsez_ptr, invs_ptr, ent_ptr, diq_ptr, doc_ptr, b, g, T,
              QOFF, k_JD, ik_JI, kpos_J, sq_b, sq_t, sq_h, sl_b, sl_t, sl_h, si_b, si_t, si_h, scale_log2,
              index_scale, G: tl.constexpr, K: tl.constexpr, H: tl.constexpr, HS: tl.constexpr,
              M: tl.constexpr, J: tl.constexpr, D: tl.constexpr, DI: tl.constexpr, SPARSE: tl.constexpr,
              PREC: tl.constexpr, DOCS: tl.constexpr, DET: tl.constexpr):
    """M queries (list entries when sparse, consecutive tokens when dense) against one key block.
    Sparse: d iq added by atomics into diq [B, T, G, Di], or with DET stored per entry into
    diq [E, Di] (each entry is one program's, so the caller's sum over slots has a fixed order)."""
    dt = iq_ptr.dtype.element_ty
    offs_i = tl.arange(0, DI)
    idx_M = start + tl.arange(0, M)
    row_M = idx_M < hi
    idx_R = start + tl.arange(0, M * HS) // HS
    row_R = idx_R < hi
    if SPARSE:
        e_M = tl.load(ent_ptr + idx_M, mask=row_M, other=0)
        t_M = e_M // (G * K) - b * T
        t_R = tl.load(ent_ptr + idx_R, mask=row_R, other=0) // (G * K) - b * T
        # a table block holds keys of the entries' own document only: no document mask
        p_JM, z_JM, valid_JM, iq_MI = _teacher_student(
            q_ptr, lse_ptr, iq_ptr, b, g, t_M, t_R, row_M, row_R, k_JD, ik_JI, kpos_J, t_M, t_R,
            sq_b, sq_t, sq_h, sl_b, sl_t, sl_h, si_b, si_t, si_h, scale_log2, index_scale,
            H, HS, M, D, DI, J, PREC, False)
    else:
        t_M = idx_M
        t_R = idx_R
        if DOCS:
            start_M = tl.load(doc_ptr + b * T + t_M, mask=row_M, other=0) - QOFF
            start_R = tl.load(doc_ptr + b * T + t_R, mask=row_R, other=0) - QOFF
        else:
            start_M = t_M
            start_R = t_R
        p_JM, z_JM, valid_JM, iq_MI = _teacher_student(
            q_ptr, lse_ptr, iq_ptr, b, g, t_M, t_R, row_M, row_R, k_JD, ik_JI, kpos_J, start_M, start_R,
            sq_b, sq_t, sq_h, sl_b, sl_t, sl_h, si_b, si_t, si_h, scale_log2, index_scale,
            H, HS, M, D, DI, J, PREC, DOCS)
    o_M = (b * T + t_M.to(tl.int64)) * G + g
    lse_z = tl.load(lsez_ptr + o_M, mask=row_M, other=0.0)
    lse_z = tl.where(lse_z == float("-inf"), 0.0, lse_z)
    inv_s = tl.load(invs_ptr + o_M, mask=row_M, other=0.0)
    dz_JM = tl.where(valid_JM, tl.exp(z_JM - lse_z[None, :]) - p_JM * inv_s[None, :], 0.0).to(dt)
    dik_JI += dot(dz_JM, iq_MI, PREC)
    if SPARSE:
        dq_IM = dot(tl.trans(ik_JI), dz_JM, PREC)
        if DET:
            tl.store(diq_ptr + e_M.to(tl.int64)[None, :] * DI + offs_i[:, None], dq_IM, mask=row_M[None, :])
        else:
            tl.atomic_add(diq_ptr + o_M[None, :] * DI + offs_i[:, None], dq_IM, mask=row_M[None, :], sem="relaxed")
    return dik_JI


@triton.jit
def kl_bwd_kernel(q_ptr, k_ptr, lse_ptr, iq_ptr, ik_ptr, lsez_ptr, invs_ptr, ent_ptr, tb_ptr, ts_ptr, tc_ptr,
                  dik_ptr, diq_ptr, doc_ptr, bstart_ptr, bend_ptr, qend_ptr, B, T, TK, QOFF, N, sq_b, sq_t, sq_h,
                  sk_b, sk_t, sk_h, sl_b, sl_t, sl_h, si_b, si_t, si_h, sik_b, sik_t, scale_log2, index_scale,
                  BLOCK: tl.constexpr, G: tl.constexpr, K: tl.constexpr, H: tl.constexpr, HS: tl.constexpr,
                  M: tl.constexpr, J: tl.constexpr, D: tl.constexpr, DI: tl.constexpr, SPARSE: tl.constexpr,
                  PREC: tl.constexpr, DOCS: tl.constexpr, DET: tl.constexpr = False):
    """Key-outer backward over the keys of block n (BLOCK keys).

    dense: program (n, b*G+g) streams every query after the block and stores group g's unscaled
    d ik to dik [G, B, TK, Di] (deterministic). sparse: program p takes a run of a bucket's
    entries (as the forward) and adds its d ik into dik [B, TK, Di] and d iq into diq [B, T, G, Di]
    with fp32 atomics (a popular block is split over several programs). With DET (deterministic
    sums) it stores instead: its d ik to dik [P, J, Di] at its program id, its entries' d iq to
    diq [E, Di]; `kl_dik_reduce_kernel` and a sum over slots add them up in a fixed order.
    """
    if SPARSE:
        live, b, g, n, lo, hi, j0, j_end = _work_item(tb_ptr, ts_ptr, tc_ptr, TK, N, bstart_ptr, bend_ptr, G, BLOCK,
                                                      DOCS)
    else:
        n = tl.program_id(0)
        b = tl.program_id(1) // G
        g = tl.program_id(1) % G
        live = True
        # queries before the block cannot see it, nor (documents) those of later documents
        lo = tl.maximum(n * BLOCK - QOFF, 0)
        if DOCS:
            hi = tl.load(qend_ptr + b * N + n)
        else:
            hi = T
        j0, j_end = _block_range(b, n, TK, N, bstart_ptr, bend_ptr, BLOCK, False)
    offs_i = tl.arange(0, DI)
    kin_J, kpos_J, kpos64 = _key_positions(j0, j_end, QOFF, J)
    k_JD = _key_rows(k_ptr + b * sk_b + g * sk_h, kpos64, sk_t, kin_J, D)
    ik_JI = _key_rows(ik_ptr + b * sik_b, kpos64, sik_t, kin_J, DI)
    dik_JI = tl.zeros((J, DI), tl.float32)
    if INTERPRET:
        start = lo
        while start < hi:
            dik_JI = _bwd_step(start, hi, dik_JI, q_ptr, lse_ptr, iq_ptr, lsez_ptr, invs_ptr, ent_ptr, diq_ptr,
                               doc_ptr, b, g, T, QOFF, k_JD, ik_JI, kpos_J, sq_b, sq_t, sq_h, sl_b, sl_t, sl_h, si_b,
                               si_t, si_h, scale_log2, index_scale, G, K, H, HS, M, J, D, DI, SPARSE, PREC, DOCS,
                               DET)
            start += M
    else:
        for start in range(lo, hi, M):
            dik_JI = _bwd_step(start, hi, dik_JI, q_ptr, lse_ptr, iq_ptr, lsez_ptr, invs_ptr, ent_ptr, diq_ptr,
                               doc_ptr, b, g, T, QOFF, k_JD, ik_JI, kpos_J, sq_b, sq_t, sq_h, sl_b, sl_t, sl_h, si_b,
                               si_t, si_h, scale_log2, index_scale, G, K, H, HS, M, J, D, DI, SPARSE, PREC, DOCS,
                               DET)
    if SPARSE:
        if DET:
            _store_item(dik_ptr, dik_JI, live, J, DI)
        else:
            o_J = b * TK + kpos64
            tl.atomic_add(dik_ptr + o_J[:, None] * DI + offs_i[None, :], dik_JI, mask=kin_J[:, None] & live,
                          sem="relaxed")
    else:
        o_J = (g * B + b) * TK + kpos64
        tl.store(dik_ptr + o_J[:, None] * DI + offs_i[None, :], dik_JI, mask=kin_J[:, None])


@triton.jit
def _stored_bwd_step(start, hi, dik_JI, iq_ptr, pbar_ptr, lsez_ptr, invs_ptr, ent_ptr, diq_ptr, bz_ptr, b, g, T,
                     ikT_IJ, ik_JI, kpos_J, si_b, si_t, si_h, index_scale, G: tl.constexpr, K: tl.constexpr,
                     M: tl.constexpr, J: tl.constexpr, DI: tl.constexpr, PREC: tl.constexpr, VALUE: tl.constexpr,
                     DET: tl.constexpr):
    """M entries of one key block's list, teacher read from pbar [E, J]: only the student is
    recomputed. With VALUE also the loss's sum bz = sum p z, added per (b, t, g) to bz [B*T*G]
    (when the forward did not compute the teacher). DET: d iq and bz stored per entry instead,
    into diq [E, Di] and bz [E] (see `kl_bwd_kernel`)."""
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
    z_MJ = dot(iq_MI, ikT_IJ, PREC) * index_scale
    o_M = (b * T + t_M64) * G + g
    lse_z = tl.load(lsez_ptr + o_M, mask=row_M, other=0.0)
    lse_z = tl.where(lse_z == float("-inf"), 0.0, lse_z)
    inv_s = tl.load(invs_ptr + o_M, mask=row_M, other=0.0)
    dz_MJ = tl.where(valid_MJ, tl.exp(z_MJ - lse_z[:, None]) - p_MJ * inv_s[:, None], 0.0).to(dt)
    dik_JI += dot(tl.trans(dz_MJ), iq_MI, PREC)
    dq_MI = dot(dz_MJ, ik_JI, PREC)
    e64 = e_M.to(tl.int64)
    if DET:
        tl.store(diq_ptr + e64[:, None] * DI + offs_i[None, :], dq_MI, mask=row_M[:, None])
    else:
        tl.atomic_add(diq_ptr + o_M[:, None] * DI + offs_i[None, :], dq_MI, mask=row_M[:, None], sem="relaxed")
    if VALUE:
        # p is zero off the support, where z is finite
        if DET:
            tl.store(bz_ptr + e64, tl.sum(p_MJ * z_MJ, axis=1), mask=row_M)
        else:
            tl.atomic_add(bz_ptr + o_M, tl.sum(p_MJ * z_MJ, axis=1), mask=row_M, sem="relaxed")
    return dik_JI


@triton.jit
def kl_stored_bwd_kernel(iq_ptr, ik_ptr, pbar_ptr, lsez_ptr, invs_ptr, ent_ptr, tb_ptr, ts_ptr, tc_ptr, dik_ptr,
                         diq_ptr, bz_ptr, bstart_ptr, bend_ptr, T, TK, QOFF, N, si_b, si_t, si_h, sik_b, sik_t,
                         index_scale, BLOCK: tl.constexpr, G: tl.constexpr, K: tl.constexpr, M: tl.constexpr,
                         J: tl.constexpr, DI: tl.constexpr, PREC: tl.constexpr, DOCS: tl.constexpr,
                         VALUE: tl.constexpr, DET: tl.constexpr = False):
    """Sparse backward with the teacher stored (by the KL's forward or the attention's backward):
    program p takes a run of a bucket's entries (as `kl_bwd_kernel`); d ik [B, TK, Di] and
    d iq [B, T, G, Di] by fp32 atomics; with VALUE the loss's bz (`_stored_bwd_step`). DET: the
    stores of `kl_bwd_kernel`'s deterministic mode (and bz per entry)."""
    live, b, g, n, lo, hi, j0, j_end = _work_item(tb_ptr, ts_ptr, tc_ptr, TK, N, bstart_ptr, bend_ptr, G, BLOCK, DOCS)
    if live:
        offs_i = tl.arange(0, DI)
        kin_J, kpos_J, kpos64 = _key_positions(j0, j_end, QOFF, J)
        ik_JI = _key_rows(ik_ptr + b * sik_b, kpos64, sik_t, kin_J, DI)
        ikT_IJ = tl.trans(ik_JI)
        dik_JI = tl.zeros((J, DI), tl.float32)
        if INTERPRET:
            start = lo
            while start < hi:
                dik_JI = _stored_bwd_step(start, hi, dik_JI, iq_ptr, pbar_ptr, lsez_ptr, invs_ptr, ent_ptr, diq_ptr,
                                          bz_ptr, b, g, T, ikT_IJ, ik_JI, kpos_J, si_b, si_t, si_h, index_scale,
                                          G, K, M, J, DI, PREC, VALUE, DET)
                start += M
        else:
            for start in range(lo, hi, M):
                dik_JI = _stored_bwd_step(start, hi, dik_JI, iq_ptr, pbar_ptr, lsez_ptr, invs_ptr, ent_ptr, diq_ptr,
                                          bz_ptr, b, g, T, ikT_IJ, ik_JI, kpos_J, si_b, si_t, si_h, index_scale,
                                          G, K, M, J, DI, PREC, VALUE, DET)
        if DET:
            _store_item(dik_ptr, dik_JI, live, J, DI)
        else:
            o_J = b * TK + kpos64
            tl.atomic_add(dik_ptr + o_J[:, None] * DI + offs_i[None, :], dik_JI, mask=kin_J[:, None], sem="relaxed")


@triton.jit
def _store_item(dikp_ptr, dik_JI, live, J: tl.constexpr, DI: tl.constexpr):
    """A work item's d ik [J, Di] to its row of dikp [P, J, Di] (the program id; spare programs,
    which belong to no bucket, store nothing)."""
    pid = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, J)[:, None] * DI + tl.arange(0, DI)[None, :]
    tl.store(dikp_ptr + pid * (J * DI) + rows, dik_JI, mask=(rows >= 0) & live)


@triton.jit
def kl_dik_reduce_kernel(dikp_ptr, dik_ptr, first_ptr, runs_ptr, bstart_ptr, bend_ptr, B, TK, N,
                         BLOCK: tl.constexpr, G: tl.constexpr, J: tl.constexpr, DI: tl.constexpr, RB: tl.constexpr,
                         DOCS: tl.constexpr):
    """Deterministic d ik: bucket (b, g, n)'s work items (`first` .. `first + runs - 1`, each a
    partial [J, Di] of dikp) summed in order into the block's keys of dik [G, B, TK, Di] (fp32;
    blocks of one (b, g) never share keys, and each group has its own slice). Grid: (buckets,
    J / RB)."""
    bucket = tl.program_id(0)
    nitem = tl.load(runs_ptr + bucket)
    if nitem > 0:
        first = tl.load(first_ptr + bucket).to(tl.int64)
        b, g, n = decode_bucket(bucket, N, G)
        j0, j_end = _block_range(b, n, TK, N, bstart_ptr, bend_ptr, BLOCK, DOCS)
        rr = tl.program_id(1) * RB + tl.arange(0, RB)
        offs_i = tl.arange(0, DI)
        acc = tl.zeros((RB, DI), tl.float32)
        it = first
        while it < first + nitem:
            acc += tl.load(dikp_ptr + it * (J * DI) + rr[:, None] * DI + offs_i[None, :])
            it += 1
        j = j0 + rr
        dst = ((g * B + b).to(tl.int64) * TK + j)[:, None] * DI + offs_i[None, :]
        tl.store(dik_ptr + dst, acc, mask=(j < j_end)[:, None])


@triton.jit
def kl_teacher_sums_kernel(pbar_ptr, idx_ptr, sums_ptr, ROWS, K: tl.constexpr, J: tl.constexpr, RB: tl.constexpr,
                           LB: tl.constexpr):
    """Per (b, t, g), its K*J teacher values pbar [ROWS, K*J] (contiguous): sums [2, ROWS] =
    (sum p, sum p log p), the loss's terms that need the teacher alone. Rows of empty slots
    (idx [ROWS, K] < 0, the cleaned ids) were never written and are not read."""
    r = tl.program_id(0).to(tl.int64) * RB + tl.arange(0, RB)
    ok = r < ROWS
    s = tl.zeros((RB,), tl.float32)
    a = tl.zeros((RB,), tl.float32)
    for c0 in range(0, K * J, LB):
        c = c0 + tl.arange(0, LB)
        cin = c < K * J
        live = tl.load(idx_ptr + r[:, None] * K + c[None, :] // J, mask=ok[:, None] & cin[None, :], other=-1) >= 0
        p = tl.load(pbar_ptr + r[:, None] * (K * J) + c[None, :], mask=live, other=0.0).to(tl.float32)
        s += tl.sum(p, 1)
        a += tl.sum(p * tl.log(tl.maximum(p, FP32_TINY)), 1)
    tl.store(sums_ptr + r, s, mask=ok)
    tl.store(sums_ptr + ROWS + r, a, mask=ok)
