"""Reading a run's metrics.jsonl (written by metrics.JsonlFile) without torch: the reports,
benchmarks and drivers that read it run where training's imports need not load."""

from __future__ import annotations

import json
from pathlib import Path


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
