"""trainer.deterministic=true on the GPU: two runs of one config give the same losses and weights
bit for bit, and a run stopped half-way and resumed continues exactly; the mode's cost in tokens/s.

    PYTHONPATH=. python bench/check_deterministic.py --out $OUT [--work /tmp/msa-deterministic]
        [--preset small] [--steps 20] [--stop 10] [--seq 8192] [--batch 4] [--warmup-steps 6]
        [-- key=value ...]

Four `train.py` runs of the preset (`recipe=pt`, packed documents masked, the indexer warmup for
the first `--warmup-steps` steps, then top-k), one after another on one GPU:
  a       deterministic, --steps steps, a checkpoint at the end
  b       deterministic, stopped after --stop steps (`trainer.stop_at_step`), then resumed to --steps
  base    the same config without the mode (its tokens/s is the yardstick)
Checks: every logged number of every step (losses, KL, aux loss, gradient norms, lr, keys per
query) equal between a and b, as written by the runs (JSON floats round-trip exactly); every
tensor of the last checkpoints of a and b (weights and optimizer moments) equal. Prints one line
per check and the tokens/s of a against base (median over the steps after the first two, and
after the resume for b); writes OUT/deterministic.json and OUT/runs.log (the runs' output); the
run directories, checkpoints and data cache go to --work. Exits 1 if anything differs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from msa_model.training.metrics_file import read_metrics

REPO = Path(__file__).resolve().parents[1]
COMPARED = ("lm_loss", "kl_loss", "moe_aux_loss", "grad_norm", "grad_norm_msa_index", "lr", "keys_per_query",
            "phase", "tokens")


def train(run_dir: Path, args: list[str], log: Path, timeout: int) -> None:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    start = time.time()
    proc = subprocess.run([sys.executable, "train.py", *args, f"run_dir={run_dir}"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    with open(log, "a") as f:
        f.write(proc.stdout + proc.stderr)
    print(f"{run_dir.name}: exit {proc.returncode} in {time.time() - start:.0f} s", flush=True)
    if proc.returncode != 0:
        sys.exit(f"{run_dir.name} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")


def rows(run_dir: Path) -> dict[int, dict]:
    return {rec["step"]: rec for rec in read_metrics(run_dir)}


def checkpoint_tensors(step_dir: Path, tmp: Path) -> dict:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(step_dir), str(tmp))
    return {k: v for k, v in torch.load(tmp, weights_only=False).items() if torch.is_tensor(v)}


def tokens_per_s(recs: dict[int, dict], first: int) -> float:
    values = [r["tokens_per_s"] for s, r in recs.items() if s >= first and "tokens_per_s" in r]
    return statistics.median(values) if values else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/msa-deterministic", help="run directories and the data cache")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--stop", type=int, default=10)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--warmup-steps", type=int, default=6)
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("extra", nargs="*", help="more train.py overrides (after --)")
    a = ap.parse_args()
    out, work = Path(a.out), Path(a.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    common = [f"model={a.preset}", "recipe=pt", f"model.seq_length={a.seq}", "parallel.micro_batch_size=1",
              f"parallel.global_batch_size={a.batch}", f"trainer.max_steps={a.steps}",
              f"trainer.indexer_warmup_tokens={a.warmup_steps * a.batch * a.seq}", "optim.warmup_steps=2",
              "logging.log_interval=1", "logging.wandb_mode=disabled", "logging.tensorboard=false",
              "logging.progress_bar=false", "checkpoint.interval=0", f"data.cache_dir={work / 'data'}",
              "resume=auto", *a.extra]
    det = [*common, "trainer.deterministic=true"]
    log = out / "runs.log"
    train(work / "a", det, log, a.timeout)
    train(work / "b", [*det, f"trainer.stop_at_step={a.stop}"], log, a.timeout)
    train(work / "b", det, log, a.timeout)
    train(work / "base", [*common, "checkpoint.save_at_end=false"], log, a.timeout)

    ra, rb, rbase = rows(work / "a"), rows(work / "b"), rows(work / "base")
    steps = list(range(1, a.steps + 1))
    differing = [s for s in steps if s not in ra or s not in rb
                 or any(ra[s].get(k) != rb[s].get(k) for k in COMPARED)]
    print(f"losses: {'identical' if not differing else 'DIFFER at steps ' + str(differing)} over steps 1-{a.steps} "
          f"(b stopped after step {a.stop} and resumed)")
    name = f"step_{a.steps:08d}"
    ta = checkpoint_tensors(work / "a" / "checkpoints" / name, work / "a.pt")
    tb = checkpoint_tensors(work / "b" / "checkpoints" / name, work / "b.pt")
    tensor_diffs = sorted(set(ta) ^ set(tb)) + [k for k in ta if k in tb and not bool((ta[k] == tb[k]).all())]
    print(f"checkpoint {name}: {len(ta)} tensors, "
          f"{'identical' if not tensor_diffs else 'DIFFER: ' + ', '.join(tensor_diffs[:8])}")
    # the non-deterministic baseline's losses, for scale: how far apart ordinary runs already are
    base_gap = max(abs(ra[s]["lm_loss"] - rbase[s]["lm_loss"]) for s in steps if s in rbase)
    speed = {"deterministic": tokens_per_s(ra, 3), "resumed": tokens_per_s(rb, a.stop + 3),
             "base": tokens_per_s(rbase, 3)}
    cost = speed["deterministic"] / speed["base"]
    print(f"tokens/s: deterministic {speed['deterministic']:,.0f}, without the mode {speed['base']:,.0f} "
          f"({cost:.3f}x); largest lm-loss gap to the run without the mode {base_gap:.2e}")
    result = {"steps": a.steps, "stop": a.stop, "preset": a.preset, "seq": a.seq, "batch": a.batch,
              "differing_steps": differing, "differing_tensors": tensor_diffs, "tensors": len(ta),
              "tokens_per_s": speed, "cost": cost, "lm_loss_gap_to_base": base_gap,
              "lm_loss": {s: ra[s]["lm_loss"] for s in steps if s in ra}}
    (out / "deterministic.json").write_text(json.dumps(result, indent=1))
    for tmp in (work / "a.pt", work / "b.pt"):
        tmp.unlink(missing_ok=True)
    sys.exit(1 if differing or tensor_diffs else 0)


if __name__ == "__main__":
    main()
