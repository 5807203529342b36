"""How many questions of the kvrecall training documents can a model answer from its window?

    python bench/retrieval_answerable.py [--lengths 256,512,2048,8192] [--docs 400]

`data.retrieval_share` appends synthetic documents to the corpus's indexed dataset, and megatron's
GPTDataset cuts the shuffled stream of documents into windows of `model.seq_length` tokens with no
regard for where a document starts. A kvrecall document (lengths uniform in [max(256, S/8), S]
bytes, the byte tokenizer's tokens, plus its BOS and end-of-document token) that a window
boundary cuts puts its questions in one window and some of its needles in the one before; those
questions have no answer in their context. This draws documents as `training_documents` does,
starts each at a uniform offset of the window grid (the documents before it have lengths of no
relation to S) and counts the questions whose needle lies in the same window as the question's
answer.
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import sysconfig
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.retrieval import Haystack, make_example  # noqa: E402

QUESTION = re.compile(rb'assert (KEY_\w+) == "')


def answerable_share(seq_length: int, docs: int, haystack: Haystack, seed: int = 1) -> tuple[float, int]:
    """(the share of kvrecall questions whose needle is in the answer's window, the questions)."""
    rng = random.Random(seed)
    low = max(256, seq_length // 8)
    total = answerable = 0
    for _ in range(docs):
        length = rng.randint(low, max(low, seq_length))
        ex = make_example("kvrecall", length, rng.random(), haystack, rng, ask_all=True)
        doc = b"\x00" + ex.prompt + ex.answer + b"\x00"  # BOS ... end-of-document
        offset = rng.randrange(seq_length)
        for m in QUESTION.finditer(doc):
            needle = doc.find(m.group(1) + b' = "')
            total += 1
            # the answer's last digit, four bytes after the question's quote
            answerable += (needle + offset) // seq_length == (m.end() + 4 + offset) // seq_length
    return answerable / total, total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="256,512,2048,8192", help="model.seq_length values")
    p.add_argument("--docs", type=int, default=400, help="documents drawn a length")
    args = p.parse_args()
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:200]
    haystack = Haystack(files, pool_bytes=2_000_000, seed=0)
    for s in (int(x) for x in args.lengths.split(",")):
        share, n = answerable_share(s, args.docs, haystack)
        print(f"seq_length {s:>6,}: {share:.2f} of {n:,} kvrecall questions have their needle in their window")


if __name__ == "__main__":
    main()
