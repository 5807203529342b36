"""Sparse attention and the indexer KL with the KL's teacher taken from the attention's backward.

The KL's teacher, p[j] = mean over the group's heads of exp(q_h . k_j * scale - lse_h), is the
attention's own probabilities P averaged over heads. The attention's backward recomputes P with
the final lse anyway, so there the teacher costs one small product per tile; computing it in the
forward instead costs q . k over every head of the support again (a third of the layer's
forward at the default geometry, bench/RESULTS.md round 7). So this path's forward runs the
attention and only the student's normaliser lse_z; its backward runs the attention's backward,
which writes each entry's teacher row, and then the KL's backward on those rows, which also
gives the loss's value.

The price: the KL's value is known only once the backward has run. The returned scalar holds
NaN until then and is filled in place by the backward; `on_kl(value)` is called there too
(msa_model.attention records the metric that way). The gradients are the forward path's,
up to rounding: the rows average the same P (rounded to bf16 first here, to fp16 there).
Memory: the teacher rows (B*T*G*K*block_size fp16, 2 GiB at 128K with the default geometry)
live during the backward only; only the rows of selected slots are written and read.
"""

from __future__ import annotations

import torch

from .indexer_kl import triton as kl_triton
from .sparse_attention import triton as sa_triton


def teacher_bytes(q: torch.Tensor, n_groups: int, topk: int, block_size: int) -> int:
    """Bytes of the teacher rows the backward allocates."""
    B, T = q.shape[:2]
    return B * T * n_groups * topk * block_size * (4 if q.dtype == torch.float32 else 2)


class LateTeacherMSA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, iq, ik, block_idx, block_size, scale, index_scale, q_offset, sa_tuning, kl_tuning,
                doc_start, on_kl):
        q, k, v, iq, ik = (x.contiguous() for x in (q, k, v, iq, ik))
        o, lse, state = sa_triton.attention_forward(q, k, v, block_idx, block_size, scale, q_offset, sa_tuning,
                                                    doc_start)
        K = block_idx.shape[-1]
        index = kl_triton.inverse_index(state.idx, block_size, q_offset, state.doc_start, state.docs)
        lse_z = kl_triton.student_lse(iq, ik, index, K, block_size, index_scale, kl_tuning, q_offset, state.docs)
        kl = torch.full((), float("nan"), dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, o, lse, iq, ik, lse_z, state.idx, state.doc_start)
        state.idx = state.doc_start = None
        # detached: the backward writes the value through it without holding the output's node
        ctx.kl_sink, ctx.on_kl = kl.detach(), on_kl
        ctx.state, ctx.index = state, index
        ctx.args = (block_size, scale, index_scale, q_offset, sa_tuning, kl_tuning)
        ctx.mark_non_differentiable(lse)
        return o, lse, kl

    @staticmethod
    def backward(ctx, do, _dlse, dkl):
        q, k, v, o, lse, iq, ik, lse_z, idx, doc_start = ctx.saved_tensors
        block_size, scale, index_scale, q_offset, sa_tuning, kl_tuning = ctx.args
        state, index = ctx.state, ctx.index
        ctx.state = ctx.index = None
        state.idx, state.doc_start = idx, doc_start
        B, T, G, K = idx.shape
        # only the rows of selected slots are written, and only they are read
        pbar = torch.empty(B * T * G * K, block_size, dtype=kl_triton._teacher_dtype(q), device=q.device)
        dq, dk, dv = sa_triton.attention_backward(do, q, k, v, o, lse, state, block_size, scale, q_offset, sa_tuning,
                                                  teacher=pbar)
        kl_BTG, dik, diq = kl_triton.teacher_backward(iq, ik, pbar, idx, lse_z, index, K, block_size, index_scale,
                                                      kl_tuning, q_offset, state.docs)
        del pbar
        value = (kl_BTG.sum(dtype=torch.float64) / (B * T * G)).float()
        ctx.kl_sink.copy_(value)
        if ctx.on_kl is not None:
            ctx.on_kl(value)
        coef = dkl.float() * (index_scale / (B * T * G))
        d_iq = (diq * coef).to(iq.dtype) if ctx.needs_input_grad[3] else None
        d_ik = (dik * coef).to(ik.dtype) if ctx.needs_input_grad[4] else None
        return dq, dk, dv, d_iq, d_ik, None, None, None, None, None, None, None, None, None


def msa_late_teacher(q, k, v, iq, ik, block_idx, block_size, scale, index_scale, q_offset=0, sa_tuning=None,
                     kl_tuning=None, doc_start=None, on_kl=None):
    """(o, lse, kl) as sparse_attention + indexer_kl_loss give them (Triton, sparse), with kl's
    value NaN until the backward fills it in (and calls `on_kl(value)`). Inputs as
    msa_attention's after its checks: keys cut to q_offset + T, block_idx in range."""
    return LateTeacherMSA.apply(q, k, v, iq, ik, block_idx, block_size, float(scale), float(index_scale),
                                int(q_offset), sa_tuning or sa_triton.DEFAULT_TUNING,
                                kl_tuning or kl_triton.DEFAULT_TUNING, doc_start, on_kl)
