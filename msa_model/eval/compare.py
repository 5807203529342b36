"""`python -m msa_model.eval.compare OUT_A OUT_B [...] [--out DIR]`: evaluations side by side.

Reads each directory's results.json (written by `python -m msa_model.eval`, last: a directory
without it holds no finished evaluation) and prints one markdown report: what each evaluated, the
retrieval accuracy per task and length, the held-out loss per position bucket and by offset inside
a key block, and the difference of each to the first evaluation (the reference, e.g. the dense
model a conversion started from). With --out, also compare.md and loss_by_position.png there.
Rows of numbers that the evaluations measured differently (other lengths, other position buckets)
show "-" where one has no value; the loss rows say when their held-out text was not the same.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


class CompareError(ValueError):
    """An evaluation directory that cannot be read: its message names the directory."""


def load(directory: Path) -> dict:
    path = Path(directory) / "results.json"
    if not path.is_file():
        partial = " (an interrupted evaluation: partial.json only)" if (Path(directory) / "partial.json").is_file() else ""
        raise CompareError(f"{directory}: no results.json, not a finished evaluation{partial}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CompareError(f"{path}: not JSON ({e.msg})") from None


def _cell(value, reference, digits: int) -> str:
    """`value (+difference to the reference)`; '-' where there is no value."""
    if value is None:
        return "-"
    if reference is None:
        return f"{value:.{digits}f}"
    return f"{value:.{digits}f} ({value - reference:+.{digits}f})"


def _rows(names: list[str], table: list[dict], digits: int) -> list[str]:
    """One markdown row per key of the union of `table`'s dicts (one dict per evaluation), each
    cell against the first evaluation's value."""
    keys = list(dict.fromkeys(k for row in table for k in row))
    lines = ["| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for key in keys:
        ref = table[0].get(key)
        lines.append(f"| {key} | " + " | ".join(_cell(row.get(key), ref if i else None, digits)
                                                for i, row in enumerate(table)) + " |")
    return lines


def _retrieval(r: dict) -> dict:
    out = {}
    for task, per in r["tasks"].items():
        for n in r["lengths"]:
            out[f"{task} {n}"] = per[str(n)]["accuracy"]
        for n in r["lengths"]:  # the answer's teacher-forced rank: where accuracy is 0 everywhere
            out[f"{task} {n} mean rank"] = per[str(n)].get("mean_rank")
    for n in r["lengths"]:
        out[f"all tasks {n}"] = r["accuracy_by_length"][str(n)]
    return out


def _buckets(buckets: list[dict]) -> dict:
    return {f"{b['from']}-{b['to']}": b["loss"] for b in buckets}


def markdown(results: list[dict]) -> str:
    names = [r["label"] for r in results]
    lines = ["# Evaluations compared", "", "In brackets: the difference to the first, " + names[0] + ".", "",
             "| | checkpoint | model | attention | phase | key budget | context |", "|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['label']} | {r['checkpoint']} | {r['model']} | {r['attention']} | {r['phase']} | "
                     f"{r.get('key_budget') or '-'} | {r['context']} |")
    lines += ["", "Retrieval, exact-match accuracy and the answer's mean rank (task, length in tokens):", "",
              *_rows(names, [_retrieval(r) for r in results], 2)]
    losses = [r["loss_by_position"] for r in results]
    same_text = len({(x["source"], x["sequences"], x["length"], bool(x.get("documents_masked"))) for x in losses}) == 1
    lines += ["", "Held-out loss by token position" + ("" if same_text else " (**not the same held-out text**: "
              + "; ".join(f"{n}: {x['source']}, {x['sequences']} x {x['length']}" for n, x in zip(names, losses))
              + ")") + ":", "", *_rows(names, [_buckets(x["buckets"]) for x in losses], 3)]
    offsets = [x.get("by_block_offset") for x in losses]
    if any(offsets):
        table = [dict(_buckets(o["buckets"]), **{"first offsets minus second half": o["start_excess"]}) if o else {}
                 for o in offsets]
        lines += ["", "Held-out loss by offset inside a key block (positions past the key budget):", "",
                  *_rows(names, table, 3)]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m msa_model.eval.compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("evaluations", nargs="+", help="output directories of `python -m msa_model.eval`; the first "
                                                  "is the reference")
    p.add_argument("--out", default=None, help="also write compare.md and loss_by_position.png here")
    args = p.parse_args(argv)
    if len(args.evaluations) < 2:
        p.error("give two or more evaluation directories")
    if args.out and Path(args.out).exists() and not Path(args.out).is_dir():
        p.error(f"--out {args.out}: a file is in the way (a directory is needed)")
    try:
        results = [load(Path(d)) for d in args.evaluations]
    except CompareError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # two evaluations of one label (two checkpoints of one run) are told apart by their directories
    labels = [r["label"] for r in results]
    for r, d in zip(results, args.evaluations):
        if labels.count(r["label"]) > 1:
            r["label"] = f"{r['label']} ({d})"
    text = markdown(results)
    print(text, end="")
    if args.out:
        from msa_model.eval.report import plot_loss_by_position, write_text_atomic

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        write_text_atomic(out / "compare.md", text)
        plot_loss_by_position(results, out / "loss_by_position.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
