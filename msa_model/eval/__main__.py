"""python -m msa_model.eval CHECKPOINT --out DIR [options]; see msa_model/eval/runner.py."""

from __future__ import annotations

import argparse
import sys
import warnings

warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\..*")
warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed\..*")
# a one-process load of a distributed checkpoint: torch says so at every call
warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed\.checkpoint\..*")
warnings.filterwarnings("ignore", category=FutureWarning, module=r"msa_model\.cpu_shim")


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def _ints(text: str) -> list[int]:
    return [int(float(x)) for x in text.split(",") if x]


def _count(text: str) -> int:
    """A count of at least 1: zero examples or sequences leave nothing to average (and were found
    out only after the model had loaded and the retrieval had run)."""
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def main(argv=None) -> int:
    from data.retrieval import DEFAULT_TASKS, TASKS

    p = argparse.ArgumentParser(prog="python -m msa_model.eval", description=__doc__)
    p.add_argument("checkpoint", help="a run dir, a checkpoint root (with `latest`) or a step_* directory")
    p.add_argument("--out", required=True, help="output directory (results.json, results.md, *.png)")
    p.add_argument("--lengths", type=_ints, default=None,
                   help="comma-separated lengths in tokens (default: 1K, 2K, ... up to the model's context; "
                        "longer ones test length extrapolation through RoPE)")
    p.add_argument("--depths", type=_floats, default=[0.0, 0.25, 0.5, 0.75, 1.0], help="needle depths in [0, 1]")
    p.add_argument("--tasks", default=",".join(DEFAULT_TASKS),
                   help=f"comma-separated, of {', '.join(TASKS)} (data/retrieval.py)")
    p.add_argument("--samples", type=_count, default=4, help="examples per (task, length, depth)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--phase", choices=["sparse", "dense"], default="sparse",
                   help="MSA models: top-k selection (sparse) or the warmup's dense attention")
    p.add_argument("--loss-sequences", type=_count, default=8, help="held-out sequences for the loss by position")
    p.add_argument("--loss-length", type=_count, default=None, help="their length (default: the longest of --lengths)")
    p.add_argument("--corpus", default=None, help="haystack/held-out source directory, its .jsonl files read as "
                                                  "data.prepare reads them (default: the run's data.source)")
    p.add_argument("--glob", default=None, help="the corpus's text files (default: the run's data.glob for a run on a "
                                                "file-directory corpus, else every file)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--label", default=None, help="name of this model in the report (default: the run directory's name)")
    args = p.parse_args(argv)

    from pathlib import Path

    from msa_model.eval.runner import EvalError, Progress, run_eval

    try:
        run_eval(args)
    except EvalError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        kept = Path(args.out) / Progress.FILE
        print("interrupted: " + (f"the retrieval scored so far is kept in {kept}; the same command goes on from it"
                                 if kept.is_file() else "nothing scored yet"), file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
