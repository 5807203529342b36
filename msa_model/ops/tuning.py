"""The launch settings of the three MSA ops' Triton kernels in one object (`KernelTuning`), built
from per-op field overrides as a configuration gives them (`kernel_tuning`, `tuning_problems`).

Each op keeps its own settings in its `tuning.py` (`Tuning`, `DEFAULT_TUNING`), importable without
Triton; None for an op means that op's defaults (select_blocks': `DEFAULT_TUNING` on a GPU,
`INTERPRETER_TUNING` on the CPU).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from .indexer_kl import tuning as indexer_kl
from .select_blocks import tuning as select_blocks
from .sparse_attention import tuning as sparse_attention

# op name -> its settings' module (Tuning, DEFAULT_TUNING)
OPS = {"sparse_attention": sparse_attention, "select_blocks": select_blocks, "indexer_kl": indexer_kl}


@dataclass(frozen=True)
class KernelTuning:
    """Each op's `Tuning`, or None for its defaults."""

    sparse_attention: sparse_attention.Tuning | None = None
    select_blocks: select_blocks.Tuning | None = None
    indexer_kl: indexer_kl.Tuning | None = None


def _fields(op: str) -> list[str]:
    return [f.name for f in dataclasses.fields(OPS[op].Tuning)]


def _set(fields: Mapping[str, Any] | None) -> dict[str, Any]:
    """The fields given a value (a configuration leaves the others None)."""
    return {k: v for k, v in (fields or {}).items() if v is not None}


def tuning_problems(overrides: Mapping[str, Mapping[str, Any] | None], where: str) -> list[str]:
    """One line per unknown op or field of `overrides` ({op: {field: value}}), named `where.op.field`."""
    problems = []
    for op, fields in overrides.items():
        if op not in OPS:
            problems.append(f"{where}.{op}: unknown op; ops: {', '.join(OPS)}")
            continue
        if fields is not None and not isinstance(fields, Mapping):
            problems.append(f"{where}.{op}: must map field names to values, got {fields!r}")
            continue
        known = _fields(op)
        problems += [f"{where}.{op}.{name}: unknown field; fields: {', '.join(known)}"
                     for name in _set(fields) if name not in known]
    return problems


def kernel_tuning(overrides: Mapping[str, Mapping[str, Any] | None] | None = None) -> KernelTuning:
    """KernelTuning with each op's given fields over its `DEFAULT_TUNING` (lists become tuples); an
    op given none keeps None. Unknown ops or fields raise ValueError (`tuning_problems`)."""
    overrides = overrides or {}
    problems = tuning_problems(overrides, "tuning")
    if problems:
        raise ValueError("; ".join(problems))
    built = {}
    for op, fields in overrides.items():
        given = {k: tuple(v) if isinstance(v, (list, tuple)) else v for k, v in _set(fields).items()}
        if given:
            built[op] = dataclasses.replace(OPS[op].DEFAULT_TUNING, **given)
    return KernelTuning(**built)
