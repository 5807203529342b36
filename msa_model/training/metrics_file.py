"""Reading a run's metrics.jsonl (written by metrics.JsonlFile) without torch: the reports,
benchmarks and drivers that read it run where training's imports need not load."""

from __future__ import annotations

import json
from pathlib import Path

# the retrieval probe's scalars (msa_model/training/retrieval_probe.py): PROBE_PREFIX<task>/<metric>
PROBE_PREFIX = "valid/probe/"
PROBE_METRICS = ("exact", "answer_loss", "answer_rank")


def probe_scores(record: dict) -> dict[str, dict[str, float]]:
    """{task: {metric: value}} of a record's retrieval probe; {} when it holds none."""
    out: dict[str, dict[str, float]] = {}
    for key, value in record.items():
        if key.startswith(PROBE_PREFIX):
            task, metric = key[len(PROBE_PREFIX):].rsplit("/", 1)
            out.setdefault(task, {})[metric] = value
    return out


def read_metrics(run_dir: Path) -> list[dict]:
    """The records of <run_dir>/metrics.jsonl, one per step in step order.

    - A step written more than once (by a run and again by its relaunch from an earlier
      checkpoint) keeps its last record, the relaunch's.
    - A line that is not JSON is skipped: the last line is cut short when its writer was killed.
    - No file (the run has not logged yet) gives [].
    """
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    by_step = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        by_step[record["step"]] = record
    return [by_step[step] for step in sorted(by_step)]
