"""Profile one training step of a real `train.py` run: the kernels that take the device time, and
how long the host took to issue them.

    PYTHONPATH=. python bench/profile_step.py [--step 3] [--rows 30] [--shapes 40] [--gaps 30] [--host 25] [--trace FILE] -- key=value ...

Runs train.py with the given overrides in this process; step --step (after compilation and
warm-up) runs under torch.profiler. Prints the step's wall time, the device time summed over
kernels, and the top kernels by device time; --shapes N also the N ops of most device time per input shape (which
tensors the elementwise work runs on); --gaps N where the device waited for the host; --host N
per host thread (forward, autograd's backward) the N outermost ops of most host time and the time
between them; --trace writes a Chrome trace.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _annotation(event) -> bool:
    """A user annotation's device-side span (the optimizer step's, say), not a kernel."""
    return bool(getattr(event, "is_user_annotation", False))


def idle_gaps(events, top: int, min_us: float = 10.0) -> None:
    """Print where the device waited for the host in a profiled step: the kernels after the
    longest total waits, and the longest single waits with the host ops open at their middle."""
    from torch.autograd import DeviceType

    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                     if e.device_type == DeviceType.CUDA and not _annotation(e))
    if not kernels:
        print("no device activity recorded", flush=True)
        return
    host = sorted((e.time_range.start, e.time_range.end, e.name) for e in events if e.device_type == DeviceType.CPU)
    gaps, (start, end, prev) = [], kernels[0]
    busy = end - start
    for s, e, name in kernels[1:]:
        if s - end >= min_us:
            gaps.append((s - end, end, s, prev, name))
        if e > end:
            busy += e - max(s, end)
            end, prev = e, name
    span = end - kernels[0][0]
    idle = sum(g[0] for g in gaps)
    print(f"device span {span / 1e3:.1f} ms: busy {busy / 1e3:.1f} ms, idle in {len(gaps)} waits of at least "
          f"{min_us:.0f} us {idle / 1e3:.1f} ms", flush=True)
    waited = defaultdict(lambda: [0.0, 0])
    for g in gaps:
        waited[g[4]][0] += g[0]
        waited[g[4]][1] += 1
    print("kernels the device waited for most (total ms, waits):")
    for name, (us, n) in sorted(waited.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"  {us / 1e3:8.2f} ms {n:5d}  {name[:100]}")
    print("longest waits (ms, kernel before -> after; host ops open at the middle, outermost first):")
    for us, s, e, before, after in sorted(gaps, reverse=True)[:top]:
        mid = (s + e) / 2
        open_ops = [n for hs, he, n in host if hs <= mid <= he]
        print(f"  {us / 1e3:7.2f}  {before[:45]} -> {after[:45]}\n           {' > '.join(open_ops[-6:])[:200]}")
    sys.stdout.flush()


def host_summary(events, min_wait_us: float = 1000.0) -> list[dict]:
    """Where each host thread's time went in a profiled step, busiest thread first (the forward's
    and autograd's backward thread): its span, the ops open at the outermost level with their
    total time and count, the short gaps between them (Python outside any op) and the long ones
    (at least `min_wait_us`: the thread waiting, e.g. the forward's for the backward)."""
    from torch.autograd import DeviceType

    by_thread = defaultdict(list)
    for e in events:
        if e.device_type == DeviceType.CPU and not _annotation(e):
            by_thread[e.thread].append((e.time_range.start, e.time_range.end, e.name))
    out = []
    for thread, ops in by_thread.items():
        ops.sort(key=lambda op: (op[0], -op[1]))
        totals, gaps, waits, end = defaultdict(lambda: [0.0, 0]), 0.0, 0.0, None
        for start, stop, name in ops:
            if end is not None and start < end:
                continue  # inside an outer op
            if end is not None:
                gap = start - end
                waits, gaps = (waits + gap, gaps) if gap >= min_wait_us else (waits, gaps + gap)
            totals[name][0] += stop - start
            totals[name][1] += 1
            end = stop
        out.append({"thread": thread, "span_us": end - ops[0][0], "gaps_us": gaps, "waits_us": waits,
                    "ops": sorted(((us, n, name) for name, (us, n) in totals.items()), reverse=True)})
    return sorted(out, key=lambda t: -sum(us for us, _, _ in t["ops"]))


def print_host(events, top: int) -> None:
    for t in host_summary(events)[:2]:
        busy = sum(us for us, _, _ in t["ops"])
        print(f"host thread {t['thread']}: span {t['span_us'] / 1e3:.1f} ms = outermost ops {busy / 1e3:.1f} + "
              f"between them {t['gaps_us'] / 1e3:.1f} + waits of 1 ms or more {t['waits_us'] / 1e3:.1f}; "
              f"its outermost ops by host time (ms, calls):")
        for us, n, name in t["ops"][:top]:
            print(f"  {us / 1e3:8.2f} {n:6d}  {name.replace('autograd::engine::evaluate_function: ', 'backward: ')[:90]}")
    sys.stdout.flush()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--step", type=int, default=3)
    ap.add_argument("--rows", type=int, default=30)
    ap.add_argument("--trace", default=None)
    ap.add_argument("--shapes", type=int, default=0, help="also print this many ops grouped by input shapes")
    ap.add_argument("--gaps", type=int, default=0, help="also print where the device waited for the host")
    ap.add_argument("--host", type=int, default=0, help="also print this many outermost host ops a thread by host time")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from msa_model.training.trainer import Trainer

    original = Trainer.train_step

    def train_step(self):
        if self.state.step + 1 != a.step:
            return original(self)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=a.shapes > 0) as prof:
            start = time.perf_counter()
            out = original(self)
            torch.cuda.synchronize()
            wall = (time.perf_counter() - start) * 1e3
        events = prof.key_averages()
        device_ms = sum(e.self_device_time_total for e in events
                        if e.device_type.name == "CUDA" and not _annotation(e)) / 1e3
        print(f"profiled step {a.step}: wall {wall:.1f} ms, kernels {device_ms:.1f} ms "
              f"({device_ms / wall:.0%} of the wall time busy)", flush=True)
        print(events.table(sort_by="self_device_time_total", row_limit=a.rows, max_name_column_width=70), flush=True)
        if a.shapes:
            print(prof.key_averages(group_by_input_shape=True).table(
                sort_by="self_device_time_total", row_limit=a.shapes, max_name_column_width=40,
                max_shapes_column_width=90), flush=True)
        if a.gaps:
            idle_gaps(prof.events(), a.gaps)
        if a.host:
            print_host(prof.events(), a.host)
        if a.trace:
            prof.export_chrome_trace(a.trace)
        return out

    Trainer.train_step = train_step
    sys.argv = ["train.py", *a.overrides]
    import runpy

    runpy.run_path(str(REPO / "train.py"), run_name="__main__")


if __name__ == "__main__":
    main()
