"""The quality study's report (scripts/quality_experiment.py): per run its final loss and
diagnostics from metrics.jsonl, per arm the mean and std over seeds and the paired difference to
its reference arm (same seed), as JSON and markdown; the loss curves; the archive of every run's
records and logs that another call can --import."""

from __future__ import annotations

import json
import math
import os
import statistics
import tarfile
from pathlib import Path

from msa_model.training.metrics_file import PROBE_METRICS, probe_scores, read_metrics


def _mean(values):
    return statistics.mean(values) if values else None


def _std(values):
    return statistics.stdev(values) if len(values) >= 2 else None


def run_summary(study, run) -> dict:
    """One run (a quality_experiment.Run of the Study `study`): its final loss and KL (done runs
    only), last recall@k, median tokens/s, peak memory, eval accuracy."""
    recs = read_metrics(run.dir)
    w = study.args.final_window or study.preset["final_window"]
    last = recs[-w:]

    def mean_of(key, rows):
        vals = [r[key] for r in rows if key in r and r[key] is not None and math.isfinite(r[key])]
        return _mean(vals)

    sparse = [r for r in recs if r.get("phase") == "sparse" and "msa/recall" in r]
    out = {"seed": run.seed, "done": study.done(run), "step": recs[-1]["step"] if recs else 0, "steps": run.steps,
           "final_lm_loss": mean_of("lm_loss", last) if study.done(run) else None,
           "final_kl": mean_of("kl_loss", last) if study.done(run) else None,
           # held-out text (data.split / data.valid_blend with trainer.eval_interval): the last evaluation
           "final_valid_loss": next((r["valid/lm_loss"] for r in reversed(recs) if "valid/lm_loss" in r), None)
           if study.done(run) else None,
           "recall": sparse[-1]["msa/recall"] if sparse else None,
           # how often the block before a query's own is selected, and in the oracle's top-k
           "previous_block": sparse[-1].get("msa/previous_block") if sparse else None,
           "previous_block_oracle": sparse[-1].get("msa/previous_block_oracle") if sparse else None,
           "tokens_per_s": statistics.median([r["tokens_per_s"] for r in recs[1:]]) if len(recs) > 1 else None,
           "peak_mem_gib": max((r["peak_mem_gib"] for r in recs if "peak_mem_gib" in r), default=None)}
    probed = [r for r in recs if probe_scores(r)]
    if probed:
        # the latest probe, finished or not: its step says when
        last_probe = probed[-1]
        out["probe"] = {"step": last_probe["step"], "tasks": probe_scores(last_probe)}
    if (run.dir / "parent.json").is_file():
        out["parent_retrained"] = json.loads((run.dir / "parent.json").read_text())["retrained"]
    res = study.eval_dir(run) / "results.json"
    if res.is_file():
        e = json.loads(res.read_text())
        by_offset = e["loss_by_position"].get("by_block_offset") or {}
        needle = {key: {n: _mean([per[n][key] for per in e["tasks"].values() if per.get(n, {}).get(key) is not None])
                        for n in e["accuracy_by_length"]} for key in ("needle_selected", "needle_chance")}
        out["eval"] = {"accuracy_by_length": e["accuracy_by_length"], "key_budget": e.get("key_budget"),
                       # behind each length's accuracy: examples of every task at every depth
                       "examples": e["samples"] * len(e["depths"]) * len(e["tasks"]),
                       "start_excess": by_offset.get("start_excess"),
                       "start_excess_se": by_offset.get("start_excess_se"), **needle}
    return out


def _probe_summary(entry: dict, ref: dict | None) -> dict | None:
    """Per task the mean over seeds of the latest probe's metrics, and the paired differences to
    the reference arm's probe at the same step (same seed)."""
    runs = {seed: v["probe"] for seed, v in entry["runs"].items() if "probe" in v}
    if not runs:
        return None
    tasks = sorted({t for p in runs.values() for t in p["tasks"]})
    out = {"steps": sorted({p["step"] for p in runs.values()}), "tasks": {}}
    for task in tasks:
        row = {m: _mean([p["tasks"][task][m] for p in runs.values() if task in p["tasks"]]) for m in PROBE_METRICS}
        if ref is not None:
            for m in PROBE_METRICS:
                diffs = [p["tasks"][task][m] - ref["runs"][seed]["probe"]["tasks"][task][m]
                         for seed, p in runs.items() if task in p["tasks"]
                         and "probe" in ref["runs"].get(seed, {}) and task in ref["runs"][seed]["probe"]["tasks"]
                         and ref["runs"][seed]["probe"]["step"] == p["step"]]
                row[f"paired_{m}"], row["paired_n"] = _mean(diffs), len(diffs)
        out["tasks"][task] = row
    return out


def summarize(study) -> dict:
    """Every arm of the study: its runs, the mean and std of their final losses, and the paired
    difference to its reference arm over the seeds both finished."""
    arms = {}
    for name, arm in study.arms.items():
        runs = {r.seed: run_summary(study, r) for r in study.runs.values() if r.arm.name == name}
        losses = [v["final_lm_loss"] for v in runs.values() if v["final_lm_loss"] is not None]
        entry = {"base": arm.base, "ref": arm.ref, "overrides": arm.overrides, "runs": runs, "n": len(losses),
                 "mean": _mean(losses), "std": _std(losses)}
        for key in ("final_kl", "recall", "previous_block", "previous_block_oracle", "tokens_per_s",
                    "final_valid_loss"):
            entry[key] = _mean([v[key] for v in runs.values() if v[key] is not None])
        entry["peak_mem_gib"] = max((v["peak_mem_gib"] for v in runs.values() if v["peak_mem_gib"]), default=None)
        arms[name] = entry
    for name, entry in arms.items():
        ref = arms.get(entry["ref"]) if entry["ref"] else None
        if ref is None:
            continue
        pairs = [(v["final_lm_loss"], ref["runs"][seed]["final_lm_loss"]) for seed, v in entry["runs"].items()
                 if v["final_lm_loss"] is not None and seed in ref["runs"]
                 and ref["runs"][seed]["final_lm_loss"] is not None]
        diffs = [a - b for a, b in pairs]
        p = {"n": len(diffs), "mean": _mean(diffs), "std": _std(diffs), "rel_pct": None, "exceeds_2_seed_std": None}
        if diffs:
            p["rel_pct"] = 100 * p["mean"] / _mean([b for _, b in pairs])
        if diffs and ref["std"] is not None:
            p["exceeds_2_seed_std"] = abs(p["mean"]) > 2 * ref["std"]
        valid = [v["final_valid_loss"] - ref["runs"][seed]["final_valid_loss"] for seed, v in entry["runs"].items()
                 if v["final_valid_loss"] is not None and seed in ref["runs"]
                 and ref["runs"][seed]["final_valid_loss"] is not None]
        p["valid_mean"], p["valid_n"] = _mean(valid), len(valid)
        entry["paired"] = p
    for name, entry in arms.items():
        entry["probe"] = _probe_summary(entry, arms.get(entry["ref"]) if entry["ref"] else None)
    return {"preset": study.args.preset, "steps": study.steps, "mid": study.mid, "step_tokens": study.step_tokens,
            "tokens_per_run": study.steps * study.step_tokens, "warmup_tokens": study.warmup_tokens,
            "seeds": study.args.seeds, "arms": arms}


def _per_length(arm: dict, key: str, lengths: list[int]) -> dict:
    """{length: the mean over the arm's evaluated runs of their eval[key][length] (None: none)}."""
    return {n: _mean([v["eval"][key][str(n)] for v in arm["runs"].values() if "eval" in v
                      and (v["eval"].get(key) or {}).get(str(n)) is not None]) for n in lengths}


def _fmt(v, spec=".3f", signed=False):
    if v is None:
        return "-"
    return format(v, ("+" if signed else "") + spec)


def markdown(summary: dict, study, call: dict) -> str:
    s = summary
    lines = [f"# Quality study ({s['preset']})", "",
             f"{s['steps']} steps of {study.args.gbs} x {study.args.seq_length} tokens = {s['tokens_per_run'] / 1e6:.2f}M "
             f"tokens per run" + (f" (CPT: the dense run's last {s['steps'] - s['mid']} steps)"
                                  if any(a["base"] == "cpt" for a in s["arms"].values()) else "")
             + f"; seeds 0-{s['seeds'] - 1} "
             f"(trainer.seed; {'each seed its own data order, data.seed' if getattr(study.args, 'vary_data', False) else 'the same data order for every seed'}); indexer warmup {s['warmup_tokens']:,} tokens; "
             f"lr {study.args.lr} -> {study.args.min_lr} cosine. Final lm loss: mean of the last "
             f"{study.args.final_window or study.preset['final_window']} logged intervals. Paired: the arm's final loss "
             "minus its reference's, same seed.", "",
             "| arm | base | vs | runs done | final lm loss (mean ± std) | paired diff (mean ± std, n) | rel | "
             "> 2 x ref seed std | valid loss (paired diff) | final KL | recall@k | previous block (oracle) | "
             "tok/s per run | peak GiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, a in s["arms"].items():
        p = a.get("paired") or {}
        exceeds = p.get("exceeds_2_seed_std")
        lines.append(
            f"| {name} | {a['base']} | {a['ref'] or '-'} | {a['n']}/{len(a['runs'])} | {_fmt(a['mean'], '.4f')} ± "
            f"{_fmt(a['std'], '.4f')} | {_fmt(p.get('mean'), '.4f', True)} ± {_fmt(p.get('std'), '.4f')} "
            f"({p.get('n', '-')}) | {_fmt(p.get('rel_pct'), '.2f', True)}{'%' if p.get('rel_pct') is not None else ''}"
            f" | {'-' if exceeds is None else ('yes' if exceeds else 'no')} | {_fmt(a['final_valid_loss'], '.4f')} "
            f"({_fmt(p.get('valid_mean'), '.4f', True)}) | {_fmt(a['final_kl'])} | "
            f"{_fmt(a['recall'])} | {_fmt(a['previous_block'], '.2f')} ({_fmt(a['previous_block_oracle'], '.2f')}) | "
            f"{_fmt(a['tokens_per_s'], ',.0f')} | {_fmt(a['peak_mem_gib'], '.1f')} |")
    seeds = sorted({seed for a in s["arms"].values() for seed in a["runs"]})
    lines += ["", "Per seed (final lm loss; `at N` = not finished, at step N):", "",
              "| arm | " + " | ".join(f"seed {x}" for x in seeds) + " |", "|---|" + "---|" * len(seeds)]
    for name, a in s["arms"].items():
        cells = []
        for x in seeds:
            v = a["runs"].get(x)
            cells.append("-" if v is None else _fmt(v["final_lm_loss"], ".4f") if v["done"] else f"at {v['step']}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    targets = []
    for name, a in s["arms"].items():
        p = a.get("paired")
        if a["base"] in ("pt", "cpt") and a["ref"] and s["arms"][a["ref"]]["base"] == "dense" and p and p["n"]:
            # one seed's gap is as likely the seed's as the method's: no verdict before two
            verdict = "undecided" if p["n"] < 2 else "met" if p["rel_pct"] <= 1.0 else "missed"
            targets.append(f"- {name} within 1% of {a['ref']}: {verdict} "
                           f"({p['rel_pct']:+.2f}% over {p['n']} seed(s)"
                           + (f"; gap {'exceeds' if p['exceeds_2_seed_std'] else 'within'} 2 x the seed std of "
                              f"{a['ref']}" if p["exceeds_2_seed_std"] is not None else "; seed std needs 2 seeds")
                           + ")")
    probes = {n: a["probe"] for n, a in s["arms"].items() if a.get("probe")}
    if probes:
        lines += ["", f"Retrieval probe during training (trainer.probe_tasks: at the full {study.args.seq_length}-token "
                  "context, teacher-forced, the same examples for every run; the latest probe of each run, mean "
                  "over seeds; paired: minus the reference's at the same step and seed). Exact: every answer "
                  "token the argmax; answer loss in nats a token (a random digit: 2.303):", "",
                  "| arm | step | task | exact (paired, points) | answer loss (paired) | answer rank |",
                  "|---|---|---|---|---|---|"]
        for name, pr in probes.items():
            for task, row in pr["tasks"].items():
                exact_diff = row.get("paired_exact")
                lines.append(
                    f"| {name} | {'/'.join(str(x) for x in pr['steps'])} | {task} | {_fmt(row['exact'], '.2f')} "
                    f"({_fmt(None if exact_diff is None else 100 * exact_diff, '.1f', True)}) | "
                    f"{_fmt(row['answer_loss'])} ({_fmt(row.get('paired_answer_loss'), '.3f', True)}) | "
                    f"{_fmt(row['answer_rank'], '.2f')} |")
    evals = {n: a for n, a in s["arms"].items() if any("eval" in v for v in a["runs"].values())}
    if evals:
        lines += ["", "Retrieval (exact match, mean over tasks and seeds):", ""]
        lengths = sorted({int(n) for a in evals.values() for v in a["runs"].values() if "eval" in v
                          for n in v["eval"]["accuracy_by_length"]})
        lines += ["| arm | " + " | ".join(str(n) for n in lengths) + " |", "|---|" + "---|" * len(lengths)]
        acc = {}
        for name, a in evals.items():
            acc[name] = _per_length(a, "accuracy_by_length", lengths)
            lines.append(f"| {name} | " + " | ".join(_fmt(acc[name][n], ".2f") for n in lengths) + " |")
            needle, chance = (_per_length(a, key, lengths) for key in ("needle_selected", "needle_chance"))
            if any(v is not None for v in needle.values()):
                lines.append(f"| {name}: needle block selected (random blocks) | " + " | ".join(
                    "-" if needle[n] is None else f"{needle[n]:.2f} ({chance[n]:.2f})" for n in lengths) + " |")
        excess = {}
        for name, a in evals.items():
            runs = [v["eval"] for v in a["runs"].values() if "eval" in v and v["eval"].get("start_excess") is not None]
            # the mean over seeds, its standard error from each run's
            se = math.sqrt(sum((r.get("start_excess_se") or 0.0) ** 2 for r in runs)) / len(runs) if runs else None
            excess[name] = (_mean([r["start_excess"] for r in runs]), se)
        if any(v[0] is not None for v in excess.values()):
            lines += ["", "Held-out loss at the first eighth of a key block's offsets minus its second half "
                      "(positions past the key budget, inside the context; mean over seeds ± standard error): "
                      + ", ".join(f"{name} {_fmt(m, '+.3f')} ± {_fmt(se, '.3f')}" for name, (m, se) in excess.items())
                      + ". An MSA arm above its dense reference: queries at a block's start miss the text just "
                      "before them."]
        for name, a in evals.items():
            budget = next((v["eval"]["key_budget"] for v in a["runs"].values() if "eval" in v), None)
            ref = a["ref"]
            if budget and ref in acc and 4 * budget in lengths:
                mine, theirs = acc[name][4 * budget], acc[ref][4 * budget]
                if mine is not None and theirs is not None:
                    verdict = ("not measured: the reference does not retrieve" if theirs == 0
                               else "met" if 100 * (mine - theirs) >= -5 else "missed")
                    # the accuracies' examples: a 5-point difference needs hundreds of them
                    n_mine, n_ref = (sum(v["eval"].get("examples", 0) for v in evals[arm]["runs"].values()
                                         if "eval" in v) for arm in (name, ref))
                    targets.append(f"- {name} retrieval at 4 x its key budget ({4 * budget}) within 5 points of "
                                   f"{ref}: {verdict} ({100 * (mine - theirs):+.1f} points over {n_mine} and "
                                   f"{n_ref} examples)")
    if targets:
        lines += ["", "Targets:", *targets]
    lines += ["", f"This call: {call['seconds']:.0f} s, {call['tokens'] / 1e6:.3g}M tokens trained by "
              f"{call['runs']} run(s), {call['tokens'] / max(call['seconds'], 1):,.0f} tokens/s together."]
    retrained = [f"{name}-s{seed}" for name, a in s["arms"].items() for seed, v in a["runs"].items()
                 if v.get("parent_retrained")]
    if retrained:
        lines += ["", f"Branched from a dense run re-trained to step {s['mid']} (its own checkpoint there was on "
                  "another machine): " + ", ".join(retrained) + ". Same seed and data, but not its exact weights "
                  "(GPU kernels are not bit-reproducible)."]
    if call["failed"]:
        lines += ["", "Failed: " + ", ".join(call["failed"]) + " (their logs are in runs.tar.gz)"]
    return "\n".join(lines) + "\n"


def plot(summary: dict, study, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    probed = any(a.get("probe") for a in summary["arms"].values())
    fig, axes = plt.subplots(1, 2 if probed else 1, figsize=(14 if probed else 8, 4.5), squeeze=False)
    ax, probe_ax = axes[0][0], axes[0][1] if probed else None
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, name in enumerate(summary["arms"]):
        for j, run in enumerate(r for r in study.runs.values() if r.arm.name == name):
            recs = read_metrics(run.dir)
            shift = study.mid * study.step_tokens if run.arm.base == "cpt" else 0
            ax.plot([(r["tokens"] + shift) / 1e6 for r in recs], [r["lm_loss"] for r in recs], lw=0.8,
                    color=colors[i % len(colors)], label=name if j == 0 else None)
            if probe_ax is not None:
                # the probe's answer loss, averaged over its tasks
                points = [((r["tokens"] + shift) / 1e6, _mean([v["answer_loss"] for v in probe_scores(r).values()]))
                          for r in recs if probe_scores(r)]
                if points:
                    probe_ax.plot(*zip(*points), lw=0.8, marker=".", color=colors[i % len(colors)],
                                  label=name if j == 0 else None)
    ax.set_xlabel("tokens (M; CPT counts the dense half it branches from)")
    ax.set_ylabel("lm loss")
    low, high = ax.get_ylim()
    ax.set_ylim(low, min(high, 6.0))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if probe_ax is not None:
        probe_ax.axhline(math.log(10), color="gray", lw=0.6, ls="--", label="a random digit (ln 10)")
        probe_ax.set_xlabel("tokens (M)")
        probe_ax.set_ylabel("retrieval probe: answer loss (nats a token)")
        probe_ax.grid(alpha=0.3)
        probe_ax.legend(fontsize=8)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


ARCHIVED = ("metrics.jsonl", "train.log", "driver.json", "done.json", "config.yaml", "parent.json")


def archive(study, path: Path) -> None:
    """Every run's records and logs (not checkpoints) and the eval results, for --import elsewhere;
    through a temporary file, so that a call stopped while writing it leaves the last whole one."""
    tmp = path.with_name(f".{path.name}.tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        for run in study.runs.values():
            for name in ARCHIVED:
                if (run.dir / name).is_file():
                    tar.add(run.dir / name, f"{run.name}/{name}")
            if Path(f"{run.dir}.log").is_file():
                tar.add(f"{run.dir}.log", f"{run.name}.log")
            for name in ("results.json", "results.md"):
                if (study.eval_dir(run) / name).is_file():
                    tar.add(study.eval_dir(run) / name, f"eval/{run.name}/{name}")
    os.replace(tmp, path)


if __name__ == "__main__":
    # a module of the driver: run alone it would exit silently, having written nothing
    raise SystemExit("scripts/quality_report.py writes the report of scripts/quality_experiment.py, whose every call "
                     "writes it: run that with the study's options and --budget 0 to write it again without training")
