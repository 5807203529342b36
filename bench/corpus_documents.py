"""The documents a training corpus packs into its sequences: how long they are, and a corpus of
long ones.

    PYTHONPATH=. python bench/corpus_documents.py describe [--seq 8192,32768,131072] [--json FILE] -- key=value ...
    PYTHONPATH=. python bench/corpus_documents.py concat SRC OUT [--min-bytes 200000] [--max-bytes 4000000]

describe: tokenizes (or reads the cache of) the corpus that `train.py key=value ...` would train
on and prints its document-length distribution in tokens (count, mean, quantiles, the share of
tokens in documents of at least 8K / 32K / 128K) and, per sequence length, the documents a row
holds on average and the share of a causal row's query-key pairs that document masking keeps
(estimated by cutting rows from the token stream as GPTDataset does, shuffled documents end to
end). --json writes the lengths (for bench/bench_dense_documents.py --lengths-from).

concat: a corpus of long documents: every package directory under SRC (e.g. a site-packages)
becomes one file OUT/<package>.txt, its .py files concatenated in sorted order (up to
--max-bytes), packages under --min-bytes left out; train on it with
`data.source=OUT data.glob=*.txt`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def _config(overrides: list[str]):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from msa_model.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
        cfg = compose("train", overrides=overrides)
    OmegaConf.resolve(cfg)
    return cfg


def document_lengths(cfg) -> np.ndarray:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from data.datasets import prepare_tokens

    prefix = prepare_tokens(cfg.data, build=True, seq_length=cfg.model.seq_length)
    dataset = IndexedDataset(prefix)
    # a copy: the lengths are a view of the index file's memory map, which goes with the dataset
    return np.array(dataset.sequence_lengths, dtype=np.int64)


def masked_share(lengths: np.ndarray, seq: int, rows: int = 2000, seed: int = 0) -> tuple[float, float]:
    """(documents a row holds, share of the causal query-key pairs within documents) of rows of
    `seq` tokens cut from the documents shuffled end to end."""
    rng = np.random.default_rng(seed)
    stream = np.cumsum(rng.permutation(lengths))
    total = int(stream[-1])
    if total < seq:
        return float("nan"), float("nan")
    docs, kept = [], []
    causal = seq * (seq + 1) / 2
    for start in rng.integers(0, total - seq, size=rows):
        cuts = stream[(stream > start) & (stream < start + seq)] - start
        bounds = np.concatenate([[0], cuts, [seq]])
        n = np.diff(bounds)
        docs.append(len(n))
        kept.append(float((n * (n + 1) / 2).sum() / causal))
    return float(np.mean(docs)), float(np.mean(kept))


def describe(a) -> None:
    cfg = _config(a.overrides)
    lengths = document_lengths(cfg)
    q = np.percentile(lengths, [10, 50, 90, 99]).astype(int)
    total = lengths.sum()
    print(f"corpus {cfg.data.source} ({cfg.data.glob}, tokenizer {cfg.data.tokenizer}): {len(lengths):,} documents, "
          f"{total:,} tokens; length mean {lengths.mean():,.0f}, p10 {q[0]:,}, median {q[1]:,}, p90 {q[2]:,}, "
          f"p99 {q[3]:,}, max {lengths.max():,}")
    for bound in (8192, 32768, 131072):
        print(f"tokens in documents of >= {bound // 1024}K: {lengths[lengths >= bound].sum() / total:.1%}")
    for seq in (int(x) for x in a.seq.split(",")):
        docs, kept = masked_share(lengths, seq)
        print(f"rows of {seq // 1024}K: {docs:.1f} documents a row on average; document masking keeps {kept:.2f} of "
              "the causal query-key pairs")
    if a.json:
        Path(a.json).write_text(json.dumps(lengths.tolist()))


def concat(a) -> None:
    src, out = Path(a.src), Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    written = 0
    for package in sorted(p for p in src.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))):
        parts, size = [], 0
        for f in sorted(package.rglob("*.py")):
            try:
                text = f.read_bytes()
            except OSError:
                continue
            parts.append(text)
            size += len(text)
            if size >= a.max_bytes:
                break
        if size >= a.min_bytes:
            (out / f"{package.name}.txt").write_bytes(b"\n".join(parts)[:a.max_bytes])
            written += 1
    print(f"{written} package documents written to {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("describe")
    d.add_argument("--seq", default="8192,32768,131072")
    d.add_argument("--json", default=None)
    d.add_argument("overrides", nargs="*")
    c = sub.add_parser("concat")
    c.add_argument("src")
    c.add_argument("out")
    c.add_argument("--min-bytes", type=int, default=200_000)
    c.add_argument("--max-bytes", type=int, default=4_000_000)
    a = ap.parse_args()
    describe(a) if a.cmd == "describe" else concat(a)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
