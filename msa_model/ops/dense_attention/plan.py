"""How a packed batch's dense attention runs: the plan, decided on the host from the documents'
starts once per micro-batch and shared by every layer.

B = batch, C = queries of the call (positions q_offset ..), S = segments (one document's rows of
one batch row), L = a bucket's padded segment length, R = packed rows (sum over buckets of n*L).

Paths (README.md, "The dispatch rule"):
- "causal": every row holds one document and q_offset = 0: plain causal attention on [B, C].
- "segments": q_offset = 0, some row holds several documents, and they are long (SEGMENTS_MIN_MEAN
  rows on average): each document is cut out of its
  row and padded at its end to its bucket's length; one causal call per bucket length, on all of
  that bucket's documents as a batch. Padded rows come after a document's last query, so its
  queries never read them, and their outputs are dropped.
- "kernel": the ops' dense path with the starts (the Triton dense kernels, or the reference),
  which takes any q_offset (context parallelism's later query chunks), any head dim, and short
  documents, whose many small calls would cost more than the kernel's skipped blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..common import attach_host_copy, host_copy

# Every distinct (segments, length) shape costs torch's cuDNN attention a graph build (tens to
# hundreds of ms, then cached for the process), so shapes come from a small set whatever the
# documents: a segment's padded length is a power of two from MIN_LENGTH up to SHORT (short
# documents: cheap attention, and a bucket's count of segments is padded to a power of two too),
# and above it one of STEPS_PER_OCTAVE lengths of each octave (padding at most 1/8 of the
# length, where attention costs).
MIN_LENGTH = 128
SHORT = 1024
# below this mean document length (query rows per document of the call) the Triton dense kernel,
# which skips the key blocks before each document's start, beats one cuDNN call per bucket:
# measured on an H200 (bench/bench_dense_documents.py, Hq 64, Hkv 4, D 128, fwd+bwd): 8K rows of 10
# documents 3.69 vs 5.03 ms, of 100 1.54 vs 5.62; 32K of 10 documents (3.3K each) 46.6 vs 36.2,
# of 100 9.4 vs 24.1
SEGMENTS_MIN_MEAN = 2048
STEPS_PER_OCTAVE = 8
# The segments path's kernel per shape. cuDNN's first call of a shape builds a graph (82-102 ms
# fwd+bwd on an H200, whatever the shape), then runs 1.6-1.9x faster than flash attention, which
# builds nothing (bench/results/document-masking-2026-12-03/segment_shapes.txt). So a shape runs on
# flash until flash's extra time on it adds up to one build, then on cuDNN (rent, then buy: never
# more than twice what the better choice in hindsight costs); shapes a run meets rarely never build.
CUDNN_BUILD_MS = 90.0
# flash's extra ms per TFLOP of causal attention over warm cuDNN's (fwd+bwd; production geometry
# 1.47-1.6, `small` 1.45 at 12K rows)
FLASH_EXTRA_MS_PER_TFLOP = 1.5
# the attribute of a doc_start tensor that holds its plans (one tensor per micro-batch, handed to
# every layer: one plan per query chunk, per step); its host copy: msa_model.ops.common
_PLANS = "_msa_doc_start_plans"


def bucket_length(n: int) -> int:
    """The padded length of a segment of n rows."""
    if n <= SHORT:
        return max(MIN_LENGTH, 1 << (n - 1).bit_length())
    step = (1 << ((n - 1).bit_length() - 1)) // STEPS_PER_OCTAVE
    return -(-n // step) * step


def bucket_count(n: int, length: int) -> int:
    """Segments a bucket of n segments of `length` rows computes: short ones padded to a power of
    two (empty segments: zeros, outputs dropped), long ones as they are."""
    return 1 << (n - 1).bit_length() if length <= SHORT else n


@dataclass
class Bucket:
    """n segments padded to `length` rows, computed as `count` (>= n, the rest empty): packed
    rows [offset, offset + count*length) of the plan's packed buffer."""

    length: int
    n: int
    offset: int
    count: int = 0
    # cuDNN (True) or flash (False), chosen at the bucket's first call (CudnnShapes): every layer of
    # the micro-batch, and a recomputed forward, run the same kernel
    cudnn: bool | None = None


class CudnnShapes:
    """Which segment shapes have earned a cuDNN graph build (CUDNN_BUILD_MS, above), per process:
    `charge` adds flash's estimated extra time for a call of a shape, `ready` says whether the
    shape's charges have reached one build (from then on it runs on cuDNN)."""

    def __init__(self, build_ms: float = CUDNN_BUILD_MS, extra_ms_per_tflop: float = FLASH_EXTRA_MS_PER_TFLOP):
        self.build_ms, self.extra_ms_per_tflop = build_ms, extra_ms_per_tflop
        self.spent: dict[tuple, float] = {}
        self.built: set[tuple] = set()

    def ready(self, shape: tuple) -> bool:
        if shape not in self.built and self.spent.get(shape, 0.0) >= self.build_ms:
            self.built.add(shape)
            self.spent.pop(shape, None)
        return shape in self.built

    def charge(self, shape: tuple, tflop: float) -> None:
        if shape not in self.built:
            self.spent[shape] = self.spent.get(shape, 0.0) + tflop * self.extra_ms_per_tflop


CUDNN_SHAPES = CudnnShapes()


def bucket_uses_cudnn(bucket: Bucket, heads: int, groups: int, head_dim: int, dtype, backward: bool,
                      shapes: CudnnShapes | None = None) -> bool:
    """Whether a call of `bucket` runs on cuDNN (else flash): decided at the bucket's first call
    from what its shape has cost on flash so far (`shapes`: the process's CUDNN_SHAPES), and
    charged for this call if on flash (its forward, and its backward if `backward`)."""
    shapes = CUDNN_SHAPES if shapes is None else shapes
    # one account per shape whatever the call: under activation recompute the first forward runs
    # without grad and the recomputed one with it, and both are this shape's work
    shape = (bucket.count, bucket.length, heads, groups, head_dim, dtype)
    if bucket.cudnn is None:
        bucket.cudnn = shapes.ready(shape)
    if not bucket.cudnn:
        pairs = bucket.count * bucket.length * (bucket.length + 1) / 2
        shapes.charge(shape, 4 * pairs * head_dim * heads * (3.5 if backward else 1.0) / 1e12)
    return bucket.cudnn


@dataclass
class DocumentPlan:
    """The path of one call and, for "segments", where each row goes.

    src, dst: int64 [rows of documents] (device): packed row dst[i] holds row src[i] of the
    call's [B*C] rows (query, key and value rows alike: q_offset is 0); every row appears once.
    packed: R, the packed buffer's rows (padding included). lengths: every segment's length, for
    the cost figures."""

    path: str
    B: int
    C: int
    q_offset: int
    buckets: list[Bucket] = field(default_factory=list)
    src: torch.Tensor | None = None
    dst: torch.Tensor | None = None
    packed: int = 0
    lengths: list[int] = field(default_factory=list)

    def key_area(self) -> int:
        """Query-key pairs the documents attend (causal, within each document)."""
        return sum(n * (n + 1) // 2 for n in self.lengths) if self.lengths else self.B * self.C * (self.C + 1) // 2

    def padded_area(self) -> int:
        """Query-key pairs the kernels compute: the causal area of each padded segment."""
        if self.path != "segments":
            return self.B * self.C * (self.C + 1) // 2
        return sum(b.count * b.length * (b.length + 1) // 2 for b in self.buckets)


def segments_of(doc_BC: np.ndarray) -> list[tuple[int, int, int]]:
    """(row, first query, length) of every document of doc_BC [B, C] (starts of queries at
    positions 0 .. C - 1): a document starts where a query's start is its own position."""
    B, C = doc_BC.shape
    out = []
    pos = np.arange(C)
    for b in range(B):
        firsts = np.flatnonzero((doc_BC[b] == pos) & (pos > 0)).tolist()
        bounds = [0, *firsts, C]
        out += [(b, s, e - s) for s, e in zip(bounds[:-1], bounds[1:])]
    return out


def build_plan(doc_BC: torch.Tensor | np.ndarray, q_offset: int, device: torch.device | str,
               fused: bool = True, segments: bool = False) -> DocumentPlan:
    """The plan of a call whose queries have starts doc_BC [B, C] (host values) at positions
    q_offset ..; `fused`: torch's fused causal kernels take these inputs (else "kernel");
    `segments`: the segments path whatever the documents (the path's tests). Host work only,
    plus the index copies to `device`."""
    doc = doc_BC.numpy() if torch.is_tensor(doc_BC) else np.asarray(doc_BC)
    B, C = doc.shape
    if q_offset != 0 or not fused:
        return DocumentPlan("kernel", B, C, q_offset)
    segs = segments_of(doc)
    if len(segs) == B and not segments:
        return DocumentPlan("causal", B, C, 0, lengths=[n for _, _, n in segs])
    if B * C < SEGMENTS_MIN_MEAN * len(segs) and not segments:
        return DocumentPlan("kernel", B, C, 0)
    by_length: dict[int, list[tuple[int, int, int]]] = {}
    for seg in segs:
        by_length.setdefault(bucket_length(seg[2]), []).append(seg)
    buckets, src, dst, offset = [], [], [], 0
    for length in sorted(by_length, reverse=True):
        group = by_length[length]
        for j, (b, s, n) in enumerate(group):
            src.append(b * C + s + np.arange(n))
            dst.append(offset + j * length + np.arange(n))
        count = bucket_count(len(group), length)
        buckets.append(Bucket(length, len(group), offset, count))
        offset += count * length
    as_index = lambda parts: torch.from_numpy(np.concatenate(parts).astype(np.int64)).to(device)  # noqa: E731
    return DocumentPlan("segments", B, C, 0, buckets, as_index(src), as_index(dst), offset,
                        [n for _, _, n in segs])


def document_plan(doc_start_BS: torch.Tensor, a: int, b: int, q_offset: int, fused: bool = True) -> DocumentPlan:
    """The plan of the queries a .. b - 1 (at positions q_offset ..) of doc_start_BS [B, S],
    cached on that tensor: every layer of a micro-batch gets the same tensor, so the plan is
    built (and the starts read, from the host copy when `attach_host_copy` gave one, else from
    the device: one synchronisation) once per micro-batch."""
    plans = getattr(doc_start_BS, _PLANS, None)
    if plans is None:
        plans = {}
        setattr(doc_start_BS, _PLANS, plans)
    key = (a, b, q_offset, fused)
    if key not in plans:
        host = host_copy(doc_start_BS)
        if host is None:
            host = doc_start_BS.cpu()
            attach_host_copy(doc_start_BS, host)
        plans[key] = build_plan(host[:, a:b], q_offset, doc_start_BS.device, fused)
    return plans[key]
