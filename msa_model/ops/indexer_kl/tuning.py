"""The launch settings of the indexer KL's Triton kernels (`Tuning`), apart from the kernels so that
a configuration can name and check them without loading Triton."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tuning:
    """Tile sizes: M queries per tile, teacher dots of up to `rows` rows (M x heads), J keys per
    dense tile, `per_program` entries per sparse program (a popular block is split into such runs),
    pipeline stages of the sparse forward (`fwd_stages`), the dense kernels (`dense_stages`) and
    the sparse backward that recomputes the teacher (`stages`). The dense forward's second pass
    has its own `dense_M`, `dense_rows`, `dense_fwd_j` and `dense_warps`; its first pass (the
    student's lse) takes `lse_M` queries against `lse_J` keys per step.

    Sparse mode keeps the forward's teacher rows (fp16, or fp32 for fp32 inputs; E x J values)
    for the backward when they fit in `teacher_bytes` (0: always recompute) and in
    `teacher_q_ratio` times the bytes of q (they live from this layer's forward to its backward,
    like its other activations: at most about what the layer keeps anyway; a caller that reruns
    the forward just before the backward lifts this second bound); the backward then
    recomputes only the student, with tiles of `stored_M` entries (`late_M` / `late_warps` when
    the rows come from the attention's backward and the loss is summed there too: 9.4 against
    13.2 ms for 64 / 4 at 128K). Defaults chosen by bench/bench_msa_layer.py tune
    (bench/RESULTS.md)."""
    M: int = 16
    rows: int = 128
    dense_rows: int = 128
    dense_M: int = 16
    dense_warps: int = 8
    dense_fwd_j: int = 128
    lse_M: int = 64
    lse_J: int = 64
    dense_bwd_j: int = 128
    fwd_per_program: int = 256
    bwd_per_program: int = 512
    warps: int = 8
    stages: int = 1
    fwd_stages: int = 2
    dense_stages: int = 2
    teacher_bytes: int = 4 << 30
    teacher_q_ratio: float = 1.0
    stored_M: int = 64
    stored_warps: int = 4
    stored_stages: int = 2
    late_M: int = 32
    late_warps: int = 4


DEFAULT_TUNING = Tuning()
