"""The windows of synthetic retrieval documents (data.retrieval_share): the filler after a window's
last document takes no loss while every document token and end-of-document token does, with the
byte tokenizer and a BPE one, and the per-document attention of data.document_mask accepts them.
Two ranks (gloo) that build one mixture into an empty cache: rank 0 builds it once, both read the
same samples."""

from __future__ import annotations

import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from data.cache_check import MANIFEST, read_manifest, unrecorded
from data.corpus import list_corpus_files
from data.datasets import _cache_key, build_datasets, build_train_iterator, prepare_tokens
from data.tokenizer import BYTE, build_tokenizer
from msa_model.config import DataConfig
from msa_model.ops.common import check_doc_start
from skeleton_helpers import REPO, _env, free_port

# retrieval documents are 256 tokens or longer (data/retrieval.py): a 256-token window is one
# document, with no filler
SEQ = 512


def write_corpus(root):
    """Three Python files of 400 short lines: the haystack of the retrieval documents."""
    root.mkdir()
    rng = random.Random(0)
    for i in range(3):
        (root / f"m{i}.py").write_text("\n".join(f"x{j} = {rng.randrange(1000)}  # line {j}" for j in range(400)))
    return root


def last_document_end(tokens: torch.Tensor, eod: int) -> int:
    """The position of the window's last document's end-of-document token: the last one right after
    a token of text (the filler after it may be end-of-document tokens, or hold the eod id)."""
    ends = [j for j in torch.nonzero(tokens == eod).flatten().tolist() if j > 0 and tokens[j - 1] != eod]
    return ends[-1]


@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_the_padding_of_retrieval_windows_takes_no_loss(tmp_path, kind):
    spec = BYTE
    if kind == "bpe":
        from tokenizer_fixtures import make_bpe_tokenizer

        spec = str(make_bpe_tokenizer(tmp_path / "tok", vocab_size=600, files=20))
    tokenizer = build_tokenizer(spec)
    cfg = OmegaConf.structured(DataConfig(source=str(write_corpus(tmp_path / "corpus")), glob="*.py",
                                          cache_dir=str(tmp_path / "cache"), retrieval_share=0.5, tokenizer=spec))
    train, _ = build_datasets(cfg, tokenizer, SEQ, 64)
    windows = padded = 0
    for i in range(len(train)):
        item = train[i]
        if item["dataset_id"] != 1:  # the corpus's samples
            continue
        windows += 1
        mask = item["loss_mask"]
        last = last_document_end(item["tokens"], tokenizer.eod)
        # every token of the documents is predicted, each one's end-of-document token too
        assert mask[:last].eq(1).all(), (i, last, mask[:last])
        # nothing after the last one: the filler (the entry's last position predicts the next
        # window's first token)
        assert mask[last:SEQ - 1].eq(0).all(), (i, last, mask[last:])
        padded += last < SEQ - 2
    assert windows >= 16 and padded >= windows // 2, (windows, padded)

    # packed documents: the filler is a document of its own (or, where the model's id 0 is the
    # end-of-document token, one-token documents), which the attention layers accept
    batches = build_train_iterator(train, 0, 8, 0, 1, document_mask=True)
    for _ in range(len(train) // 8):
        batch = next(batches)
        check_doc_start(batch["doc_start"], 8, SEQ)

    # a cache of windows filled with end-of-document tokens (the key they had) is not reused
    root, files = list_corpus_files(cfg.source, cfg.glob, cfg.max_bytes)
    name = tokenizer.name if kind == "byte" else tokenizer.identity["sha256"]
    lengths = "" if kind == "byte" else ",lengths=tokens"
    filled = f"corpus-{_cache_key(name, root, files, f'retrieval=0.5,{SEQ},{cfg.seed}{lengths},windows')}"
    built = Path(prepare_tokens(cfg, tokenizer, build=False, seq_length=SEQ)).parent
    assert (Path(cfg.cache_dir) / filled) != built and not (Path(cfg.cache_dir) / filled).exists()


# one rank of a job that builds the retrieval mixture of argv[1] into the cache argv[2] and saves
# its training samples in argv[3] (formatted with the rank)
RANK_MAIN = """
import logging, os, sys
import torch, torch.distributed as dist
from omegaconf import OmegaConf
from msa_model.config import DataConfig
from data.datasets import build_datasets
from data.tokenizer import BYTE, build_tokenizer
logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
dist.init_process_group("gloo")
cfg = OmegaConf.structured(DataConfig(source=sys.argv[1], glob="*.py", cache_dir=sys.argv[2], retrieval_share=0.5))
train, _ = build_datasets(cfg, build_tokenizer(BYTE), 256, 48)
torch.save([train[i] for i in range(len(train))], sys.argv[3].format(dist.get_rank()))
dist.destroy_process_group()
"""


def run_ranks(args: list[str], logs: list[Path], timeout: float = 300) -> list[int]:
    """Start one process per log file as the ranks of a gloo job (stdout and stderr to its log) and
    wait for them; a rank that fails ends the others (they would wait for it in a collective).
    Their exit codes."""
    port, outs = free_port(), [log.open("w") for log in logs]
    procs = [subprocess.Popen(args, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                              env={**_env(), "RANK": str(r), "WORLD_SIZE": str(len(logs)),
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
             for r, out in enumerate(outs)]
    deadline = time.monotonic() + timeout
    try:
        # a guard against a hang, not a speed check
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for out in outs:
            out.close()
    return [p.returncode for p in procs]


def test_two_ranks_build_a_retrieval_mixture_once_and_read_the_same_samples(tmp_path):
    corpus, cache = write_corpus(tmp_path / "corpus"), tmp_path / "cache"
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    codes = run_ranks([sys.executable, "-c", RANK_MAIN, str(corpus), str(cache), str(tmp_path / "rank{}.pt")], logs)
    outs = [log.read_text() for log in logs]
    assert codes == [0, 0], "\n".join(o[-4000:] for o in outs)
    # tokenized once, by rank 0, into one cache directory whose sample indices are all recorded;
    # no lock or temporary directory left behind
    assert [o.count("data.datasets: tokenized ") for o in outs] == [1, 0], outs
    (built,) = cache.iterdir()
    assert built.name.startswith("corpus-") and sorted(p.name for p in built.iterdir()) == [
        "index", MANIFEST, "retrieval.bin", "retrieval.idx", "tokens.bin", "tokens.idx"]
    assert read_manifest(built / "index") and unrecorded(built / "index") == []
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == 48
    assert {int(item["dataset_id"]) for item in ranks[0]} == {0, 1}
    for a, b in zip(*ranks):
        assert a.keys() == b.keys() and all(torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])) for k in a)
