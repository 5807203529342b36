"""Readable PyTorch reference of the main branch: exact softmax attention over the selected blocks.

Memory-bounded: queries are processed in chunks, so no [T, T] tensor ever exists, and the
backward recomputes probabilities chunk by chunk from the saved log-sum-exp (as flash attention
does) instead of keeping them.

B = batch, T = tokens, C = queries in a chunk, G = groups (Hkv), H = heads per group, D = head
dim, J = keys of the chunk's causal range, K = top-k blocks.
"""

from __future__ import annotations

import torch

from ..common import query_chunk
from ..support import support_mask


def _chunks(T: int, heads: int, q_offset: int = 0):
    step = query_chunk(q_offset + T, heads)
    for t0 in range(0, T, step):
        yield t0, min(T, t0 + step)


def _scores(q_BCGHD, k_BJGD, mask_BCGJ, scale, cdt):
    """Scaled logits [B, C, G, H, J] (fp32, fp64 for fp64 inputs), -inf off the support; the
    matmul runs in `cdt`."""
    acc = torch.promote_types(cdt, torch.float32)
    s = torch.einsum("bcghd,bjgd->bcghj", q_BCGHD.to(cdt), k_BJGD.to(cdt)).to(acc) * scale
    return s.masked_fill(~mask_BCGJ[:, :, :, None, :], float("-inf"))


def _exp_minus(s, lse):
    """exp(s - lse), where an empty support (lse = -inf, every s = -inf) gives zeros, not NaN."""
    return torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])


def sparse_attention_forward(q, k, v, block_idx, block_size, scale, upcast=True, q_offset=0, doc_start=None):
    """Returns o [B,T,Hq,D] (q.dtype) and lse [B,T,Hq] (fp32; fp64 for fp64 inputs).

    Query t sits at position q_offset + t; k, v hold at least q_offset + T keys; doc_start
    (int [B, T] or None) restricts each query to its document (see `support_mask`)."""
    B, T, Hq, D = q.shape
    G = k.shape[2]
    H = Hq // G
    acc = torch.promote_types(q.dtype, torch.float32)
    cdt = acc if upcast else q.dtype
    o = torch.empty_like(q)
    lse = torch.empty(B, T, Hq, dtype=acc, device=q.device)
    q5 = q.view(B, T, G, H, D)
    for t0, t1 in _chunks(T, Hq, q_offset):
        e = q_offset + t1
        mask = support_mask(block_idx, t0, t1, e, block_size, G, B, q.device, q_offset, doc_start)
        s = _scores(q5[:, t0:t1], k[:, :e], mask, scale, cdt)
        lse_c = torch.logsumexp(s, dim=-1)
        p = _exp_minus(s, lse_c)
        o_c = torch.einsum("bcghj,bjgd->bcghd", p.to(cdt), v[:, :e].to(cdt))
        o[:, t0:t1] = o_c.reshape(B, t1 - t0, Hq, D).to(q.dtype)
        lse[:, t0:t1] = lse_c.reshape(B, t1 - t0, Hq)
    return o, lse


def sparse_attention_backward(do, q, k, v, o, lse, block_idx, block_size, scale, upcast=True, q_offset=0,
                              doc_start=None):
    """Gradients (dq, dk, dv) of `sparse_attention_forward`, recomputing probabilities per chunk."""
    B, T, Hq, D = q.shape
    G = k.shape[2]
    H = Hq // G
    acc = torch.promote_types(q.dtype, torch.float32)
    cdt = acc if upcast else q.dtype
    dq = torch.empty_like(q)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    q5, do5 = q.view(B, T, G, H, D), do.view(B, T, G, H, D)
    # delta = rowsum(dO * O): the softmax backward's correction term, per query head
    delta = (do.to(acc) * o.to(acc)).sum(-1).view(B, T, G, H)
    lse5 = lse.view(B, T, G, H)
    for t0, t1 in _chunks(T, Hq, q_offset):
        e = q_offset + t1
        mask = support_mask(block_idx, t0, t1, e, block_size, G, B, q.device, q_offset, doc_start)
        p = _exp_minus(_scores(q5[:, t0:t1], k[:, :e], mask, scale, cdt), lse5[:, t0:t1])
        do_c = do5[:, t0:t1].to(cdt)
        dp = torch.einsum("bcghd,bjgd->bcghj", do_c, v[:, :e].to(cdt)).to(acc)
        ds = p * (dp - delta[:, t0:t1, ..., None])
        dq_c = torch.einsum("bcghj,bjgd->bcghd", ds.to(cdt), k[:, :e].to(cdt)).to(acc) * scale
        dq[:, t0:t1] = dq_c.reshape(B, t1 - t0, Hq, D).to(q.dtype)
        dk[:, :e] += torch.einsum("bcghj,bcghd->bjgd", ds.to(cdt), q5[:, t0:t1].to(cdt)).to(acc) * scale
        dv[:, :e] += torch.einsum("bcghj,bcghd->bjgd", p.to(cdt), do_c).to(acc)
    return dq, dk.to(k.dtype), dv.to(v.dtype)


class SparseAttentionReference(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, block_idx, block_size, scale, upcast, q_offset, doc_start):
        o, lse = sparse_attention_forward(q, k, v, block_idx, block_size, scale, upcast, q_offset, doc_start)
        ctx.save_for_backward(q, k, v, o, lse, block_idx, doc_start)
        ctx.args = (block_size, scale, upcast, q_offset)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse, block_idx, doc_start = ctx.saved_tensors
        dq, dk, dv = sparse_attention_backward(do.contiguous(), q, k, v, o, lse, block_idx, *ctx.args,
                                               doc_start=doc_start)
        return dq, dk, dv, None, None, None, None, None, None


def sparse_attention_reference(q, k, v, block_idx, block_size, scale, upcast=True, q_offset=0, doc_start=None):
    """Autograd entry of the reference. `upcast=False` does the matmuls in the input dtype, as
    plain PyTorch code in bf16 would (the yardstick for kernel error budgets). Query t sits at
    position q_offset + t of the keys; doc_start int [B, T] keeps each query in its document."""
    return SparseAttentionReference.apply(q, k, v, block_idx, block_size, scale, upcast, q_offset, doc_start)
