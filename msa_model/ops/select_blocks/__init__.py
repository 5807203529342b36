"""select_blocks: the index branch (block-max scores, exp-free top-k, local block forced)."""

from __future__ import annotations

import torch

from ..common import (PRODUCTION_BLOCK_SIZE, PRODUCTION_TOPK, check_block_size, check_doc_start, check_index, load_triton,
                      resolve_backend, trim_keys)
from .fp8 import INDEX_PRECISIONS, check_precision
from .reference import select_blocks_reference


@torch.no_grad()
def select_blocks(iq: torch.Tensor, ik: torch.Tensor, block_size: int = PRODUCTION_BLOCK_SIZE,
                  topk: int = PRODUCTION_TOPK, force_sink: bool = False, backend: str = "auto", q_offset: int = 0,
                  doc_start: torch.Tensor | None = None, check_ids: bool = True, tuning=None,
                  local_blocks: int = 1, precision: str = "input") -> torch.Tensor:
    """Choose the top-k key blocks for each query and GQA group.

    iq: [B, T, Hkv, Di] index queries (one per group); ik: [B, T, Di] the shared index key.
    Returns int32 [B, T, Hkv, topk]: block ids (block n = tokens [n*block_size, (n+1)*block_size)),
    a set per (b, t, g) in any order; -1 marks an empty slot (fewer visible blocks than topk).
    Not differentiable (selection is discrete).
    `q_offset`: the queries are positions q_offset .. q_offset + T - 1 of a longer sequence
    whose index keys ik [B, >= q_offset + T, Di] are passed whole (context parallelism).
    `doc_start`: int [B, T], the position of each query's document's first token (packed
    documents; None: one document per row). Each document is its own sequence: a query sees its
    document's keys only, and block ids count from the document's start (docs/msa.md).
    `check_ids=False` skips the check of doc_start's values (a host synchronisation).
    `tuning`: the Triton kernel's tile shape (`select_blocks.tuning.Tuning`; None: `default_tuning`).
    `local_blocks`: how many blocks ending with the query's own are always selected (1: the
    local block only), at most `topk`; the sink ranks right below them.
    `precision`: "input" scores in the inputs' dtype (fp32 accumulation); "fp8" quantizes iq (per
    row) and ik (per key block) to float8 e4m3 and multiplies on the fp8 tensor cores, which
    scores about 1.6x faster on Hopper; near-tied blocks may then swap (`fp8.py`).
    """
    check_block_size(block_size, topk)
    if not isinstance(local_blocks, int) or not 1 <= local_blocks <= topk:
        raise ValueError(f"local_blocks must be an int in [1, topk={topk}], got {local_blocks!r}")
    B, T, _, _ = check_index(iq, ik, q_offset=q_offset)
    check_doc_start(doc_start, B, T, q_offset, values=check_ids, device=iq.device)
    check_precision(precision, iq.device)
    (ik,) = trim_keys(iq.shape[1], q_offset, ik)
    if resolve_backend(backend, iq, ik) == "triton":
        return load_triton("select_blocks").select_blocks_triton(iq, ik, block_size, topk, force_sink,
                                                                 tuning=tuning, q_offset=q_offset,
                                                                 doc_start=doc_start, local_blocks=local_blocks,
                                                                 precision=precision)
    return select_blocks_reference(iq, ik, block_size, topk, force_sink, q_offset, doc_start, local_blocks, precision)


__all__ = ["INDEX_PRECISIONS", "select_blocks", "select_blocks_reference"]
