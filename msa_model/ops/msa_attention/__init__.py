"""msa_attention: the whole MSA layer core (select -> sparse attention -> KL) as one call."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch

from msa_model.platform.compat import causal_attention_with_lse

from ..common import (PRODUCTION_BLOCK_SIZE, PRODUCTION_TOPK, check_doc_start, check_index, check_qkv,
                      check_temperature, default_scale, resolve_backend, trim_keys)
from ..dense_attention import DocumentPlan, document_attention
from ..indexer_kl import indexer_kl_loss
from ..select_blocks import select_blocks
from ..sparse_attention import sparse_attention
from ..tuning import KernelTuning

# where the indexer KL's teacher is computed: by the KL's own kernels in the forward, or from the
# sparse attention's backward (late_teacher.py)
KL_TEACHERS = ("forward", "backward")


@dataclass(frozen=True)
class MSASettings:
    """msa_attention's settings: what a model fixes once (its config), apart from each call's inputs.

    `block_size`, `topk`: the selection's geometry (topk * block_size keys per query).
    `local_blocks`: blocks ending with the query's own that are always selected; `force_sink`:
    the first block too (select_blocks).
    `scale`, `index_scale`: of the attention's and the index's scores (None: 1/sqrt(head dim)).
    `index_precision`: select_blocks' `precision` ("input" or "fp8"); the KL's student scores
    keep the inputs' precision either way.
    `kl_teacher`: where the KL's teacher is computed, one of KL_TEACHERS. "forward": by the KL's
    own kernels, and kl holds its value on return. "backward": from the attention's backward,
    which recomputes the probabilities anyway (late_teacher.py); the forward is then cheaper by
    the teacher's q.k over all heads, and kl holds NaN until the backward has run and filled it
    in. Taken where `late_teacher_applies`; elsewhere "forward" is used. Calls whose teacher rows
    would pass the KL tuning's `teacher_bytes` run as query chunks that fit.
    `kl_temperature`: the KL's student is softmax(iq.ik * index_scale / kl_temperature)
    (`indexer_kl_loss`'s `temperature`, MiniMax's `lse_temperature`); the selection's ranking
    does not depend on it.
    `keep_teacher`: see `indexer_kl_loss` (a memory/time trade of the KL's backward).
    `fp8_probs`: the sparse attention's probabilities rounded to float8 e4m3 in the forward,
    gradients straight through (`sparse_attention`); the KL's teacher stays the exact softmax.
    The dense warmup's attention is unaffected.
    `backend`: "auto", "reference" or "triton", for every op of the call.
    `tuning`: the Triton kernels' launch settings per op (None for an op: its defaults).
    """

    block_size: int = PRODUCTION_BLOCK_SIZE
    topk: int = PRODUCTION_TOPK
    local_blocks: int = 1
    force_sink: bool = False
    scale: float | None = None
    index_scale: float | None = None
    index_precision: str = "input"
    kl_teacher: str = "forward"
    kl_temperature: float = 1.0
    keep_teacher: bool | None = None
    fp8_probs: bool = False
    backend: str = "auto"
    tuning: KernelTuning = field(default_factory=KernelTuning)

    def __post_init__(self):
        if self.kl_teacher not in KL_TEACHERS:
            raise ValueError(f"kl_teacher must be one of {KL_TEACHERS}, got {self.kl_teacher!r}")
        object.__setattr__(self, "kl_temperature", check_temperature(self.kl_temperature))


class MSAOutput(NamedTuple):
    """What msa_attention returns. o [B, T, Hq, D]; kl: the indexer KL, fp32 scalar with no
    coefficient applied (None when the call asked for none); block_idx: the int32 [B, T, Hkv, topk]
    selection (None when dense); kl_in_backward: kl's value is filled in by the backward, which
    calls `on_kl` with it (NaN until then)."""

    o: torch.Tensor
    kl: torch.Tensor | None
    block_idx: torch.Tensor | None
    kl_in_backward: bool = False


def msa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, iq: torch.Tensor, ik: torch.Tensor,
                  settings: MSASettings = MSASettings(), *, dense: bool = False, q_offset: int = 0,
                  doc_start: torch.Tensor | None = None, check_ids: bool = True, with_kl: bool = True,
                  on_kl: Callable[[torch.Tensor], None] | None = None,
                  document_plan: DocumentPlan | None = None) -> MSAOutput:
    """MSA attention of one call: `MSAOutput` (o, the indexer KL, the selection).

    q [B, T, Hq, D], k/v [B, T, Hkv, D], iq [B, T, Hkv, Di], ik [B, T, Di]; `settings`: the op's
    (`MSASettings`).
    dense=True is the indexer warmup: dense causal attention and a KL over all causal keys.
    Gradients: o reaches q, k, v only; kl reaches iq, ik only (teacher and index inputs are
    stop-gradient).
    `q_offset`: the queries (q, iq) are positions q_offset .. q_offset + T - 1 of a sequence whose
    k, v, ik [B, >= q_offset + T, ...] are passed whole (context parallelism: a rank's query
    chunk against all-gathered keys); selection, output and KL equal those rows of the full call.
    `doc_start`: int [B, T], the first position of each query's document (packed documents; None:
    one per row). Every document is its own sequence: selection, attention and KL equal running
    the documents one by one (block ids count from the document's start); the KL stays the mean
    over every (b, t, g). `check_ids=False` skips the check of doc_start's values (a host
    synchronisation), for starts built by the data pipeline.
    `with_kl=False`: no KL at all (kl is None), for passes that would drop it: evaluation, and
    the first forward of a layer that full recompute reruns in backward.
    `on_kl(value)`: when the KL's value is filled in by the backward (the output's
    `kl_in_backward`), called there with it (detached); a kl that holds its value on return is
    not passed to it.
    `document_plan`: the dense path's plan for these queries' documents (`dense_attention.
    document_plan`, shared by the layers of a micro-batch); None: built here when dense with
    doc_start (reading the starts back from the device).
    """
    s, tuning = settings, settings.tuning
    B, T, _, Hkv, _ = check_qkv(q, k, v, q_offset)
    check_index(iq, ik, B, T, Hkv, q_offset)
    check_doc_start(doc_start, B, T, q_offset, values=check_ids, device=q.device)
    k, v, ik = trim_keys(T, q_offset, k, v, ik)
    block_idx = None
    if not dense:
        block_idx = select_blocks(iq.detach(), ik.detach(), block_size=s.block_size, topk=s.topk,
                                  force_sink=s.force_sink, backend=s.backend, q_offset=q_offset, doc_start=doc_start,
                                  check_ids=False, tuning=tuning.select_blocks, local_blocks=s.local_blocks,
                                  precision=s.index_precision)
    # select_blocks' ids are in range and doc_start is checked above: no id checks (check_ids), so
    # the layer issues its work with no host synchronisation
    if with_kl and s.kl_teacher == "backward" and late_teacher_applies(q, k, v, iq, ik, s, dense):
        from .late_teacher import msa_late_teacher

        D, Di = q.shape[-1], iq.shape[-1]
        o, _, kl = msa_late_teacher(q, k, v, iq, ik, block_idx, s.block_size, default_scale(D, s.scale),
                                    default_scale(Di, s.index_scale) / s.kl_temperature, q_offset,
                                    tuning.sparse_attention, tuning.indexer_kl, doc_start, on_kl,
                                    fp8_probs=s.fp8_probs)
        return MSAOutput(o, kl, block_idx, kl_in_backward=True)
    if dense and doc_start is not None:
        # packed documents: causal attention on rows of one document, each document alone otherwise
        o, lse = document_attention(q, k, v, doc_start, scale=s.scale, q_offset=q_offset, backend=s.backend,
                                    plan=document_plan, tuning=tuning.sparse_attention)
    elif dense and q_offset == 0 and _use_flash(q, k, v, s.backend):
        o, lse = causal_attention_with_lse(q, k, v, default_scale(q.shape[-1], s.scale))
    else:
        o, lse = sparse_attention(q, k, v, block_idx, block_size=s.block_size, scale=s.scale, backend=s.backend,
                                  q_offset=q_offset, check_ids=False, doc_start=doc_start,
                                  tuning=tuning.sparse_attention, fp8_probs=s.fp8_probs and not dense)
    kl = None
    if with_kl:
        kl = indexer_kl_loss(q.detach(), k.detach(), iq, ik, block_idx, lse.detach(), block_size=s.block_size,
                             scale=s.scale, index_scale=s.index_scale, backend=s.backend, q_offset=q_offset,
                             check_ids=False, doc_start=doc_start, tuning=tuning.indexer_kl,
                             keep_teacher=s.keep_teacher, temperature=s.kl_temperature)
    return MSAOutput(o, kl, block_idx)


def late_teacher_applies(q, k, v, iq, ik, settings: MSASettings, dense: bool = False) -> bool:
    """Whether msa_attention takes the KL's teacher from the attention's backward when `settings`
    ask for it (kl_teacher="backward"): the one place this is decided. The sparse Triton
    path of both ops (fp16/bf16 on a GPU, or the interpreter), the gather backward, a graph to
    run the backward on, and one query's teacher rows within the KL's `teacher_bytes` (a call
    whose rows pass it runs as query chunks whose rows fit)."""
    backend, tuning = settings.backend, settings.tuning
    if dense or not torch.is_grad_enabled() or resolve_backend(backend, q, k, v, iq, ik) != "triton":
        return False
    if backend == "auto" and q.dtype not in (torch.float16, torch.bfloat16):
        return False
    from ..indexer_kl.tuning import DEFAULT_TUNING as KL_DEFAULT
    from ..sparse_attention.triton import takes_tile_backward
    from ..sparse_attention.tuning import DEFAULT_TUNING as SA_DEFAULT
    from .late_teacher import teacher_bytes

    # the tile backward writes no teacher rows: calls that take it keep the teacher in the forward
    # (chunks of a late call are shorter than the call, so none of them takes it if the call does not)
    if takes_tile_backward(tuning.sparse_attention or SA_DEFAULT, q.shape[1], q.shape[2] // k.shape[2],
                           q.shape[-1]):
        return False
    # longer calls run as query chunks whose rows fit (late_teacher.py)
    budget = (tuning.indexer_kl or KL_DEFAULT).teacher_bytes
    return teacher_bytes(q, k.shape[2], settings.topk, settings.block_size, queries=1) <= budget


def _use_flash(q, k, v, backend: str) -> bool:
    """The dense warmup's attention is plain causal attention: on CUDA in fp16/bf16 PyTorch's own
    fused kernels do it (and return the lse the KL needs), faster than our Triton dense path."""
    return (resolve_backend(backend, q, k, v) == "triton" and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
            and q.shape[-1] in (64, 96, 128, 256))
