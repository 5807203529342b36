"""Profile one training step of a real `train.py` run: the kernels that take the device time, and
how long the host took to issue them.

    PYTHONPATH=. python bench/profile_step.py [--step 3] [--rows 30] [--shapes 40] [--trace FILE] -- key=value ...

Runs train.py with the given overrides in this process; step --step (after compilation and
warm-up) runs under torch.profiler. Prints the step's wall time, the device time summed over
kernels, and the top kernels by device time; --shapes N also the N ops of most device time per input shape (which
tensors the elementwise work runs on); --trace writes a Chrome trace.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--step", type=int, default=3)
    ap.add_argument("--rows", type=int, default=30)
    ap.add_argument("--trace", default=None)
    ap.add_argument("--shapes", type=int, default=0, help="also print this many ops grouped by input shapes")
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
        device_ms = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA") / 1e3
        print(f"profiled step {a.step}: wall {wall:.1f} ms, kernels {device_ms:.1f} ms "
              f"({device_ms / wall:.0%} of the wall time busy)", flush=True)
        print(events.table(sort_by="self_device_time_total", row_limit=a.rows, max_name_column_width=70), flush=True)
        if a.shapes:
            print(prof.key_averages(group_by_input_shape=True).table(
                sort_by="self_device_time_total", row_limit=a.shapes, max_name_column_width=40,
                max_shapes_column_width=90), flush=True)
        if a.trace:
            prof.export_chrome_trace(a.trace)
        return out

    Trainer.train_step = train_step
    sys.argv = ["train.py", *a.overrides]
    import runpy

    runpy.run_path(str(REPO / "train.py"), run_name="__main__")


if __name__ == "__main__":
    main()
