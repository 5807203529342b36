"""Quality experiment: dense vs MSA-PT vs MSA-CPT at equal tokens, then the long-context eval, loss
curves and a results table. Resumable: every call does what its time budget allows and the next
call goes on (training jobs get SIGTERM before the budget ends, save and exit cleanly).

    python scripts/quality_experiment.py --work runs/quality --out OUT [--budget 480] [--tokens 30e6]
    python scripts/quality_experiment.py --preset tiny --work /tmp/q --out /tmp/q/out --tokens 24576   # CPU check

With `--gpus 0,1` two lanes run side by side: dense, convert and CPT on the first GPU, PT on the
second (it starts once the dense run has built the data cache they share).

Stages, each skipped once done:
    dense-mid   recipe=dense up to half the steps (checkpoint there)
    convert     that checkpoint -> MSA (`python -m msa_model.convert dense-to-msa`): the CPT start
    dense       recipe=dense to the end
    pt          recipe=pt from scratch, indexer warmup for `--warmup-share` of the tokens
    cpt         recipe=cpt from the converted mid-way checkpoint for the other half of the steps,
                the same warmup tokens (so it has seen as many tokens as the others at its end)
    eval-*      python -m msa_model.eval on each final checkpoint (MSA in the sparse phase)
    report      <work>/report/quality.md (table, targets met or missed), loss_curves.png; copied
                with the eval results to --out
All runs read the same corpus (default: this interpreter's site-packages) with the same share of
synthetic retrieval documents; MSA runs log diagnostics (recall@k) every `diag` steps.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRESETS = {
    # one H200: 8K context, 8 x 8K tokens a step
    "small": {"model": "small", "micro": 4, "gbs": 8, "log": 10, "diag": 50, "samples": 2, "loss_sequences": 4,
              "lengths": [1024, 2048, 4096, 8192, 16384, 32768], "max_bytes": 200_000_000},
    # CPU check of the whole pipeline
    "tiny": {"model": "tiny", "micro": 2, "gbs": 4, "log": 2, "diag": 4, "samples": 1, "loss_sequences": 2,
             "lengths": [256, 512], "max_bytes": 4_000_000},
}
SAVE_MARGIN_S = 90  # a checkpoint save of `small` plus the last step, before the call's budget ends


class Budget:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _env(gpu: str | None) -> dict:
    return dict(os.environ, CUDA_VISIBLE_DEVICES=gpu) if gpu is not None else dict(os.environ)


def latest_step(run_dir: Path) -> int:
    pointer = run_dir / "checkpoints" / "latest"
    return int(pointer.read_text().strip().split("_")[-1]) if pointer.is_file() else 0


def train(name: str, args, common: list[str], extra: list[str], until: int, max_steps: int, budget: Budget,
          gpu: str | None = None) -> bool:
    """Train `name` (a run of `max_steps`) until its latest checkpoint is at step `until`; False when
    the budget ran out."""
    run_dir = Path(args.work) / name
    if latest_step(run_dir) >= until:
        return True
    if budget.left() < SAVE_MARGIN_S + 60:
        return False
    stop = [f"trainer.stop_at_step={until}"] if until < max_steps else []
    cmd = [sys.executable, "train.py", *common, f"trainer.max_steps={max_steps}", *extra, *stop, f"run_dir={run_dir}"]
    say(f"{name}: training from step {latest_step(run_dir)} to {until} (log: {run_dir}.log)")
    with open(f"{run_dir}.log", "a") as logf:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=logf, stderr=subprocess.STDOUT, env=_env(gpu))
        while proc.poll() is None:
            if budget.left() < SAVE_MARGIN_S:
                say(f"{name}: budget reached, SIGTERM (the job saves and exits)")
                proc.send_signal(signal.SIGTERM)
                proc.wait()
                break
            time.sleep(2)
    if proc.returncode != 0:
        tail = Path(f"{run_dir}.log").read_text()[-3000:]
        raise SystemExit(f"{name}: train.py failed ({proc.returncode}):\n{tail}")
    say(f"{name}: at step {latest_step(run_dir)} of {until}")
    return latest_step(run_dir) >= until


def convert(args, mid: int, budget: Budget, gpu: str | None = None) -> bool:
    out = Path(args.work) / "cpt-init"
    if (out / "latest").is_file():
        return True
    if budget.left() < 120:
        return False
    src = Path(args.work) / "dense" / "checkpoints"
    if latest_step(src.parent) != mid:
        raise SystemExit(f"convert: {src} is at step {latest_step(src.parent)}, the CPT start must be step {mid}")
    say(f"convert: dense step {mid} -> {out}")
    subprocess.run([sys.executable, "-m", "msa_model.convert", "dense-to-msa", str(src), str(out)], cwd=REPO,
                   check=True, env=_env(gpu))
    return True


def evaluate(name: str, args, preset: dict, budget: Budget, gpu: str | None = None) -> bool:
    out = Path(args.work) / "eval" / name
    if (out / "results.json").is_file():
        return True
    if budget.left() < args.eval_seconds:
        return False
    lengths = ",".join(str(n) for n in preset["lengths"])
    cmd = [sys.executable, "-m", "msa_model.eval", str(Path(args.work) / name), "--out", str(out), "--lengths", lengths,
           "--samples", str(preset["samples"]), "--loss-sequences", str(preset["loss_sequences"]),
           "--corpus", args.corpus, "--label", name]
    say(f"eval {name}: lengths {lengths}")
    with open(Path(args.work) / f"eval-{name}.log", "a") as logf:
        try:
            subprocess.run(cmd, cwd=REPO, stdout=logf, stderr=subprocess.STDOUT, check=True,
                           timeout=max(60, budget.left() - 30), env=_env(gpu))
        except subprocess.TimeoutExpired:
            say(f"eval {name}: out of budget; it restarts in the next call (raise --eval-seconds)")
            return False
    return True


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def report(args, preset: dict, offset_tokens: int) -> Path:
    """Loss curves (PNG) and the table with the targets, in <work>/report."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    work = Path(args.work)
    out = work / "report"
    out.mkdir(parents=True, exist_ok=True)
    runs = {name: _records(work / name / "metrics.jsonl") for name in ("dense", "pt", "cpt")}
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, recs in runs.items():
        shift = offset_tokens if name == "cpt" else 0
        ax.plot([(r["tokens"] + shift) / 1e6 for r in recs], [r["lm_loss"] for r in recs], label=name, lw=1)
    ax.set_xlabel("tokens seen (M; CPT includes the dense half it starts from)")
    ax.set_ylabel("lm loss")
    ax.set_ylim(top=min(6.0, ax.get_ylim()[1]))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(out / "loss_curves.png", dpi=110, bbox_inches="tight")
    plt.close(fig)

    evals = {n: json.loads(p.read_text()) for n in runs if (p := work / "eval" / n / "results.json").is_file()}
    budget_keys = next((e["key_budget"] for e in evals.values() if e.get("key_budget")), None)
    far = str(4 * budget_keys) if budget_keys else None

    def final(recs, key="lm_loss", last=5):
        vals = [r[key] for r in recs[-last:] if key in r]
        return sum(vals) / len(vals) if vals else None

    def recall(recs):
        vals = [r["msa/recall"] for r in recs if r.get("phase") == "sparse" and "msa/recall" in r]
        return vals[-1] if vals else None

    dense_loss = final(runs["dense"])
    lines = [f"Preset `{args.preset}`, {args.steps} steps of {preset['gbs']} x {args.seq_length} tokens "
             f"({args.steps * preset['gbs'] * args.seq_length / 1e6:.1f}M tokens per run), indexer warmup "
             f"{args.warmup_tokens / 1e6:.2f}M tokens, retrieval share {args.retrieval_share}, corpus {args.corpus}.",
             "Final lm loss: mean of the last 5 logged intervals; recall@k: the last diagnostics in the sparse phase; "
             f"retrieval: exact match over tasks and depths.", "",
             f"| run | final lm loss | vs dense | final KL | recall@k | retrieval acc {min(preset['lengths'])} | "
             + (f"retrieval acc {far} (4x key budget) |" if far else "retrieval acc (longest) |"),
             "|---|---|---|---|---|---|---|"]
    acc_far = {}
    for name, recs in runs.items():
        loss = final(recs)
        e = evals.get(name)
        acc = e["accuracy_by_length"] if e else {}
        key = far if far and far in acc else (max(acc, key=int) if acc else None)
        acc_far[name] = acc.get(key) if key else None
        fmt = lambda v, f=".3f": "-" if v is None else format(v, f)  # noqa: E731
        rel = None if loss is None or dense_loss is None else 100 * (loss - dense_loss) / dense_loss
        lines.append(f"| {name} | {fmt(loss)} | {'-' if rel is None or name == 'dense' else f'{rel:+.2f}%'} | "
                     f"{fmt(final(recs, 'kl_loss'))} | {fmt(recall(recs))} | {fmt(acc.get(str(min(map(int, acc)))) if acc else None, '.2f')} | "
                     f"{fmt(acc_far[name], '.2f')} |")
    lines += ["", "Targets:"]
    for name in ("pt", "cpt"):
        loss, rc = final(runs[name]), recall(runs[name])
        if loss is not None and dense_loss is not None:
            rel = 100 * (loss - dense_loss) / dense_loss
            lines.append(f"- {name} final loss within 1% of dense: {'met' if rel <= 1.0 else 'missed'} ({rel:+.2f}%)")
        if rc is not None:
            lines.append(f"- {name} recall@k >= 0.9 after warmup: {'met' if rc >= 0.9 else 'missed'} ({rc:.3f})")
        if acc_far.get(name) is not None and acc_far.get("dense") is not None:
            gap = 100 * (acc_far[name] - acc_far["dense"])
            # a dense run that does not retrieve at all leaves nothing to be within 5 points of
            verdict = ("not measured: the dense run does not retrieve either" if acc_far["dense"] == 0
                       else "met" if gap >= -5 else "missed")
            lines.append(f"- {name} retrieval at 4x the key budget within 5 points of dense: {verdict} "
                         f"({gap:+.1f} points)")
    for name, e in evals.items():
        lines += ["", (work / "eval" / name / "results.md").read_text()]
    (out / "quality.md").write_text("\n".join(lines) + "\n")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="runs/quality", help="runs, evals and the report (kept between calls)")
    p.add_argument("--out", default=None, help="copy the report and eval results here at the end of every call")
    p.add_argument("--budget", type=float, default=480, help="seconds this call may use")
    p.add_argument("--preset", choices=sorted(PRESETS), default="small")
    p.add_argument("--tokens", type=float, default=30e6, help="training tokens per run (rounded to whole steps)")
    p.add_argument("--warmup-share", type=float, default=0.05, help="indexer warmup, share of --tokens")
    p.add_argument("--retrieval-share", type=float, default=0.05, help="data.retrieval_share of every run")
    p.add_argument("--corpus", default=sysconfig.get_paths()["purelib"], help="data.source (default: site-packages)")
    p.add_argument("--eval-seconds", type=float, default=240, help="do not start an eval with less budget left")
    p.add_argument("--gpus", default=None, help="two GPUs (e.g. 0,1): dense lane and PT lane side by side")
    p.add_argument("--dry-run", action="store_true", help="print the plan and the commands' settings only")
    args = p.parse_args(argv)
    preset = PRESETS[args.preset]
    budget = Budget(args.budget)

    args.seq_length = 8192 if args.preset == "small" else 512
    step_tokens = preset["gbs"] * args.seq_length
    args.steps = max(4, round(args.tokens / step_tokens))
    args.steps += args.steps % 2
    mid = args.steps // 2
    args.warmup_tokens = max(2 * step_tokens, round(args.warmup_share * args.steps * step_tokens / step_tokens) * step_tokens)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    common = [f"model={preset['model']}", f"parallel.micro_batch_size={preset['micro']}",
              f"parallel.global_batch_size={preset['gbs']}", f"logging.log_interval={preset['log']}",
              "logging.wandb_mode=disabled", "logging.progress_bar=false", "checkpoint.interval=0", "checkpoint.keep=1",
              f"data.source={args.corpus}", f"data.max_bytes={preset['max_bytes']}", f"data.cache_dir={work / 'data'}",
              f"data.retrieval_share={args.retrieval_share}", "optim.warmup_steps=10" if args.preset == "small"
              else "optim.warmup_steps=1"]
    msa = [f"trainer.indexer_warmup_tokens={args.warmup_tokens}", f"logging.msa_diagnostics_interval={preset['diag']}"]
    say(f"plan: {args.steps} steps x {step_tokens:,} tokens = {args.steps * step_tokens / 1e6:.1f}M tokens per run; "
        f"CPT from dense step {mid}; indexer warmup {args.warmup_tokens:,} tokens; budget {args.budget:.0f} s")
    if args.dry_run:
        print(" ".join(common + [f"trainer.max_steps={args.steps}"] + msa))
        return 0

    n = args.steps
    gpus = args.gpus.split(",") if args.gpus else [None]
    if len(gpus) > 2:
        raise SystemExit(f"--gpus takes one or two GPUs, got {args.gpus}")

    def dense_lane(gpu):
        return (train("dense", args, common, ["recipe=dense"], mid, n, budget, gpu)
                and convert(args, mid, budget, gpu)
                and train("dense", args, common, ["recipe=dense"], n, n, budget, gpu)
                and train("cpt", args, common, ["recipe=cpt", f"init_from={work / 'cpt-init'}", *msa], mid, mid,
                          budget, gpu)
                and all([evaluate(name, args, preset, budget, gpu) for name in ("dense", "cpt")]))

    def pt_lane(gpu):
        return (train("pt", args, common, ["recipe=pt", *msa], n, n, budget, gpu)
                and evaluate("pt", args, preset, budget, gpu))

    if len(gpus) == 1:
        done = dense_lane(gpus[0]) and pt_lane(gpus[0])
    else:
        results = {}

        def second():
            # the runs share the data cache: let the dense run build it first
            while not (work / "dense" / "metrics.jsonl").is_file() and budget.left() > SAVE_MARGIN_S + 60:
                if "dense" in results:
                    break
                time.sleep(5)
            try:
                results["pt"] = pt_lane(gpus[1])
            except SystemExit as e:  # a thread would swallow it
                say(str(e))
                results["pt"] = False

        lane = threading.Thread(target=second)
        lane.start()
        try:
            results["dense"] = dense_lane(gpus[0])
        finally:
            results.setdefault("dense", False)
            lane.join()
        done = results["dense"] and results.get("pt", False)
    out = report(args, preset, mid * step_tokens)
    if args.out:
        dest = Path(args.out)
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copytree(out, dest / "report", dirs_exist_ok=True)
        if (work / "eval").is_dir():
            shutil.copytree(work / "eval", dest / "eval", dirs_exist_ok=True)
        for name in ("dense", "pt", "cpt"):
            for f in ("metrics.jsonl", "train.log"):
                if (work / name / f).is_file():
                    (dest / name).mkdir(exist_ok=True)
                    shutil.copy(work / name / f, dest / name / f)
            if (work / name / "diagnostics").is_dir():
                shutil.copytree(work / name / "diagnostics", dest / name / "diagnostics", dirs_exist_ok=True)
    say("all stages done; report in " + str(out) if done else "not finished: run the same command again to go on")
    return 0 if done else 3


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
