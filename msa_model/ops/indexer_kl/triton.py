"""Fused Triton path of the indexer KL loss, sparse (top-k blocks) and dense (warmup) modes:
launchers and the autograd Function; the kernels are in triton_kernels.py.

Legend: B = batch, T = queries, TK = keys (query t sits at position QOFF + t; TK = QOFF + T),
G = groups (= Hkv), H = heads per group, D = head dim, Di = index head dim, K = top-k slots,
N = key blocks, E = B*T*G*K (query, group, slot) entries, M = queries in a tile, R = M*HS
teacher rows (HS heads of each query), J = keys in a tile.

Per (query t, group g) with support S, teacher p[j] = mean_h exp(q_h.k_j*scale - lse_h) (left
unnormalised, its sum is s_sum), student z[j] = (iq.ik_j)*index_scale. The loss row

    KL = sum_j (p/s_sum)(log(p/s_sum) - z + lse_z)
       = a/s_sum - log s_sum - bz/s_sum + lse_z,  a = sum p log p, bz = sum p z,

is a function of five running sums over the support, so one pass over the keys gives it, with
lse_z kept online. Its gradient in z is dz = exp(z - lse_z) - p/s_sum (times grad*index_scale/count).

- dense: the forward takes two query-outer passes over the causal keys. The first finds lse_z
  (the student alone, 1/H of the work); the second, knowing lse_z, needs no online softmax and
  so runs on key-major tiles (keys are the products' long side, as in the backward), summing
  the loss terms and d iq = sum_j dz_j ik_j per query: faster than one online pass on row-major
  tiles. The backward is key-outer for d ik. Memory O(T).
- sparse: every selection differs per query, so query-outer would re-read a key block (k and ik,
  J*(D+Di) values) for each (t, g, slot) while key-outer reads q's G*D values: key-outer it is, on
  an inverse index (for each (b, g, n): the entries that selected block n). The forward writes the
  five sums per entry, a combine reduces them over the K slots, and (when gradients are needed and
  they fit in `Tuning.teacher_bytes`) each entry's teacher row. The backward reads those rows and
  recomputes only the student (else both), keeps d ik in registers and adds d iq with atomics
  (fp32, order not fixed). Under torch.use_deterministic_algorithms(True) the programs store
  their d iq per entry and their d ik per work item instead, summed afterwards in a fixed order
  (`_sums`): the same bits run to run.
d ik is written per group and summed over groups afterwards (ik is shared by all groups).
Packed documents: the sparse kernels read the documents' block table, the dense ones each
query's document start (see triton_kernels.py).
"""

from __future__ import annotations

import torch
import triton

from ..common import as_int32
from ..sparse_attention.inverse_index import (DocumentBlocks, InverseIndex, build_inverse_index, clean_block_idx,
                                              document_blocks, query_ends, schedule)
from ..triton_utils import LOG2E
from .triton_kernels import (kl_bwd_kernel, kl_dense_keys_kernel, kl_dik_reduce_kernel, kl_sparse_fwd_kernel,
                             kl_stored_bwd_kernel, kl_student_lse_kernel, kl_teacher_sums_kernel)
from .tuning import DEFAULT_TUNING, Tuning


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


def inverse_index(block_idx: torch.Tensor, block_size: int, q_offset: int = 0, doc_start=None,
                  docs: DocumentBlocks | None = None) -> InverseIndex:
    """For each bucket (b, g, n): the entries e = ((b*T + t)*G + g)*K + slot whose slot selects
    block n, t ascending (`InverseIndex` of sparse_attention's Triton path).

    block_idx int [B, T, G, K] (-1 = empty; repeats in a row and blocks after the query's own
    are dropped, as the reference's support does); query t sits at position q_offset + t, so
    the blocks are those of q_offset + T keys, or with packed documents (doc_start int32 [B, T]
    and its block table `docs`) the table's.
    """
    B, T, G, K = block_idx.shape
    N = triton.cdiv(q_offset + T, block_size) if docs is None else docs.n_blocks
    if B * T * G * K >= 2**31 or B * G * N >= 2**31:
        raise ValueError("block_idx too large for int32 entry ids")
    return build_inverse_index(clean_block_idx(block_idx, block_size, q_offset, doc_start), N, 0,
                               None if docs is None else docs.base)


def _programs(index: InverseIndex, per_program: int):
    """(bucket, start, count) per program of the KL's index, which is one query chunk (row 0 of
    `schedule`)."""
    return tuple(x[0] for x in schedule(index, per_program))


def _tables(docs: DocumentBlocks | None, dummy: torch.Tensor):
    """(block starts, block ends, DOCS) of the sparse kernels: the documents' table or unused."""
    return (dummy, dummy, False) if docs is None else (docs.start, docs.end, True)


def _dense_forward(q, k, lse, iq, ik, scale, index_scale, cfg, q_offset, doc_start=None):
    B, T, Hq, D = q.shape
    G, Di = k.shape[2], iq.shape[3]
    H = Hq // G
    kl = torch.empty(B, T, G, dtype=torch.float32, device=q.device)
    lse_z = torch.empty_like(kl)
    inv_s = torch.empty_like(kl)
    diq = torch.empty(B, T, G, Di, dtype=torch.float32, device=q.device)
    strides = _strides(q, k, lse, iq, ik)
    doc = lse_z if doc_start is None else doc_start
    kl_student_lse_kernel[(triton.cdiv(T, cfg.lse_M), B * G)](
        iq, ik, lse_z, doc, T, k.shape[1], q_offset, *strides[9:], index_scale, G=G, M=cfg.lse_M, J=cfg.lse_J, DI=Di,
        PREC=_precision(q, iq), DOCS=doc_start is not None, num_warps=4, num_stages=2)
    HS = _heads_per_dot(H, cfg.dense_M, cfg.dense_rows)
    kl_dense_keys_kernel[(triton.cdiv(T, cfg.dense_M), B * G)](
        q, k, lse, iq, ik, kl, lse_z, inv_s, diq, doc, T, k.shape[1], q_offset, *strides, scale * LOG2E.value,
        index_scale, G=G, H=H, HS=HS, M=cfg.dense_M, J=cfg.dense_fwd_j, D=D, DI=Di, PREC=_precision(q, iq),
        DOCS=doc_start is not None, num_warps=cfg.dense_warps, num_stages=cfg.dense_stages)
    return kl, lse_z, inv_s, diq


def _lse_over_slots(mz, lz):
    """The student's lse_z [B, T, G] from each slot's max z and sum exp(z - max z) [B, T, G, K]."""
    mx = mz.amax(-1)
    mx = torch.where(torch.isinf(mx), torch.zeros_like(mx), mx)
    return mx + torch.log((lz * torch.exp(mz - mx[..., None])).sum(-1))


def _combine(part, B, T, G, K):
    """Reduce the per-slot sums [5, E] to kl, lse_z, 1/s_sum, each fp32 [B, T, G]."""
    mz, lz, s, a, bz = part.view(5, B, T, G, K).unbind(0)
    lse_z = _lse_over_slots(mz, lz)
    s_sum = s.sum(-1)
    s_safe = s_sum.clamp_min(torch.finfo(torch.float32).tiny)
    inv_s = 1.0 / s_safe
    kl = (a.sum(-1) - bz.sum(-1)) * inv_s - torch.log(s_safe) + lse_z
    kl = torch.where(s_sum > 0, kl, torch.zeros_like(kl))
    return kl, lse_z, inv_s


def _sparse_forward(q, k, lse, iq, ik, index, K, block_size, scale, index_scale, cfg, store, q_offset, docs=None):
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
    pbar = torch.empty(E, J, dtype=teacher_dtype(q), device=q.device) if store else None
    tb, ts, tc = _programs(index, cfg.fwd_per_program)
    bstart, bend, docs_on = _tables(docs, index.entry)
    kl_sparse_fwd_kernel[(tb.numel(),)](
        q, k, lse, iq, ik, index.entry, tb, ts, tc, part, part if pbar is None else pbar, bstart, bend, T, k.shape[1],
        q_offset, E, index.n_blocks, *_strides(q, k, lse, iq, ik), scale * LOG2E.value, index_scale,
        BLOCK=block_size, G=G, K=K, H=H, HS=HS, M=cfg.M, J=J, D=D, DI=Di, PREC=_precision(q, iq), STORE=store,
        DOCS=docs_on, TEACHER=True, num_warps=cfg.warps, num_stages=cfg.fwd_stages)
    return (*_combine(part, B, T, G, K), pbar)


def student_lse(iq, ik, index, K, block_size, index_scale, cfg=DEFAULT_TUNING, q_offset=0, docs=None):
    """The student's normaliser lse_z fp32 [B, T, G] on each (t, g)'s support (the sparse
    forward without the teacher: what the forward needs when the teacher comes from the
    attention's backward). iq [B, T, G, Di] and ik [B, TK, Di] contiguous."""
    B, T, G, Di = iq.shape
    _check_dims(Di, Di)
    E = B * T * G * K
    part = torch.zeros(2, E, dtype=torch.float32, device=iq.device)
    part[0].fill_(float("-inf"))
    tb, ts, tc = _programs(index, cfg.fwd_per_program)
    bstart, bend, docs_on = _tables(docs, index.entry)
    # q, k, lse are not read without the teacher: iq, ik stand in
    kl_sparse_fwd_kernel[(tb.numel(),)](
        iq, ik, iq, iq, ik, index.entry, tb, ts, tc, part, part, bstart, bend, T, ik.shape[1], q_offset, E,
        index.n_blocks, *_strides(iq, ik, iq, iq, ik), 1.0, index_scale, BLOCK=block_size, G=G,
        K=K, H=1, HS=1, M=cfg.M, J=triton.next_power_of_2(block_size), D=Di, DI=Di, PREC=_precision(iq, iq),
        STORE=False, DOCS=docs_on, TEACHER=False, num_warps=cfg.warps, num_stages=cfg.fwd_stages)
    return _lse_over_slots(*part.view(2, B, T, G, K).unbind(0))


def teacher_backward(iq, ik, pbar, idx, lse_z, index, K, block_size, index_scale, cfg=DEFAULT_TUNING, q_offset=0,
                     docs=None):
    """The loss and its unscaled gradients from teacher rows written after the forward (by the
    attention's backward): (kl fp32 [B, T, G], d ik fp32 [B, TK, Di], d iq fp32 [B, T, G, Di]).
    pbar [B*T*G*K, J]: the rows of the entries of `index`, i.e. of the slots of the cleaned ids
    idx int32 [B, T, G, K] that are not -1 (the others are not read)."""
    B, T, G, _ = iq.shape
    rows, J = B * T * G, pbar.shape[1]
    sums = torch.empty(2, rows, dtype=torch.float32, device=iq.device)
    kl_teacher_sums_kernel[(triton.cdiv(rows, 16),)](pbar, idx, sums, rows, K=K, J=J, RB=16,
                                                     LB=min(256, triton.next_power_of_2(K * J)), num_warps=4)
    s_sum, a = sums.view(2, B, T, G).unbind(0)
    s_safe = s_sum.clamp_min(torch.finfo(torch.float32).tiny)
    inv_s = 1.0 / s_safe
    dik, diq, bz = _stored_backward(iq, ik, pbar, lse_z, inv_s, index, K, block_size, index_scale, cfg, q_offset,
                                    docs, value=True)
    kl = torch.where(s_sum > 0, (a - bz) * inv_s - torch.log(s_safe) + lse_z, torch.zeros_like(lse_z))
    return kl, dik, diq


def teacher_dtype(q) -> torch.dtype:
    """The dtype of the teacher rows for queries q (fp16, fp32 for fp32 inputs), also of those the
    attention's backward writes for msa_attention(kl_teacher="backward")."""
    return torch.float32 if q.dtype == torch.float32 else torch.float16


def _store_teacher(q, G, K, block_size, cfg, needs_grad: bool, keep: bool | None) -> bool:
    """Whether the forward keeps the teacher rows for the backward. keep=None: when they fit both
    budgets; True: when they fit `teacher_bytes` (the caller recomputes the forward right before
    the backward, so they are short-lived); False: never."""
    B, T = q.shape[:2]
    nbytes = B * T * G * K * triton.next_power_of_2(block_size) * teacher_dtype(q).itemsize
    fits = nbytes <= cfg.teacher_bytes and (keep or nbytes <= cfg.teacher_q_ratio * q.numel() * q.element_size())
    return needs_grad and keep is not False and fits


class _Sums:
    """Where the sparse backward's programs put d ik, d iq (and the late path's bz), and how they
    become [B, TK, Di], [B, T, G, Di] (and [B, T, G]) fp32 sums.

    By default they are added in place with fp32 atomics (the order, and so the last bits, vary
    run to run). Deterministic (torch.use_deterministic_algorithms(True)): each program stores
    its d ik [J, Di] at its program id and its entries' d iq (bz) per entry; `result` then sums a
    bucket's work items in order (`kl_dik_reduce_kernel`, per group, then over groups) and each
    query's slots in order. Memory: E x Di fp32 for d iq (E = B*T*G*K entries: 4.3 GB at 128K
    with the default geometry) and a [J, Di] partial per work item."""

    def __init__(self, iq, ik, index, K, block_size, per_program, value, docs):
        B, T, G, Di = iq.shape
        self.shape = (B, T, G, K, Di)
        self.index, self.per_program, self.block_size, self.docs = index, per_program, block_size, docs
        self.deterministic = torch.are_deterministic_algorithms_enabled()
        f32 = dict(dtype=torch.float32, device=iq.device)
        self.programs = _programs(index, per_program)
        if self.deterministic:
            J = triton.next_power_of_2(block_size)
            self.dik = torch.zeros(self.programs[0].numel(), J, Di, **f32)
            self.diq = torch.zeros(B * T * G * K, Di, **f32)
            self.bz = torch.zeros(B * T * G * K, **f32) if value else None
        else:
            self.dik = torch.zeros(B, ik.shape[1], Di, **f32)
            self.diq = torch.zeros(B, T, G, Di, **f32)
            self.bz = torch.zeros(B, T, G, **f32) if value else None
        self.TK = ik.shape[1]

    def result(self):
        """(d ik, d iq, bz or None)."""
        if not self.deterministic:
            return self.dik, self.diq, self.bz
        B, T, G, K, Di = self.shape
        index = self.index
        runs = (index.count + self.per_program - 1) // self.per_program
        first = (torch.cumsum(runs, 0) - runs).to(torch.int32)
        J = self.dik.shape[1]
        dik_g = torch.zeros(G, B, self.TK, Di, dtype=torch.float32, device=self.dik.device)
        bstart, bend, docs_on = _tables(self.docs, index.entry)
        RB = min(32, J)
        if index.count.numel():
            kl_dik_reduce_kernel[(index.count.numel(), J // RB)](
                self.dik, dik_g, first, runs.to(torch.int32), bstart, bend, B, self.TK, index.n_blocks,
                BLOCK=self.block_size, G=G, J=J, DI=Di, RB=RB, DOCS=docs_on, num_warps=4)
        # slots and groups summed in index order: a fixed order
        diq = self.diq.view(B, T, G, K, Di).sum(3)
        bz = None if self.bz is None else self.bz.view(B, T, G, K).sum(3)
        return dik_g.sum(0), diq, bz


def _stored_backward(iq, ik, pbar, lse_z, inv_s, index, K, block_size, index_scale, cfg, q_offset, docs=None,
                     value=False):
    """Unscaled d ik fp32 [B, TK, Di] and d iq fp32 [B, T, G, Di] from the stored teacher rows;
    with `value` (the late path: rows from the attention's backward) also the loss's bz = sum p z
    fp32 [B, T, G], on the late tiles (else None)."""
    B, T, G, Di = iq.shape
    TK = ik.shape[1]
    sums = _Sums(iq, ik, index, K, block_size, cfg.bwd_per_program, value, docs)
    tb, ts, tc = sums.programs
    bstart, bend, docs_on = _tables(docs, index.entry)
    kl_stored_bwd_kernel[(tb.numel(),)](
        iq, ik, pbar, lse_z, inv_s, index.entry, tb, ts, tc, sums.dik, sums.diq,
        sums.dik if sums.bz is None else sums.bz, bstart, bend, T, TK, q_offset, index.n_blocks, iq.stride(0), iq.stride(1), iq.stride(2), ik.stride(0),
        ik.stride(1), index_scale, BLOCK=block_size, G=G, K=K, M=cfg.late_M if value else cfg.stored_M,
        J=triton.next_power_of_2(block_size), DI=Di, PREC=_precision(iq, iq), DOCS=docs_on, VALUE=value,
        DET=sums.deterministic, num_warps=cfg.late_warps if value else cfg.stored_warps, num_stages=cfg.stored_stages)
    return sums.result()


def _backward(q, k, lse, iq, ik, lse_z, inv_s, index, K, block_size, scale, index_scale, cfg, q_offset,
              doc_start=None, docs=None):
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
        doc, qend = unused, unused
        if doc_start is not None:
            doc = doc_start
            qend = query_ends(doc_start, TK, block)
        kl_bwd_kernel[(N, B * G)](
            q, k, lse, iq, ik, lse_z, inv_s, unused, unused, unused, unused, dik, unused, doc, unused, unused, qend,
            B, T, TK, q_offset, N, *_strides(q, k, lse, iq, ik), scale * LOG2E.value, index_scale, BLOCK=block,
            J=triton.next_power_of_2(block), SPARSE=False, DOCS=doc_start is not None,
            **{**common, "num_stages": cfg.dense_stages})
        return dik.sum(0), None
    sums = _Sums(iq, ik, index, K, block_size, cfg.bwd_per_program, False, docs)
    tb, ts, tc = sums.programs
    bstart, bend, docs_on = _tables(docs, index.entry)
    kl_bwd_kernel[(tb.numel(),)](
        q, k, lse, iq, ik, lse_z, inv_s, index.entry, tb, ts, tc, sums.dik, sums.diq, index.entry, bstart, bend,
        index.entry, B, T, TK, q_offset, index.n_blocks, *_strides(q, k, lse, iq, ik), scale * LOG2E.value,
        index_scale, BLOCK=block_size, J=triton.next_power_of_2(block_size), SPARSE=True, DOCS=docs_on,
        DET=sums.deterministic, **common)
    dik, diq, _ = sums.result()
    return dik, diq


class IndexerKLTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, iq, ik, block_idx, lse, block_size, scale, index_scale, q_offset, tuning, doc_start,
                keep_teacher):
        B, T, Hq, D = q.shape
        G, Di = k.shape[2], iq.shape[3]
        _check_dims(D, Di)
        q, k, iq, ik = (x.contiguous() for x in (q, k, iq, ik))
        lse = lse.float().contiguous()
        cfg = tuning
        index = docs = None
        K = 1
        diq = pbar = None
        if doc_start is not None:
            doc_start = as_int32(doc_start)
        if block_idx is None:
            kl, lse_z, inv_s, diq = _dense_forward(q, k, lse, iq, ik, scale, index_scale, cfg, q_offset, doc_start)
        else:
            K = block_idx.shape[-1]
            if doc_start is not None:
                docs = document_blocks(doc_start, block_size, q_offset)
            index = inverse_index(block_idx, block_size, q_offset, doc_start, docs)
            store = _store_teacher(q, G, K, block_size, cfg, any(ctx.needs_input_grad[2:4]), keep_teacher)
            kl, lse_z, inv_s, pbar = _sparse_forward(q, k, lse, iq, ik, index, K, block_size, scale, index_scale,
                                                     cfg, store, q_offset, docs)
        # with the teacher rows kept, the backward needs neither q, k nor lse
        if pbar is not None:
            q = k = lse = None
        ctx.save_for_backward(q, k, iq, ik, lse, lse_z, inv_s, diq, pbar, doc_start)
        ctx.index, ctx.docs = index, docs
        ctx.args = (K, block_size, scale, index_scale, cfg, q_offset)
        return (kl.sum(dtype=torch.float64) / (B * T * G)).float()

    @staticmethod
    def backward(ctx, grad):
        q, k, iq, ik, lse, lse_z, inv_s, diq, pbar, doc_start = ctx.saved_tensors
        K, block_size, scale, index_scale, cfg, q_offset = ctx.args
        B, T, G = lse_z.shape
        if pbar is not None:
            dik, diq_sparse, _ = _stored_backward(iq, ik, pbar, lse_z, inv_s, ctx.index, K, block_size, index_scale,
                                                  cfg, q_offset, ctx.docs)
        else:
            dik, diq_sparse = _backward(q, k, lse, iq, ik, lse_z, inv_s, ctx.index, K, block_size, scale,
                                        index_scale, cfg, q_offset, doc_start, ctx.docs)
        ctx.index = ctx.docs = None
        diq = diq_sparse if diq is None else diq
        coef = grad.float() * (index_scale / (B * T * G))
        d_iq = (diq * coef).to(iq.dtype) if ctx.needs_input_grad[2] else None
        d_ik = (dik * coef).to(ik.dtype) if ctx.needs_input_grad[3] else None
        return None, None, d_iq, d_ik, None, None, None, None, None, None, None, None, None


def indexer_kl_loss_triton(q: torch.Tensor, k: torch.Tensor, iq: torch.Tensor, ik: torch.Tensor,
                           block_idx: torch.Tensor | None, lse: torch.Tensor, block_size: int, scale: float,
                           index_scale: float, q_offset: int = 0, tuning: Tuning | None = None,
                           doc_start: torch.Tensor | None = None, keep_teacher: bool | None = None) -> torch.Tensor:
    """Fused indexer KL: fp32 scalar, differentiable in iq [B, T, G, Di] and ik [B, TK, Di] only.

    q [B, T, Hq, D] and k [B, TK, G, D] (same dtype), lse fp32 [B, T, Hq] are constants;
    block_idx int [B, T, G, K] (-1 = empty) or None for the dense warmup support. Query t sits
    at position q_offset + t and TK = q_offset + T (the keys of the causal prefix). `tuning`
    (default `DEFAULT_TUNING`) sets tile shapes and the teacher rows' memory budget. doc_start
    int [B, T] (packed documents, as sparse_attention's) costs one host synchronisation in the
    sparse mode, which sizes the documents' block table, unless it carries its host copy.
    `keep_teacher`: the sparse forward's teacher rows for the backward (see `Tuning`).
    """
    if k.shape[1] != q_offset + q.shape[1] or ik.shape[1] != k.shape[1]:
        raise ValueError(f"k and ik must cover q_offset + T = {q_offset + q.shape[1]} tokens, got "
                         f"{k.shape[1]} and {ik.shape[1]}")
    return IndexerKLTriton.apply(q.detach(), k.detach(), iq, ik, block_idx, lse.detach(), block_size,
                                 float(scale), float(index_scale), int(q_offset),
                                 DEFAULT_TUNING if tuning is None else tuning, doc_start, keep_teacher)
