"""bench/profile_step.py's host breakdown: per thread, the outermost ops' host time (nested ops are
counted in their parent, not again), the time between them, and the long waits apart."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from profile_step import host_summary  # noqa: E402


def test_outermost_ops_their_gaps_and_waits():
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            torch.mm(x, x)  # aten::mm, no nested op
        time.sleep(0.005)  # a wait between ops, not an op
        torch.nn.functional.linear(x, x)  # aten::linear with aten::t and aten::mm inside
    (thread,) = [t for t in host_summary(prof.events()) if any(name == "aten::linear" for _, _, name in t["ops"])]
    counts = {name: n for _, n, name in thread["ops"]}
    # the linear's inner mm is not an outermost op: three mm calls, one linear
    assert counts["aten::mm"] == 3 and counts["aten::linear"] == 1 and "aten::t" not in counts
    assert thread["waits_us"] >= 5000
    busy = sum(us for us, _, _ in thread["ops"])
    assert abs(thread["span_us"] - (busy + thread["gaps_us"] + thread["waits_us"])) < 1.0
    # sorted by host time, most first
    times = [us for us, _, _ in thread["ops"]]
    assert times == sorted(times, reverse=True)
