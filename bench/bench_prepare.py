"""data.prepare's throughput against a plain `tokenizers` batch-encode loop, side by side (CPU).

Run from the repo root: PYTHONPATH=. python bench/bench_prepare.py [--max-mb 200] [--vocab 32000]
[--workers N] [--repeat 2] [--json FILE]

Input: the machine's site-packages `.py` files (sorted paths, UTF-8 ones), up to --max-mb of
text, written as one .jsonl ({"text": ...} per file). Tokenizer: a byte-level BPE of --vocab
entries trained here on the standard library (tests/tokenizer_fixtures.py), saved as a Hugging
Face tokenizer directory; both sides use it.
- loop: the same documents, already in memory, through the fast tokenizer's `encode_batch`
  (1000 documents a call, its own thread pool over every core), in this process: the upper bound
  on this machine, since it reads and writes nothing.
- prepare: `python -m data.prepare FILE.jsonl --tokenizer DIR --output-prefix ... --workers N` as a
  user runs it, timed from process start to exit (start-up, reading, JSON, tokenizing, writing
  .bin/.idx and hashing them for PREFIX.json).
MB/s = UTF-8 bytes of the documents' text / wall-clock seconds, for both; CPU seconds (user +
system, every thread and worker process) tell how much of a gap is work rather than waiting on a
busy machine. The runs alternate (loop, prepare, loop, ...) so that other load hits both alike;
the best of --repeat is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))


def collect(max_bytes: int) -> list[str]:
    root = Path(sysconfig.get_paths()["purelib"])
    docs, total = [], 0
    for path in sorted(root.rglob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if not text:
            continue
        docs.append(text)
        total += len(text.encode("utf-8"))
        if total >= max_bytes:
            break
    return docs


def cpu_seconds(who) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def loop(tokenizer_json: Path, docs: list[str], batch: int = 1000) -> tuple[float, float, int]:
    """Seconds, CPU seconds and tokens of encode_batch over `docs`, the tokenizer's own
    parallelism on."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    start, cpu, tokens = time.perf_counter(), cpu_seconds(resource.RUSAGE_SELF), 0
    for i in range(0, len(docs), batch):
        tokens += sum(len(e.ids) for e in tok.encode_batch(docs[i:i + batch], add_special_tokens=False))
    return time.perf_counter() - start, cpu_seconds(resource.RUSAGE_SELF) - cpu, tokens


def prepare(data: Path, tok_dir: Path, prefix: Path, workers: int) -> tuple[float, float, int, str]:
    """Seconds, CPU seconds (its workers included), tokens written (EOD included) and the
    summary line of one data.prepare run."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("TOKENIZERS_PARALLELISM", None)
    start, cpu = time.perf_counter(), cpu_seconds(resource.RUSAGE_CHILDREN)
    done = subprocess.run([sys.executable, "-m", "data.prepare", str(data), "--tokenizer", str(tok_dir),
                           "--output-prefix", str(prefix), "--workers", str(workers), "--overwrite"],
                          cwd=REPO, env=env, capture_output=True, text=True)
    seconds, cpu = time.perf_counter() - start, cpu_seconds(resource.RUSAGE_CHILDREN) - cpu
    if done.returncode != 0:
        sys.exit(f"data.prepare failed ({done.returncode}):\n{done.stderr[-3000:]}")
    summary = done.stdout.strip().splitlines()[-1]
    tokens = int(re.search(r"documents, ([\d,]+) tokens", summary).group(1).replace(",", ""))
    return seconds, cpu, tokens, summary


def report(name: str, mb: float, seconds: float, cpu: float, what: str) -> None:
    # cores in use and the machine's load tell a run that waited on other work from a slow one
    print(f"  {name}: {seconds:7.1f} s  {mb / seconds:6.2f} MB/s  cpu {cpu:7.1f} s ({cpu / seconds:.2f} cores)  "
          f"{what}  (load average {os.getloadavg()[1]:.1f})", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-mb", type=float, default=200.0, help="MB of text to tokenize (default 200)")
    p.add_argument("--vocab", type=int, default=32000, help="BPE vocabulary size (default 32000)")
    p.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)), help="data.prepare --workers")
    p.add_argument("--repeat", type=int, default=2, help="alternating runs of each side (default 2)")
    p.add_argument("--json", help="write the numbers here")
    args = p.parse_args()

    from tokenizer_fixtures import make_bpe_tokenizer

    with tempfile.TemporaryDirectory(prefix="bench-prepare-") as tmp:
        tmp = Path(tmp)
        docs = collect(int(args.max_mb * 1e6))
        text_bytes = sum(len(d.encode("utf-8")) for d in docs)
        data = tmp / "site_packages.jsonl"
        with open(data, "w", encoding="utf-8") as f:
            for d in docs:
                f.write(json.dumps({"text": d}) + "\n")
        tok_dir = make_bpe_tokenizer(tmp / "tokenizer", vocab_size=args.vocab, files=200)
        print(f"input: {len(docs):,} files, {text_bytes / 1e6:,.1f} MB of text ({data.stat().st_size / 1e6:,.1f} MB "
              f"as jsonl); tokenizer: byte-level BPE, {args.vocab:,} entries; {os.cpu_count()} cores", flush=True)

        loops, prepares = [], []
        mb = text_bytes / 1e6
        for r in range(args.repeat):
            seconds, cpu, tokens = loop(tok_dir / "tokenizer.json", docs)
            loops.append((seconds, cpu))
            report(f"loop    run {r + 1}", mb, seconds, cpu, f"{tokens:,} tokens")
            seconds, cpu, written, summary = prepare(data, tok_dir, tmp / "out", args.workers)
            prepares.append((seconds, cpu))
            report(f"prepare run {r + 1}", mb, seconds, cpu, f"{written - len(docs):,} tokens + {len(docs):,} EOD")
            print(f"    {summary}", flush=True)
            if written - len(docs) != tokens:
                sys.exit(f"data.prepare wrote {written - len(docs):,} tokens of text, the loop made {tokens:,}")
        # the best of each: the runs least disturbed by other work on the machine
        loop_s, loop_cpu = min(s for s, _ in loops), min(c for _, c in loops)
        prep_s, prep_cpu = min(s for s, _ in prepares), min(c for _, c in prepares)
        result = {"documents": len(docs), "text_mb": mb, "vocab": args.vocab, "workers": args.workers,
                  "loop_s": loops, "prepare_s": prepares, "loop_mb_s": mb / loop_s, "prepare_mb_s": mb / prep_s,
                  "ratio": loop_s / prep_s, "cpu_ratio": loop_cpu / prep_cpu}
        print(f"\n| side | best s | MB/s | CPU s | MB per CPU s |\n|---|---|---|---|---|\n"
              f"| tokenizers encode_batch loop | {loop_s:.1f} | {mb / loop_s:.2f} | {loop_cpu:.1f} | "
              f"{mb / loop_cpu:.2f} |\n"
              f"| data.prepare --workers {args.workers} | {prep_s:.1f} | {mb / prep_s:.2f} | {prep_cpu:.1f} | "
              f"{mb / prep_cpu:.2f} |\n"
              f"\ndata.prepare / loop: {100 * result['ratio']:.0f}% of its MB/s (target >= 70%), "
              f"{100 * result['cpu_ratio']:.0f}% of its MB per CPU second")
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
