"""sparse_attention: the main branch, exact softmax attention over each group's selected blocks."""

from __future__ import annotations

import torch

from ..common import (PRODUCTION_BLOCK_SIZE, check_block_idx, check_block_size, check_doc_start, check_qkv,
                      default_scale, load_triton, resolve_backend, trim_keys)
from .reference import sparse_attention_reference


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_idx: torch.Tensor | None,
                     block_size: int = PRODUCTION_BLOCK_SIZE, scale: float | None = None,
                     backend: str = "auto", q_offset: int = 0,
                     check_ids: bool = True, doc_start: torch.Tensor | None = None,
                     tuning=None, fp8_probs: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every query head over the key blocks its GQA group selected.

    q: [B, T, Hq, D]; k, v: [B, T, Hkv, D] (same dtype); block_idx: int [B, T, Hkv, K] block ids,
    -1 = empty slot, or None for dense causal attention (indexer warmup). A key j is read by
    query t of group g iff j <= t and block(j) is among block_idx[b, t, g].
    Returns o [B, T, Hq, D] in q's dtype and lse float32 (float64 for float64 inputs) [B, T, Hq], the natural-log
    normaliser over the support (-inf where the support is empty, and then o = 0).
    Differentiable in q, k, v. `scale` defaults to 1/sqrt(D).
    `q_offset`: query t sits at position q_offset + t; k, v [B, >= q_offset + T, Hkv, D] hold
    the whole causal prefix (context parallelism); dk, dv cover it.
    `doc_start`: int [B, T], the first position of each query's document (packed documents;
    None: one per row). Query t then reads keys doc_start[t] .. q_offset + t only, and block_idx
    holds document-relative ids (block n = keys doc_start[t] + n*block_size ..), as select_blocks
    gives them with the same doc_start.
    `check_ids=False` skips the range checks of block_idx's and doc_start's values, which
    synchronise with the device; select_blocks' output is always in range.
    `tuning`: the Triton kernels' launch shapes (`sparse_attention.tuning.Tuning`; None: defaults).
    `fp8_probs` (MiniMax's probability quantization-aware training): the output o is computed from
    the probabilities stored as float8 e4m3 of P x 448, P taken relative to the query's max over
    each key block and rescaled after, as a kernel with fp8 P @ V computes it; lse is the exact
    one, and the gradients pass straight through the rounding (dv from the rounded probabilities,
    dq and dk from the exact softmax). Sparse only (block_idx given).
    """
    check_block_size(block_size)
    B, T, _, Hkv, D = check_qkv(q, k, v, q_offset)
    if block_idx is not None:
        check_block_idx(block_idx, B, T, Hkv, block_size, q_offset, ids=check_ids)
    check_doc_start(doc_start, B, T, q_offset, values=check_ids, device=q.device)
    if fp8_probs and block_idx is None:
        raise ValueError("fp8_probs applies to the sparse attention (block_idx given), not to dense attention")
    scale = default_scale(D, scale)
    k, v = trim_keys(T, q_offset, k, v)
    # the fused kernels take fp16/bf16 on GPUs; "auto" keeps fp32 inputs on the exact reference
    auto_fp32 = backend == "auto" and q.dtype not in (torch.float16, torch.bfloat16) and q.is_cuda
    if not auto_fp32 and resolve_backend(backend, q, k, v) == "triton":
        return load_triton("sparse_attention").sparse_attention_triton(q, k, v, block_idx, block_size, scale,
                                                                       q_offset, tuning, doc_start, fp8_probs)
    return sparse_attention_reference(q, k, v, block_idx, block_size, scale, q_offset=q_offset, doc_start=doc_start,
                                      fp8_probs=fp8_probs)


__all__ = ["sparse_attention", "sparse_attention_reference"]
