"""Fused Triton path of sparse_attention: the choice of execution path and the autograd Function.

B = batch, T = queries, TK = keys (query t at position q_offset + t), G = key/value heads
(groups), H = query heads per group, K = top-k slots, D = head dim.

The paths, each with its kernels and launchers in a file of its own: dense causal attention for
block_idx None (dense.py); the gather path, KV-outer over the inverse block -> queries index
(gather.py); the tile path, query-outer over each query tile's union of blocks (tiles.py); and the
hybrid forward, which takes each tile on the path that suits its union (hybrid.py). What they
share (the memory budget and query chunks, the index of a call) is in shared.py, the index itself
in inverse_index.py, the launch settings (`Tuning`) in tuning.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..common import as_int32
from ..triton_utils import interpreting
from .dense import dense_backward, dense_forward
from .gather import sparse_backward, sparse_forward
from .hybrid import hybrid_forward
from .inverse_index import DocumentBlocks, InverseIndex, clean_block_idx, document_blocks
from .reference import TileUnion
from .shared import index_of_every_entry
from .tiles import tile_backward, tile_forward, tile_queries, tile_union
from .tuning import DEFAULT_TUNING, Tuning

__all__ = ["Tuning", "DEFAULT_TUNING", "ForwardState", "takes_tiles", "takes_tile_backward", "attention_forward",
           "gather_index", "attention_backward", "SparseAttentionTriton", "sparse_attention_triton"]


@dataclass
class ForwardState:
    """What the backward needs besides q, k, v, o, lse: the cleaned ids (None: dense), the packed
    documents' start and block table, and the path's index (gather) or tile unions (tile backward)."""

    idx: torch.Tensor | None
    doc_start: torch.Tensor | None
    docs: DocumentBlocks | None = None
    index: InverseIndex | None = None
    union: TileUnion | None = None
    fp8: bool = False


def takes_tiles(tuning: Tuning, T: int, H: int) -> bool:
    """Whether a sparse call of T queries with H heads a group takes the tile (or hybrid) forward."""
    return bool(tuning.tile_rows) and H >= tuning.tile_min_heads and T >= tuning.tile_min_queries


def takes_tile_backward(tuning: Tuning, T: int, H: int, D: int) -> bool:
    """Whether such a call takes the tile backward too (`Tuning.tile_backward`): not for heads
    wider than 128, where its dK/dV kernel, which keeps a block's keys, values and fp32
    accumulators beside a tile's queries and output gradients, passes shared memory (262 of 227
    KiB on an H200 at D = 256), so the gather backward runs (the same result)."""
    return tuning.tile_backward and D <= 128 and takes_tiles(tuning, T, H)


def attention_forward(q, k, v, block_idx, block_size, scale, q_offset, tuning: Tuning, doc_start, out=None,
                      with_index=True, fp8=False):
    """(o, lse, ForwardState) of contiguous q, k, v: the dense kernels for block_idx None, else the
    gather, hybrid or tile path as `tuning` says; out: contiguous (o, lse) the sparse paths
    write into. with_index: the state holds the gather path's index of every entry (what its
    backward and the KL walk) also after the hybrid forward, which builds it beside its gather
    pass (else `gather_index` builds it when it is needed). fp8: fp8 probabilities (sparse only;
    the gather path, whose tiles each cover one block, so a tile's row max is the block's)."""
    if doc_start is not None:
        doc_start = as_int32(doc_start)
    idx = None if block_idx is None else clean_block_idx(block_idx, block_size, q_offset, doc_start)
    if fp8 and idx is None:
        raise ValueError("fp8 probabilities are the sparse attention's (block_idx given)")
    state = ForwardState(idx, doc_start, fp8=fp8)
    if idx is None:
        if out is not None:
            raise ValueError("given outputs are the sparse paths' only")
        o, lse = dense_forward(q, k, v, scale, q_offset, doc_start)
        return o, lse, state
    if doc_start is not None:
        state.docs = document_blocks(doc_start, block_size, q_offset)
    T, H, D = q.shape[1], q.shape[2] // k.shape[2], q.shape[-1]
    queries = tile_queries(tuning, H)
    if fp8:
        o, lse, state.index = sparse_forward(q, k, v, idx, block_size, scale, q_offset, tuning=tuning,
                                             docs=state.docs, out=out, fp8=True)
    elif takes_tile_backward(tuning, T, H, D):
        state.union = tile_union(idx, queries, state.docs)
        o, lse = tile_forward(q, k, v, state.union, block_size, scale, q_offset, tuning, state.docs, out=out)
    elif takes_tiles(tuning, T, H):
        o, lse, state.index = hybrid_forward(q, k, v, idx, tile_union(idx, queries, state.docs), block_size, scale,
                                             q_offset, tuning, state.docs, out, with_index)
    else:
        o, lse, state.index = sparse_forward(q, k, v, idx, block_size, scale, q_offset, tuning=tuning,
                                             docs=state.docs, out=out)
    return o, lse, state


def gather_index(q, k, state: ForwardState, block_size: int, tuning: Tuning) -> InverseIndex:
    """The gather path's inverse index of every entry of a sparse forward, which its backward
    walks: the forward's own (the hybrid's is built beside its tile kernel), or built now (after
    a forward `with_index=False`) and kept in `state` for the backward."""
    if state.index is None:
        state.index = index_of_every_entry(q, k, state.idx, state.docs, block_size, tuning)
    return state.index


def attention_backward(do, q, k, v, o, lse, state: ForwardState, block_size, scale, q_offset, tuning: Tuning,
                       teacher=None, out=None):
    """(dq, dk, dv) of `attention_forward`; `teacher` and `out` as `sparse_backward`'s (gather path only)."""
    do = do.contiguous()
    if (teacher is not None or out is not None) and (state.idx is None or state.union is not None):
        raise ValueError("the KL teacher rows and given outputs are the sparse gather backward's only")
    if state.idx is None:
        return dense_backward(do, q, k, v, o, lse, scale, q_offset, tuning, state.doc_start)
    if state.union is not None:
        return tile_backward(do, q, k, v, o, lse, state.union, block_size, scale, q_offset, tuning, state.docs)
    return sparse_backward(do, q, k, v, o, lse, state.idx, block_size, scale, q_offset, state.index, tuning,
                           state.docs, teacher, out, state.fp8)


class SparseAttentionTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, block_idx, block_size, scale, q_offset, tuning, doc_start, fp8):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        # the hybrid's index of every entry is built by the backward: a forward without one (no
        # grad, or the first pass of a recomputed layer) builds none and none is held in between
        o, lse, ctx.state = attention_forward(q, k, v, block_idx, block_size, scale, q_offset, tuning, doc_start,
                                              with_index=False, fp8=fp8)
        # tensors go through save_for_backward (so activation checkpointing manages them)
        ctx.save_for_backward(q, k, v, o, lse, ctx.state.idx, ctx.state.doc_start)
        ctx.state.idx = ctx.state.doc_start = None
        ctx.args = (block_size, scale, q_offset, tuning)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse, ctx.state.idx, ctx.state.doc_start = ctx.saved_tensors
        dq, dk, dv = attention_backward(do, q, k, v, o, lse, ctx.state, *ctx.args)
        ctx.state = None
        return dq, dk, dv, None, None, None, None, None, None, None


def sparse_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_idx: torch.Tensor | None,
                            block_size: int, scale: float, q_offset: int = 0, tuning: Tuning | None = None,
                            doc_start: torch.Tensor | None = None, fp8_probs: bool = False
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused sparse (or, with block_idx None, dense causal) attention.

    q [B, T, Hq, D], k/v [B, TK, Hkv, D] in bf16 or fp16 (fp32 only under Triton's interpreter);
    block_idx int [B, T, Hkv, K] or None. Query t sits at position q_offset + t and TK = q_offset + T
    (the keys of the causal prefix). Returns o [B, T, Hq, D] (q dtype) and lse fp32 [B, T, Hq]
    (not differentiable). Inputs are made contiguous. `tuning` (default `DEFAULT_TUNING`) sets
    the launch shapes and the partial buffers' budget. doc_start int [B, T] (packed documents:
    each query reads its own document, block ids count from its start) costs one host
    synchronisation in the sparse path, which sizes the documents' block table, unless it carries
    its host copy (`msa_model.ops.common.attach_host_copy`, as the trainer's does). fp8_probs: the
    output from probabilities rounded to float8 e4m3 (sparse only; the gather path), gradients
    straight through (gather.py).
    """
    if k.shape[1] != q_offset + q.shape[1]:
        raise ValueError(f"keys cover {k.shape[1]} tokens; q_offset + T = {q_offset + q.shape[1]}")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"the Triton sparse_attention supports bf16 and fp16, got {q.dtype}")
    # fp32 runs only in Triton's interpreter (exact): compiled on an H200 (triton 3.6) the tf32
    # backward returned garbage dq, so it is refused rather than trusted
    if q.dtype == torch.float32 and not interpreting():
        raise TypeError("the Triton sparse_attention does not take fp32 on GPUs; cast q, k, v to bf16/fp16 "
                        "or use backend='reference'")
    return SparseAttentionTriton.apply(q, k, v, block_idx, block_size, scale, int(q_offset),
                                       DEFAULT_TUNING if tuning is None else tuning, doc_start, bool(fp8_probs))
