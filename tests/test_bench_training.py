"""bench/bench_training.py's summary of a job: medians over the timed steps, and their range."""

from __future__ import annotations

from bench.bench_training import step_medians, table


def _records(step_ms):
    return [{"step_ms": ms, "tokens_per_s": 32768 / ms * 1000, "peak_mem_gib": 10.0 + i}
            for i, ms in enumerate(step_ms)]


def test_medians_skip_the_first_two_steps_and_keep_the_range():
    # steps 1-2 compile; a masked dense step's time depends on the batch's documents
    out = step_medians(_records([9000.0, 1200.0, 863.0, 946.0, 798.0]), ("step_ms", "tokens_per_s"))
    assert out["steps"] == 5 and out["timed_steps"] == 3
    assert out["step_ms"] == 863.0 and out["step_ms_range"] == [798.0, 946.0]
    assert out["peak_mem_gib"] == 14.0  # over every step, the compiling ones included


def test_the_table_shows_the_range_beside_the_median_and_the_ratio_of_medians():
    dense = {"returncode": 0, **step_medians(_records([9000.0, 1200.0, 863.0, 946.0, 798.0]), ("step_ms", "tokens_per_s"))}
    pt = {"returncode": 0, **step_medians(_records([9000.0, 1200.0, 436.0, 436.0, 436.0]), ("step_ms", "tokens_per_s"))}
    text = table([{"T": 32768, "variant": "dense", "recompute": "none", "result": dense},
                  {"T": 32768, "variant": "pt", "recompute": "none", "result": pt}])
    dense_row, pt_row = text.splitlines()[2:]
    assert "| 863 (798-946) |" in dense_row
    assert "| 436 |" in pt_row and "(" not in pt_row.split("|")[7]  # equal steps: no range
    assert pt_row.rstrip().endswith(f"| {863 / 436:.2f}x |")
