"""indexer_kl_loss: the KL alignment loss that trains the index projections."""

from __future__ import annotations

import torch

from ..common import (PRODUCTION_BLOCK_SIZE, check_block_idx, check_block_size, check_doc_start, check_index, check_qkv,
                      check_temperature, default_scale, load_triton, resolve_backend, trim_keys)
from .reference import indexer_kl_loss_reference


def indexer_kl_loss(q: torch.Tensor, k: torch.Tensor, iq: torch.Tensor, ik: torch.Tensor,
                    block_idx: torch.Tensor | None, lse: torch.Tensor, block_size: int = PRODUCTION_BLOCK_SIZE,
                    scale: float | None = None, index_scale: float | None = None,
                    backend: str = "auto", q_offset: int = 0, check_ids: bool = True,
                    doc_start: torch.Tensor | None = None, tuning=None,
                    keep_teacher: bool | None = None, temperature: float = 1.0) -> torch.Tensor:
    """Mean over (b, t, g) of KL(teacher || student) on each (query, group)'s support.

    q [B, T, Hq, D], k [B, T, Hkv, D]: the main branch's inputs (treated as constants);
    iq [B, T, Hkv, Di], ik [B, T, Di]: the index branch (the only inputs that get gradients);
    block_idx int [B, T, Hkv, K] or None (dense warmup: support = all causal keys);
    lse float32 [B, T, Hq] from `sparse_attention` with the same block_idx (treated as constant).
    `scale` (default 1/sqrt(D)) is the main branch's, `index_scale` (default 1/sqrt(Di)) the
    student's. Returns a float32 scalar (float64 for float64 index inputs); the KL coefficient is applied by the caller.
    `q_offset`: query t sits at position q_offset + t; k, ik hold the whole causal prefix
    [B, >= q_offset + T, ...] (context parallelism); the mean is over this call's queries.
    `doc_start`: int [B, T] first position of each query's document (None: one per row), the
    same as sparse_attention's; the support then stays in the document and block ids are
    document-relative. The mean is still over every (b, t, g).
    `check_ids=False` skips the range checks of block_idx's and doc_start's values (host
    synchronisations).
    `tuning`: the Triton kernels' tile shapes and memory budget (`indexer_kl.tuning.Tuning`; None: defaults).
    `keep_teacher` (Triton, sparse): keep the teacher rows from forward to backward; None: when
    they are no larger than q (a memory policy), True: whenever they fit the kernel's budget
    (for callers that rerun the forward just before the backward), False: recompute them.
    `temperature` (MiniMax's `lse_temperature`): the student is softmax(iq.ik * index_scale /
    temperature) on the support; the gradient in the logits iq.ik is then (p_student -
    p_teacher) * index_scale / temperature / (B*T*Hkv). It rescales the student's distribution
    only: the teacher, and the block selection (a ranking), do not depend on it.
    """
    check_block_size(block_size)
    B, T, Hq, Hkv, D = check_qkv(q, k, q_offset=q_offset)
    _, _, _, Di = check_index(iq, ik, B, T, Hkv, q_offset)
    if block_idx is not None:
        check_block_idx(block_idx, B, T, Hkv, block_size, q_offset, ids=check_ids)
    check_doc_start(doc_start, B, T, q_offset, values=check_ids, device=q.device)
    if not lse.is_floating_point():
        raise TypeError(f"lse must be a floating tensor (float32 from sparse_attention), got {lse.dtype}")
    if lse.shape != (B, T, Hq):
        raise ValueError(f"lse must be [B, T, Hq] = {(B, T, Hq)}, got {tuple(lse.shape)}")
    scale = default_scale(D, scale)
    index_scale = default_scale(Di, index_scale) / check_temperature(temperature)
    k, ik = trim_keys(T, q_offset, k, ik)
    if resolve_backend(backend, q, k, iq, ik) == "triton":
        return load_triton("indexer_kl").indexer_kl_loss_triton(q, k, iq, ik, block_idx, lse, block_size,
                                                                 scale, index_scale, q_offset, tuning, doc_start,
                                                                 keep_teacher)
    return indexer_kl_loss_reference(q, k, iq, ik, block_idx, lse, block_size, scale, index_scale, q_offset,
                                     doc_start)


__all__ = ["indexer_kl_loss", "indexer_kl_loss_reference"]
