"""Readable PyTorch reference of the KL alignment loss that trains the index branch.

teacher p_bar[t,g,:] = mean over the heads of group g of the main branch's softmax on the
support S[t,g] (rebuilt from q, k and the forward's lse; renormalised on S; no gradient).
student p_I[t,g,:] = softmax over S[t,g] of (iq[t,g] . ik[j]) * index_scale.
loss = mean over (b, t, g) of KL(p_bar || p_I). Its gradient w.r.t. the student logits
(iq . ik) is (p_I - p_bar) * index_scale / count, so only iq and ik receive gradients.

B = batch, T = tokens, C = queries in a chunk, G = groups, H = heads per group, D = head dim,
Di = index head dim, J = keys of the chunk's causal range.
"""

from __future__ import annotations

import torch

from ..common import query_chunk
from ..support import support_mask


def _teacher_student(q, k, iq, ik, block_idx, lse, block_size, scale, index_scale, t0, t1, q_offset, doc_start):
    """Teacher p_bar (fp32, fp64 for fp64 inputs), student log p_I and the support mask for queries t0..t1-1."""
    B, T, Hq, D = q.shape
    G = k.shape[2]
    H = Hq // G
    acc = torch.promote_types(q.dtype, torch.float32)
    e = q_offset + t1
    mask_BCGJ = support_mask(block_idx, t0, t1, e, block_size, G, B, q.device, q_offset, doc_start)
    q_BCGHD = q[:, t0:t1].to(acc).view(B, t1 - t0, G, H, D)
    s = torch.einsum("bcghd,bjgd->bcghj", q_BCGHD, k[:, :e].to(acc)) * scale
    s = s.masked_fill(~mask_BCGJ[:, :, :, None, :], float("-inf"))
    lse_BCGH = lse[:, t0:t1].to(acc).view(B, t1 - t0, G, H)
    lse_BCGH = torch.where(torch.isinf(lse_BCGH), torch.zeros_like(lse_BCGH), lse_BCGH)
    p_bar = torch.exp(s - lse_BCGH[..., None]).mean(dim=3)
    p_bar = p_bar / p_bar.sum(-1, keepdim=True).clamp_min(torch.finfo(acc).tiny)
    z = torch.einsum("bcgi,bji->bcgj", iq[:, t0:t1].to(acc), ik[:, :e].to(acc)) * index_scale
    log_p_student = torch.log_softmax(z.masked_fill(~mask_BCGJ, float("-inf")), dim=-1)
    return p_bar, log_p_student, mask_BCGJ


def _chunks(T, heads, q_offset=0):
    step = query_chunk(q_offset + T, heads)
    for t0 in range(0, T, step):
        yield t0, min(T, t0 + step)


def indexer_kl_forward(q, k, iq, ik, block_idx, lse, block_size, scale, index_scale, q_offset=0, doc_start=None):
    """Scalar mean KL (fp32; fp64 for fp64 index inputs)(teacher || student) over (b, t, g).
    Query t sits at position q_offset + t of the keys k, ik; doc_start (int [B, T] or None)
    keeps each query's support in its document."""
    B, T, Hq, _ = q.shape
    G = k.shape[2]
    total = torch.zeros((), dtype=torch.float64, device=q.device)
    for t0, t1 in _chunks(T, Hq, q_offset):
        p_bar, log_p_student, mask = _teacher_student(q, k, iq, ik, block_idx, lse, block_size, scale,
                                                      index_scale, t0, t1, q_offset, doc_start)
        terms = torch.xlogy(p_bar, p_bar) - p_bar * log_p_student
        total += torch.where(mask, terms, torch.zeros_like(terms)).sum(dtype=torch.float64)
    return (total / (B * T * G)).to(torch.promote_types(iq.dtype, torch.float32))


def indexer_kl_backward(grad, q, k, iq, ik, block_idx, lse, block_size, scale, index_scale, q_offset=0,
                        doc_start=None):
    """(d iq, d ik) of `indexer_kl_forward` scaled by the upstream scalar `grad`."""
    B, T, Hq, _ = q.shape
    G = k.shape[2]
    acc = torch.promote_types(iq.dtype, torch.float32)
    diq = torch.empty(iq.shape, dtype=acc, device=iq.device)
    dik = torch.zeros(ik.shape, dtype=acc, device=ik.device)
    coef = grad.to(acc) * index_scale / (B * T * G)
    for t0, t1 in _chunks(T, Hq, q_offset):
        p_bar, log_p_student, mask = _teacher_student(q, k, iq, ik, block_idx, lse, block_size, scale,
                                                      index_scale, t0, t1, q_offset, doc_start)
        dz = torch.where(mask, log_p_student.exp() - p_bar, torch.zeros_like(p_bar)) * coef
        e = q_offset + t1
        diq[:, t0:t1] = torch.einsum("bcgj,bji->bcgi", dz, ik[:, :e].to(acc))
        dik[:, :e] += torch.einsum("bcgj,bcgi->bji", dz, iq[:, t0:t1].to(acc))
    return diq.to(iq.dtype), dik.to(ik.dtype)


class IndexerKLReference(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, iq, ik, block_idx, lse, block_size, scale, index_scale, q_offset, doc_start):
        ctx.save_for_backward(q, k, iq, ik, block_idx, lse, doc_start)
        ctx.args = (block_size, scale, index_scale, q_offset)
        return indexer_kl_forward(q, k, iq, ik, block_idx, lse, block_size, scale, index_scale, q_offset, doc_start)

    @staticmethod
    def backward(ctx, grad):
        q, k, iq, ik, block_idx, lse, doc_start = ctx.saved_tensors
        diq, dik = indexer_kl_backward(grad, q, k, iq, ik, block_idx, lse, *ctx.args, doc_start=doc_start)
        return None, None, diq, dik, None, None, None, None, None, None, None


def indexer_kl_loss_reference(q, k, iq, ik, block_idx, lse, block_size, scale, index_scale, q_offset=0,
                              doc_start=None):
    return IndexerKLReference.apply(q.detach(), k.detach(), iq, ik, block_idx, lse.detach(), block_size,
                                    scale, index_scale, q_offset, doc_start)
