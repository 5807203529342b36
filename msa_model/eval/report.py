"""results.json, results.md (tables) and the plots of one evaluation."""

from __future__ import annotations

import json
import os
from pathlib import Path


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def markdown(results: dict) -> str:
    """Accuracy by task x length, mean answer rank, and the loss by position, as markdown tables."""
    lengths = [str(n) for n in results["lengths"]]
    budget = results.get("key_budget")
    untrained = results.get("index_untrained")
    lines = [f"# {results['label']}: {results['model']}, {results['attention']} attention, phase {results['phase']}",
             "", f"checkpoint {results['checkpoint']}" + (f"; **index branch {untrained}**: the sparse phase "
                                                          "selected with it" if untrained else ""),
             "", f"context {results['context']}" + (f", key budget {budget} per query" if budget else "")
             + f"; {results['samples']} examples per (task, length, depth), depths {results['depths']}, "
             f"seed {results['seed']}" + ("; needle block selected: the share of (MSA layer, GQA group) pairs "
                                           "whose blocks for the question's last token hold the asked value's "
                                           "(lengths above the key budget)" if budget else ""), "",
             "| task | " + " | ".join(lengths) + " |", "|---|" + "---|" * len(lengths)]
    for task, per in results["tasks"].items():
        lines.append(f"| {task} accuracy | " + " | ".join(f"{per[n]['accuracy']:.2f}" for n in lengths) + " |")
        lines.append(f"| {task} mean rank | " + " | ".join(f"{per[n]['mean_rank']:.2f}" for n in lengths) + " |")
        for key, what in (("needle_selected", "needle block selected"), ("needle_chance", "... by random blocks")):
            values = [per[n].get(key) for n in lengths]
            if any(v is not None for v in values):
                lines.append(f"| {task} {what} | " + " | ".join("-" if v is None else f"{v:.2f}" for v in values)
                             + " |")
    lines.append("| all tasks accuracy | " + " | ".join(f"{results['accuracy_by_length'][n]:.2f}" for n in lengths)
                 + " |")
    loss = results["loss_by_position"]
    masked = ", each document attending within itself as in training" if loss.get("documents_masked") else ""
    lines += ["", f"Loss by position ({loss['source']}, {loss['sequences']} x {loss['length']} tokens{masked}):", "",
              *_loss_table("positions", loss["buckets"])]
    by_offset = loss.get("by_block_offset")
    if by_offset:
        first, end = by_offset["positions"]
        lines += [f"Loss by offset in a {by_offset['block_size']}-token key block (positions {first}-{end}; the "
                  f"first offsets minus the block's second half: {by_offset['start_excess']:+.3f} ± "
                  f"{by_offset['start_excess_se']:.3f}):", "", *_loss_table("offsets", by_offset["buckets"])]
    return "\n".join(lines)


def _loss_table(what: str, buckets: list[dict]) -> list[str]:
    """A markdown table of the mean loss per bucket [from, to) of `what` (positions, offsets)."""
    return ["| " + what + " | " + " | ".join(f"{b['from']}-{b['to']}" for b in buckets) + " |",
            "|---|" + "---|" * len(buckets),
            "| loss | " + " | ".join(f"{b['loss']:.3f}" for b in buckets) + " |", ""]


def plot_accuracy(results: dict, path: Path) -> None:
    """Accuracy over length (x) and depth (y), one panel per task."""
    plt = _plt()
    tasks = list(results["tasks"])
    lengths = [str(n) for n in results["lengths"]]
    depths = [f"{d:g}" for d in results["depths"]]
    fig, axes = plt.subplots(1, len(tasks), figsize=(3.2 * len(tasks) + 1, 3), squeeze=False)
    image = None
    for ax, task in zip(axes[0], tasks):
        grid = [[results["tasks"][task][n]["by_depth"][d] for n in lengths] for d in depths]
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(lengths)), lengths, fontsize=7, rotation=45)
        ax.set_yticks(range(len(depths)), depths, fontsize=7)
        ax.set_xlabel("length (tokens)", fontsize=8)
        if ax is axes[0][0]:
            ax.set_ylabel("needle depth", fontsize=8)
        ax.set_title(task, fontsize=9)
        budget = results.get("key_budget")
        if budget:
            # the lengths past which a query cannot read every key
            over = [i for i, n in enumerate(results["lengths"]) if n > budget]
            if over:
                ax.axvline(over[0] - 0.5, color="k", lw=0.8, ls="--")
    fig.suptitle(f"{results['label']}: exact-match accuracy", fontsize=10, y=1.02)
    fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def plot_loss_by_position(runs: list[dict], path: Path) -> None:
    """Held-out loss per position bucket (bucket midpoints, log x), one line per run."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    for r in runs:
        b = r["loss_by_position"]["buckets"]
        ax.plot([(x["from"] + x["to"]) / 2 for x in b], [x["loss"] for x in b], marker="o", ms=3, label=r["label"])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("token position")
    ax.set_ylabel("held-out loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def write_text_atomic(path: Path, text: str) -> None:
    """`text` into `path` through a temporary file renamed over it: a kill or Ctrl-C mid-write
    leaves the old file or none, never half of the new one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_report(results: dict, out: Path) -> None:
    """The tables and plots, then results.json: its presence says the evaluation is complete
    (scripts/quality_experiment.py takes it so), so it comes last and whole."""
    out = Path(out)
    write_text_atomic(out / "results.md", markdown(results))
    plot_accuracy(results, out / "accuracy.png")
    plot_loss_by_position([results], out / "loss_by_position.png")
    write_text_atomic(out / "results.json", json.dumps(results, indent=1) + "\n")
