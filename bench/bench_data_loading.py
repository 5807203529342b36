"""What reading a batch costs the training loop: a prepared blend against the embedded file-directory
corpus, same tokenizer, same sequence length, side by side (CPU, one thread, as a training rank
reads: the DataLoader has no workers).

    PYTHONPATH=. python bench/bench_data_loading.py --prefix PREFIX [--seq 8192] [--batches 200]

The blend is PREFIX (a `python -m data.prepare` output, its tokenizer from PREFIX.json); the
corpus is the files PREFIX.json names as its source with its glob, capped at --max-bytes, tokenized
into a temporary cache by the same tokenizer. Each side: the datasets built as train.py builds
them (data/datasets.py), then --batches micro-batches of one sequence with the document starts
(data.document_mask) timed one by one; ms per micro-batch (median and p99) is what a step waits
before its forward.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _timed(data_cfg, tokenizer, seq: int, batches: int) -> list[float]:
    from data.datasets import build_datasets, build_train_iterator

    train, _ = build_datasets(data_cfg, tokenizer, seq, batches)
    it = build_train_iterator(train, 0, 1, 0, 1, document_mask=True)
    times = []
    for _ in range(batches):
        t0 = time.perf_counter()
        next(it)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefix", required=True)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--max-bytes", type=int, default=60_000_000)
    args = ap.parse_args(argv)
    import torch
    from hydra import compose, initialize_config_dir

    from data.prepared import read_metadata
    from data.tokenizer import build_tokenizer
    from msa_model.config import register_configs

    torch.set_num_threads(1)
    meta = read_metadata(args.prefix)
    tokenizer = build_tokenizer(meta["tokenizer"]["path"])
    register_configs()
    results = {}
    with tempfile.TemporaryDirectory() as cache, initialize_config_dir(str(REPO / "configs"), version_base=None):
        common = [f"data.cache_dir={cache}", f"data.tokenizer={meta['tokenizer']['path']}", "data.split=[100,0,0]"]
        sides = {
            "blend": [f"data.blend=[[1.0,{args.prefix}]]"],
            "corpus": [f"data.source={meta['source'][0]}", f"data.glob={meta['read']['glob']}",
                       f"data.max_bytes={args.max_bytes}"],
        }
        for name, overrides in sides.items():
            cfg = compose("train", overrides=[*common, *overrides])
            times = _timed(cfg.data, tokenizer, args.seq, args.batches)[1:]  # the first opens the files
            q = statistics.quantiles(times, n=100)
            results[name] = {"median_ms": statistics.median(times), "p99_ms": q[98], "mean_ms": statistics.mean(times)}
            print(f"{name}: {args.batches - 1} micro-batches of 1 x {args.seq}: median {results[name]['median_ms']:.3f} ms,"
                  f" p99 {results[name]['p99_ms']:.3f} ms, mean {results[name]['mean_ms']:.3f} ms", flush=True)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
