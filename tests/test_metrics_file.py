"""read_metrics, the one reader of metrics.jsonl that reports, benchmarks and drivers share: the last
record of each step, a line cut short skipped, no file read as no records, and no torch import."""

from __future__ import annotations

import json
import subprocess
import sys

from msa_model.training.metrics_file import read_metrics
from skeleton_helpers import REPO, _env


def _lines(*steps: int, loss: float = 1.0) -> str:
    return "".join(json.dumps({"step": s, "lm_loss": loss}) + "\n" for s in steps)


def test_a_relaunch_rewriting_steps_keeps_their_last_records(tmp_path):
    # steps 1-4, then a relaunch from the checkpoint of step 2 writes 3 and 4 again, and 5
    (tmp_path / "metrics.jsonl").write_text(_lines(1, 2, 3, 4, loss=1.0) + _lines(3, 4, 5, loss=2.0))
    records = read_metrics(tmp_path)
    assert [(r["step"], r["lm_loss"]) for r in records] == [(1, 1.0), (2, 1.0), (3, 2.0), (4, 2.0), (5, 2.0)]


def test_a_line_cut_short_is_skipped(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(_lines(1, 2) + '{"step": 3, "lm_lo')  # its writer killed
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]


def test_no_file_is_no_records(tmp_path):
    assert read_metrics(tmp_path) == []
    assert read_metrics(tmp_path / "absent") == []


def test_reading_does_not_import_torch():
    code = "import sys, msa_model.training.metrics_file; print(sorted(m for m in ('torch', 'megatron') if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
