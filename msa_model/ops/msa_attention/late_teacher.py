"""Sparse attention and the indexer KL with the KL's teacher taken from the attention's backward.

The KL's teacher, p[j] = mean over the group's heads of exp(q_h . k_j * scale - lse_h), is the
attention's own probabilities P averaged over heads. The attention's backward recomputes P with
the final lse anyway, so there the teacher costs one small product per tile; computing it in the
forward instead costs q . k over every head of the support again (a third of the layer's
forward at the default geometry). So this path's forward runs the
attention and only the student's normaliser lse_z; its backward runs the attention's backward,
which writes each entry's teacher row, and then the KL's backward on those rows, which also
gives the loss's value.

The price: the KL's value is known only once the backward has run. The returned scalar holds
NaN until then and is filled in place by the backward; `on_kl(value)` is called there too
(msa_model.model.attention records the metric that way). The gradients are the forward path's,
up to rounding: the rows average the same P (rounded to bf16 first here, to fp16 there).
Memory: the teacher rows (B*T*G*K*block_size fp16, 2 GiB at 128K with the default geometry)
live during the backward only; only the rows of selected slots are written and read. A call
whose rows would pass the KL tuning's `teacher_bytes` runs as query chunks whose rows fit: each
chunk is the same call for a run of queries (a larger query offset, as context parallelism
splits a sequence) against the keys up to its last query, in one autograd node, so the
backward holds one chunk's rows at a time; the KL sums every chunk's rows before its value is
filled in.
"""

from __future__ import annotations

import torch

from ..common import as_int32, doc_rows
from ..indexer_kl import triton as kl_triton
from ..sparse_attention import triton as sa_triton
from ..sparse_attention.shared import equal_chunks


def teacher_bytes(q: torch.Tensor, n_groups: int, topk: int, block_size: int, queries: int | None = None) -> int:
    """Bytes of the teacher rows the backward allocates for `queries` queries (None: all of q's)."""
    B, T = q.shape[:2]
    T = T if queries is None else queries
    return B * T * n_groups * topk * block_size * (4 if q.dtype == torch.float32 else 2)


def query_chunk(q: torch.Tensor, n_groups: int, topk: int, block_size: int, budget: int) -> int:
    """Queries per late-teacher call whose rows fit `budget` bytes, the chunks of about equal
    size (0: not even one query's rows fit)."""
    one = teacher_bytes(q, n_groups, topk, block_size, 1)
    return 0 if one > budget else equal_chunks(q.shape[1], one, budget)


def _rows(x, t0, t1):
    """x[:, t0:t1] contiguous (a view for batch 1), or None."""
    return None if x is None else x[:, t0:t1].contiguous()


def _views(*xs):
    """The views xs when all are contiguous (batch 1: the kernels write into them), else None."""
    return xs if all(x.is_contiguous() for x in xs) else None


class LateTeacherMSA(torch.autograd.Function):
    """The forward and backward of both ops over query chunks `bounds` [(t0, t1), ...]: each chunk
    is the call for queries t0 .. t1 - 1 (offset q_offset + t0) against keys up to q_offset + t1,
    so the teacher rows of one chunk at a time exist in the backward."""

    @staticmethod
    def forward(ctx, q, k, v, iq, ik, block_idx, block_size, scale, index_scale, q_offset, sa_tuning, kl_tuning,
                doc_start, on_kl, bounds, fp8):
        q, k, v, iq, ik = (x.contiguous() for x in (q, k, v, iq, ik))
        B, T, G, K = block_idx.shape
        if doc_start is not None:
            doc_start = as_int32(doc_start)
        whole = len(bounds) == 1
        if not whole:
            o, lse = torch.empty_like(q), torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
            idx = torch.empty(B, T, G, K, dtype=torch.int32, device=q.device)
            lse_z = torch.empty(B, T, G, dtype=torch.float32, device=q.device)
        chunks = []
        for t0, t1 in bounds:
            keys, off = q_offset + t1, q_offset + t0
            q_c, k_c = _rows(q, t0, t1), k[:, :keys].contiguous()
            out = None if whole else _views(o[:, t0:t1], lse[:, t0:t1])
            o_c, lse_c, state = sa_triton.attention_forward(q_c, k_c, v[:, :keys].contiguous(), block_idx[:, t0:t1],
                                                            block_size, scale, off, sa_tuning,
                                                            as_int32(doc_rows(doc_start, t0, t1)), out, fp8=fp8)
            # one inverse index for both ops: the KL walks the attention's, unchunked
            index = sa_triton.gather_index(q_c, k_c, state, block_size, sa_tuning).whole()
            lse_z_c = kl_triton.student_lse(_rows(iq, t0, t1), ik[:, :keys].contiguous(), index, K, block_size,
                                            index_scale, kl_tuning, off, state.docs)
            if whole:
                o, lse, idx, lse_z = o_c, lse_c, state.idx, lse_z_c
            else:
                idx[:, t0:t1], lse_z[:, t0:t1] = state.idx, lse_z_c
                if out is None:
                    o[:, t0:t1], lse[:, t0:t1] = o_c, lse_c
            state.idx = state.doc_start = None
            chunks.append((t0, t1, state, index))
        kl = torch.full((), float("nan"), dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, o, lse, iq, ik, lse_z, idx, doc_start)
        # detached: the backward writes the value through it without holding the output's node
        ctx.kl_sink, ctx.on_kl = kl.detach(), on_kl
        ctx.chunks = chunks
        ctx.args = (block_size, scale, index_scale, q_offset, sa_tuning, kl_tuning)
        ctx.mark_non_differentiable(lse)
        return o, lse, kl

    @staticmethod
    def backward(ctx, do, _dlse, dkl):
        q, k, v, o, lse, iq, ik, lse_z, idx, doc_start = ctx.saved_tensors
        block_size, scale, index_scale, q_offset, sa_tuning, kl_tuning = ctx.args
        chunks, ctx.chunks = ctx.chunks, None
        B, T, G, K = idx.shape
        whole = len(chunks) == 1
        if not whole:
            f32 = dict(dtype=torch.float32, device=q.device)
            dq = torch.empty_like(q)
            dk, dv, dik = torch.zeros(k.shape, **f32), torch.zeros(v.shape, **f32), torch.zeros(ik.shape, **f32)
            diq = torch.empty(iq.shape, **f32)
        total = torch.zeros((), dtype=torch.float64, device=q.device)
        while chunks:
            # a chunk's index and ids go once its backward has run
            t0, t1, state, index = chunks.pop(0)
            keys, off = q_offset + t1, q_offset + t0
            state.idx, state.doc_start = _rows(idx, t0, t1), as_int32(doc_rows(doc_start, t0, t1))
            q_c, k_c, ik_c = _rows(q, t0, t1), k[:, :keys].contiguous(), ik[:, :keys].contiguous()
            # only the rows of selected slots are written, and only they are read
            pbar = torch.empty(B * (t1 - t0) * G * K, block_size, dtype=kl_triton.teacher_dtype(q), device=q.device)
            # with batch 1 the chunk's dq and its keys' dk, dv accumulate in place; else in
            # buffers of the chunk's own (dk, dv in fp32, so no chunk's share is rounded twice)
            views = None if whole else _views(dq[:, t0:t1], dk[:, :keys], dv[:, :keys])
            out = views
            if not whole and views is None:
                out = (torch.empty_like(q_c), torch.zeros(k_c.shape, **f32), torch.zeros(k_c.shape, **f32))
            grads = sa_triton.attention_backward(_rows(do, t0, t1), q_c, k_c, v[:, :keys].contiguous(),
                                                 _rows(o, t0, t1), _rows(lse, t0, t1), state, block_size, scale, off,
                                                 sa_tuning, teacher=pbar, out=out)
            kl_BTG, dik_c, diq_c = kl_triton.teacher_backward(_rows(iq, t0, t1), ik_c, pbar, state.idx,
                                                              _rows(lse_z, t0, t1), index, K, block_size,
                                                              index_scale, kl_tuning, off, state.docs)
            del pbar, state, index
            total += kl_BTG.sum(dtype=torch.float64)
            if whole:
                (dq, dk, dv), dik, diq = grads, dik_c, diq_c
            else:
                if views is None:
                    dq[:, t0:t1] = grads[0]
                    dk[:, :keys] += grads[1]
                    dv[:, :keys] += grads[2]
                dik[:, :keys] += dik_c
                diq[:, t0:t1] = diq_c
        value = (total / (B * T * G)).float()
        ctx.kl_sink.copy_(value)
        if ctx.on_kl is not None:
            ctx.on_kl(value)
        coef = dkl.float() * (index_scale / (B * T * G))
        d_iq = (diq * coef).to(iq.dtype) if ctx.needs_input_grad[3] else None
        d_ik = (dik * coef).to(ik.dtype) if ctx.needs_input_grad[4] else None
        return dq, dk.to(k.dtype), dv.to(v.dtype), d_iq, d_ik, *([None] * 11)


def msa_late_teacher(q, k, v, iq, ik, block_idx, block_size, scale, index_scale, q_offset=0, sa_tuning=None,
                     kl_tuning=None, doc_start=None, on_kl=None, fp8_probs=False):
    """(o, lse, kl) as sparse_attention + indexer_kl_loss give them (Triton, sparse), with kl's
    value NaN until the backward fills it in (and calls `on_kl(value)`). Inputs as
    msa_attention's after its checks: keys cut to q_offset + T, block_idx in range. Calls whose
    teacher rows pass the KL tuning's `teacher_bytes` run as query chunks that fit. fp8_probs:
    the attention's (sparse_attention's); the teacher rows stay the exact softmax's."""
    sa_tuning = sa_tuning or sa_triton.DEFAULT_TUNING
    kl_tuning = kl_tuning or kl_triton.DEFAULT_TUNING
    G, K = block_idx.shape[2:]
    T = q.shape[1]
    chunk = query_chunk(q, G, K, block_size, kl_tuning.teacher_bytes)
    if chunk == 0:
        raise ValueError(f"the KL's teacher_bytes ({kl_tuning.teacher_bytes}) hold no query's teacher rows")
    bounds = [(t0, min(T, t0 + chunk)) for t0 in range(0, T, chunk)]
    return LateTeacherMSA.apply(q, k, v, iq, ik, block_idx, block_size, float(scale), float(index_scale),
                                int(q_offset), sa_tuning, kl_tuning, doc_start, on_kl, bounds, bool(fp8_probs))
