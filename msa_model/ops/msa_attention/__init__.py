"""msa_attention: the whole MSA layer core (select -> sparse attention -> KL) as one call."""

from __future__ import annotations

from typing import Callable

import torch

from msa_model.compat import causal_attention_with_lse

from ..common import (PRODUCTION_BLOCK_SIZE, PRODUCTION_TOPK, check_doc_start, check_index, check_qkv,
                      check_temperature, default_scale, resolve_backend, trim_keys)
from ..dense_attention import DocumentPlan, document_attention
from ..indexer_kl import indexer_kl_loss
from ..select_blocks import select_blocks
from ..sparse_attention import sparse_attention

# where the indexer KL's teacher is computed: by the KL's own kernels in the forward, or from the
# sparse attention's backward (late_teacher.py)
KL_TEACHERS = ("forward", "backward")


def msa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, iq: torch.Tensor, ik: torch.Tensor,
                  block_size: int = PRODUCTION_BLOCK_SIZE, topk: int = PRODUCTION_TOPK, dense: bool = False,
                  scale: float | None = None, index_scale: float | None = None, force_sink: bool = False,
                  backend: str = "auto", return_block_idx: bool = False, q_offset: int = 0,
                  doc_start: torch.Tensor | None = None, check_ids: bool = True, tuning: dict | None = None,
                  keep_teacher: bool | None = None, local_blocks: int = 1, index_precision: str = "input",
                  kl_teacher: str = "forward", on_kl: Callable[[torch.Tensor], None] | None = None,
                  with_kl: bool = True, kl_temperature: float = 1.0, document_plan: DocumentPlan | None = None,
                  fp8_probs: bool = False):
    """MSA attention: o [B, T, Hq, D] and the indexer KL (fp32 scalar, no coefficient applied).

    q [B, T, Hq, D], k/v [B, T, Hkv, D], iq [B, T, Hkv, Di], ik [B, T, Di].
    dense=True is the indexer warmup: dense causal attention and a KL over all causal keys.
    Gradients: o reaches q, k, v only; kl reaches iq, ik only (teacher and index inputs are
    stop-gradient). With `return_block_idx` also returns the int32 [B, T, Hkv, topk] selection
    (None when dense).
    `q_offset`: the queries (q, iq) are positions q_offset .. q_offset + T - 1 of a sequence whose
    k, v, ik [B, >= q_offset + T, ...] are passed whole (context parallelism: a rank's query
    chunk against all-gathered keys); selection, output and KL equal those rows of the full call.
    `doc_start`: int [B, T], the first position of each query's document (packed documents; None:
    one per row). Every document is its own sequence: selection, attention and KL equal running
    the documents one by one (block ids count from the document's start); the KL stays the mean
    over every (b, t, g). `check_ids=False` skips the check of doc_start's values (a host
    synchronisation), for starts built by the data pipeline.
    `tuning`: the Triton kernels' settings per op, {"select_blocks" | "sparse_attention" |
    "indexer_kl": that op's `triton.Tuning`}; a missing op takes its defaults.
    `keep_teacher`: see `indexer_kl_loss` (a memory/time trade of the KL's backward).
    `local_blocks`: blocks ending with the query's own that are always selected (select_blocks).
    `index_precision`: select_blocks' `precision` ("input" or "fp8"); the KL's student scores
    keep the inputs' precision either way.
    `kl_teacher`: where the KL's teacher is computed. "forward": by the KL's own kernels, and kl
    holds its value on return. "backward": from the attention's backward, which recomputes the
    probabilities anyway (late_teacher.py); the forward is then cheaper by the teacher's
    q.k over all heads, and kl holds NaN until the backward has run and filled it in. Taken on
    the Triton sparse path with gradients enabled; elsewhere "forward" is used. Calls whose
    teacher rows would pass the KL tuning's `teacher_bytes` run as query chunks that fit.
    `on_kl(value)`: called with the KL's detached value as soon as it is known: in the backward
    when the teacher comes from there (`late_teacher_applies`), else in this call.
    `with_kl=False`: no KL at all (kl is None), for passes that would drop it: evaluation, and
    the first forward of a layer that full recompute reruns in backward.
    `kl_temperature`: the KL's student is softmax(iq.ik * index_scale / kl_temperature)
    (`indexer_kl_loss`'s `temperature`, MiniMax's `lse_temperature`); the selection's ranking
    does not depend on it.
    `document_plan`: the dense path's plan for these queries' documents (`dense_attention.
    document_plan`, shared by the layers of a micro-batch); None: built here when dense with
    doc_start (reading the starts back from the device).
    `fp8_probs`: the sparse attention's probabilities rounded to float8 e4m3 in the forward,
    gradients straight through (`sparse_attention`); the KL's teacher stays the exact softmax.
    The dense warmup's attention is unaffected.
    """
    if kl_teacher not in KL_TEACHERS:
        raise ValueError(f"kl_teacher must be one of {KL_TEACHERS}, got {kl_teacher!r}")
    tuning = tuning or {}
    kl_temperature = check_temperature(kl_temperature)
    B, T, _, Hkv, _ = check_qkv(q, k, v, q_offset)
    check_index(iq, ik, B, T, Hkv, q_offset)
    check_doc_start(doc_start, B, T, q_offset, values=check_ids, device=q.device)
    k, v, ik = trim_keys(T, q_offset, k, v, ik)
    block_idx = None
    if not dense:
        block_idx = select_blocks(iq.detach(), ik.detach(), block_size=block_size, topk=topk,
                                  force_sink=force_sink, backend=backend, q_offset=q_offset, doc_start=doc_start,
                                  check_ids=False, tuning=tuning.get("select_blocks"), local_blocks=local_blocks,
                                  precision=index_precision)
    # select_blocks' ids are in range and doc_start is checked above: no id checks (check_ids), so
    # the layer issues its work with no host synchronisation
    late = with_kl and kl_teacher == "backward"
    if late and late_teacher_applies(q, k, v, iq, ik, block_size, topk, dense, backend, tuning):
        from .late_teacher import msa_late_teacher

        D, Di = q.shape[-1], iq.shape[-1]
        o, _, kl = msa_late_teacher(q, k, v, iq, ik, block_idx, block_size, default_scale(D, scale),
                                    default_scale(Di, index_scale) / kl_temperature, q_offset,
                                    tuning.get("sparse_attention"),
                                    tuning.get("indexer_kl"), doc_start, on_kl, fp8_probs=fp8_probs)
        return (o, kl, block_idx) if return_block_idx else (o, kl)
    if dense and doc_start is not None:
        # packed documents: causal attention on rows of one document, each document alone otherwise
        o, lse = document_attention(q, k, v, doc_start, scale=scale, q_offset=q_offset, backend=backend,
                                    plan=document_plan, tuning=tuning.get("sparse_attention"))
    elif dense and q_offset == 0 and _use_flash(q, k, v, backend):
        o, lse = causal_attention_with_lse(q, k, v, default_scale(q.shape[-1], scale))
    else:
        o, lse = sparse_attention(q, k, v, block_idx, block_size=block_size, scale=scale, backend=backend,
                                  q_offset=q_offset, check_ids=False, doc_start=doc_start,
                                  tuning=tuning.get("sparse_attention"), fp8_probs=fp8_probs and not dense)
    kl = None
    if with_kl:
        kl = indexer_kl_loss(q.detach(), k.detach(), iq, ik, block_idx, lse.detach(), block_size=block_size,
                             scale=scale, index_scale=index_scale, backend=backend, q_offset=q_offset,
                             check_ids=False, doc_start=doc_start, tuning=tuning.get("indexer_kl"),
                             keep_teacher=keep_teacher, temperature=kl_temperature)
        if on_kl is not None:
            on_kl(kl.detach())
    if return_block_idx:
        return o, kl, block_idx
    return o, kl


def late_teacher_applies(q, k, v, iq, ik, block_size: int, topk: int, dense: bool = False, backend: str = "auto",
                         tuning: dict | None = None) -> bool:
    """Whether msa_attention honours kl_teacher="backward" for these arguments: the sparse Triton
    path of both ops (fp16/bf16 on a GPU, or the interpreter), the gather backward, a graph to
    run the backward on, and one query's teacher rows within the KL's `teacher_bytes` (a call
    whose rows pass it runs as query chunks whose rows fit)."""
    tuning = tuning or {}
    if dense or not torch.is_grad_enabled() or resolve_backend(backend, q, k, v, iq, ik) != "triton":
        return False
    if backend == "auto" and q.dtype not in (torch.float16, torch.bfloat16):
        return False
    from ..indexer_kl.triton import DEFAULT_TUNING as KL_DEFAULT
    from ..sparse_attention.triton import DEFAULT_TUNING as SA_DEFAULT, takes_tile_backward
    from .late_teacher import teacher_bytes

    # the tile backward writes no teacher rows: calls that take it keep the teacher in the forward
    # (chunks of a late call are shorter than the call, so none of them takes it if the call does not)
    if takes_tile_backward(tuning.get("sparse_attention") or SA_DEFAULT, q.shape[1], q.shape[2] // k.shape[2],
                           q.shape[-1]):
        return False
    # longer calls run as query chunks whose rows fit (late_teacher.py)
    budget = (tuning.get("indexer_kl") or KL_DEFAULT).teacher_bytes
    return teacher_bytes(q, k.shape[2], topk, block_size, queries=1) <= budget


def _use_flash(q, k, v, backend: str) -> bool:
    """The dense warmup's attention is plain causal attention: on CUDA in fp16/bf16 PyTorch's own
    fused kernels do it (and return the lse the KL needs), faster than our Triton dense path."""
    return (resolve_backend(backend, q, k, v) == "triton" and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
            and q.shape[-1] in (64, 96, 128, 256))
