"""The launch settings of select_blocks' Triton kernel (`Tuning`), apart from the kernel so that a
configuration can name and check them without loading Triton. The GPU's are `DEFAULT_TUNING`;
a call given none on the CPU (Triton's interpreter) takes `INTERPRETER_TUNING` (`default_tuning`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tuning:
    """Tile shape and launch settings: `rows` = queries x padded groups per program, `cols` = keys
    per tile (at least one block), `topk_rows` and `topk_stages` for the two-stage path's top-k
    kernel. The GPU defaults won over 8 warps / 3 stages and 256 rows on an H200 at 32K
    (bench/RESULTS.md, "Figures behind code choices")."""

    rows: int = 128
    cols: int = 128
    num_warps: int = 4
    num_stages: int = 2
    topk_rows: int = 32
    topk_stages: int = 2
    # fp8 scores: blocks after which a key tile's top-k update runs only if some row of the program
    # takes a candidate (`_insert`, `_skips`); where the skips began to pay on an H200
    skip_from: int = 1024


DEFAULT_TUNING = Tuning()
# the interpreter runs each program in numpy: small tiles keep the tests quick (and the top-k
# skip starts early, so the tests run both ways of updating it)
INTERPRETER_TUNING = Tuning(rows=32, cols=32, num_warps=4, num_stages=1, topk_rows=32, topk_stages=1, skip_from=3)


def default_tuning(device: torch.device) -> Tuning:
    """The settings a call on `device` takes when none are given."""
    return DEFAULT_TUNING if device.type == "cuda" else INTERPRETER_TUNING
