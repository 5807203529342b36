"""Which index-branch initialisation trains the indexer faster when a dense model becomes MSA?

    python scripts/convert_index_init_compare.py [--work runs/index_init] [--dense-steps 300] [--warmup-steps 60]

1. trains the dense-attention baseline (recipe=dense) of a small GQA model on CPU, so that its
   attention has structure worth imitating (a random teacher's attention is near uniform);
2. converts it with `dense-to-msa` once per index init (derived, and random with two seeds);
3. runs the CPT indexer-warmup phase (dense attention, KL training the index branch) from each,
   with the same data and seed, and reads the per-step KL from metrics.jsonl.

Prints a markdown table: KL at the first step (before any update), along the warmup, and the
first step at which it reaches --kl-target. Finished stages are reused when re-run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from msa_model.training.metrics_file import read_metrics

REPO = Path(__file__).resolve().parents[1]

SEQ_LENGTH, GLOBAL_BATCH = 256, 8
# a GQA geometry with 4 query heads per group (production has 16), short context for CPU
MODEL = ["model=tiny", "model.num_attention_heads=8", "model.num_query_groups=2", "model.head_dim=32",
         f"model.seq_length={SEQ_LENGTH}", "model.msa.block_size=32", "model.msa.topk=4", "model.msa.index_head_dim=32"]
COMMON = ["data.max_bytes=2000000", "parallel.micro_batch_size=4", f"parallel.global_batch_size={GLOBAL_BATCH}",
          "logging.wandb_mode=disabled", "logging.tensorboard=false", "logging.log_interval=1",
          "logging.progress_bar=false", "checkpoint.interval=0", "trainer.stop_signals=[]"]


def train(overrides: list[str]) -> None:
    cmd = [sys.executable, str(REPO / "train.py"), *overrides]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=REPO, check=True)


def kl_curve(run_dir: Path) -> list[float]:
    return [r["kl_loss"] for r in read_metrics(run_dir) if r.get("kl_loss") is not None]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="runs/index_init")
    p.add_argument("--dense-steps", type=int, default=300)
    p.add_argument("--warmup-steps", type=int, default=60)
    p.add_argument("--kl-target", type=float, default=0.3, help="report the first step with KL <= this")
    args = p.parse_args()
    work = (REPO / args.work).resolve()

    dense_dir = work / "dense"
    if not (dense_dir / "checkpoints" / "latest").is_file():
        train(["recipe=dense", *MODEL, *COMMON, f"run_dir={dense_dir}", f"trainer.max_steps={args.dense_steps}",
               f"optim.warmup_steps={min(20, args.dense_steps // 2)}"])

    inits = {"derived": ("derived", 0), "random (seed 0)": ("random", 0), "random (seed 1)": ("random", 1)}
    curves = {}
    for label, (method, seed) in inits.items():
        tag = f"{method}{seed}"
        conv = work / f"msa-{tag}"
        if not (conv / "latest").is_file():
            subprocess.run([sys.executable, "-m", "msa_model.convert", "dense-to-msa", str(dense_dir / "checkpoints"),
                            str(conv), "--index-init", method, "--seed", str(seed), "--name", f"msa-{tag}"],
                           cwd=REPO, check=True)
        run = work / f"warmup-{tag}"
        if not (run / "metrics.jsonl").is_file():
            # every step is indexer warmup (the switch to top-k falls after the last one); same data
            # order and seed for every init
            run_tokens = args.warmup_steps * GLOBAL_BATCH * SEQ_LENGTH
            train(["recipe=cpt", f"hydra.searchpath=[file://{conv}]", f"model=msa-{tag}", *COMMON, f"run_dir={run}",
                   f"init_from={conv}", f"trainer.max_steps={args.warmup_steps}",
                   f"trainer.indexer_warmup_tokens={run_tokens - 1}",
                   f"optim.warmup_steps={min(5, args.warmup_steps // 2)}", "checkpoint.save_at_end=false"])
        curves[label] = kl_curve(run)

    marks = [1, 5, 10, 20, 40, args.warmup_steps]
    marks = sorted({m for m in marks if m <= args.warmup_steps})
    print("\n| index init | " + " | ".join(f"KL step {m}" for m in marks) + f" | first step with KL <= {args.kl_target} |")
    print("|---|" + "---|" * (len(marks) + 1))
    for label, kl in curves.items():
        reached = next((i + 1 for i, v in enumerate(kl) if v <= args.kl_target), None)
        print(f"| {label} | " + " | ".join(f"{kl[m - 1]:.4f}" for m in marks) + f" | {reached or 'not reached'} |")
    (work / "summary.json").write_text(json.dumps(curves, indent=1))


if __name__ == "__main__":
    main()
