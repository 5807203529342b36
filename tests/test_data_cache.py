"""The tokenized data cache is checked before use: files damaged after the build (zeroed, truncated,
removed) are rebuilt by the building rank with a warning naming them and refused by the others;
every byte is compared on request; GPTDataset's sample indices are checked the same way. A build
that died leaves nothing the next one keeps (processes that start together on an empty cache:
tests/test_shared_build.py, and jobs: tests/test_slurm.py)."""

from __future__ import annotations

import logging
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from data.cache_check import MANIFEST, DataCacheError, read_manifest
from data.datasets import build_datasets, prepare_tokens
from data.tokenizer import build_tokenizer
from msa_model.config import DataConfig


def build_train_dataset(cfg, seq_length: int, samples: int):
    return build_datasets(cfg, build_tokenizer("byte"), seq_length, samples)[0]


@pytest.fixture
def corpus(tmp_path) -> Path:
    """Three text files of 120 KB: tokens.bin (4 bytes a token) is larger than the sampled blocks."""
    root = tmp_path / "corpus"
    root.mkdir()
    rng = random.Random(0)
    for i in range(3):
        (root / f"doc{i}.txt").write_text("".join(rng.choice("abcdefgh \n") for _ in range(120_000)))
    return root


def _cfg(tmp_path, corpus, **kw):
    return OmegaConf.structured(DataConfig(source=str(corpus), glob="*.txt", cache_dir=str(tmp_path / "cache"), **kw))


def _zero_middle(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 5: 4 * len(data) // 5] = bytes(3 * len(data) // 5)
    path.write_bytes(bytes(data))


DAMAGE = {
    "zeroed": (_zero_middle, "tokens.bin differs from what was built"),
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[:100_000]), "tokens.bin is 100,000 bytes"),
    "removed": (lambda p: p.unlink(), "tokens.bin is missing"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_token_file_is_rebuilt_or_refused(tmp_path, corpus, caplog, damage):
    cfg = _cfg(tmp_path, corpus)
    out = Path(prepare_tokens(cfg)).parent
    built = (out / "tokens.bin").read_bytes()
    assert set(read_manifest(out)) == {"tokens.bin", "tokens.idx"}
    with caplog.at_level(logging.WARNING):
        assert Path(prepare_tokens(cfg)).parent == out
    assert not caplog.records  # an intact cache is used as it is

    apply, message = DAMAGE[damage]
    apply(out / "tokens.bin")
    # a rank that does not build refuses, naming the file
    with pytest.raises(DataCacheError, match=f"data cache {out}: {message}"):
        prepare_tokens(cfg, build=False)
    with caplog.at_level(logging.WARNING):
        prepare_tokens(cfg)
    assert f"data cache {out}: {message}" in caplog.text and "rebuilding it" in caplog.text
    assert (out / "tokens.bin").read_bytes() == built
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # nothing left aside


def test_every_byte_is_compared_on_request(tmp_path, corpus, caplog):
    cfg = _cfg(tmp_path, corpus)
    out = Path(prepare_tokens(cfg)).parent
    path = out / "tokens.bin"
    data = bytearray(path.read_bytes())
    # between two sampled blocks (64 blocks of 4 KiB spread over the file)
    spot = (len(data) - 4096) // 63 // 2
    data[spot:spot + 4] = b"\xff\xff\xff\x7f"
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        prepare_tokens(cfg)
    assert not caplog.records
    with caplog.at_level(logging.WARNING):
        prepare_tokens(_cfg(tmp_path, corpus, verify_cache=True))
    assert "tokens.bin differs from what was built (sha256 mismatch)" in caplog.text


def test_a_cache_without_a_manifest_is_rebuilt(tmp_path, corpus, caplog):
    cfg = _cfg(tmp_path, corpus)
    out = Path(prepare_tokens(cfg)).parent
    (out / MANIFEST).unlink()  # an interrupted build, or one made before manifests existed
    with caplog.at_level(logging.WARNING):
        prepare_tokens(cfg)
    assert f"data cache {out}: {MANIFEST} is missing" in caplog.text
    assert read_manifest(out) is not None


def test_damaged_sample_indices_are_rebuilt(tmp_path, corpus, caplog):
    cfg = _cfg(tmp_path, corpus)
    first = build_train_dataset(cfg, 64, 16)
    index = Path(prepare_tokens(cfg)).parent / "index"
    recorded = read_manifest(index)
    assert any(name.endswith("sample_index.npy") for name in recorded)
    # a file megatron wrote for another dataset, never recorded (its build died half-way)
    leftover = index / "0000-GPTDataset-train-shuffle_index.npy"
    leftover.write_bytes(next(index.glob("*shuffle_index.npy")).read_bytes()[:80])
    with caplog.at_level(logging.WARNING):
        build_train_dataset(cfg, 64, 16)
    assert f"{leftover.name} was never recorded" in caplog.text and not leftover.exists()

    sample_index = next(index.glob("*sample_index.npy"))
    sample_index.write_bytes(sample_index.read_bytes()[:50])
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        again = build_train_dataset(cfg, 64, 16)
    assert f"data cache {index}: {sample_index.name} is 50 bytes" in caplog.text
    assert np.array_equal(first[3]["tokens"].numpy(), again[3]["tokens"].numpy())
    assert set(read_manifest(index)) == set(recorded)


def test_a_build_that_died_leaves_nothing_the_next_one_keeps(tmp_path, corpus):
    cfg = _cfg(tmp_path, corpus)
    out = Path(prepare_tokens(cfg)).parent
    shutil.rmtree(out)
    # what a tokenizer killed half-way leaves: its temporary directory
    (out.parent / f".{out.name}-k1ll3d").mkdir()
    (out.parent / f".{out.name}-k1ll3d" / "tokens.bin").write_bytes(b"half")
    assert Path(prepare_tokens(cfg)).parent == out
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]



def test_a_dataset_prepared_again_under_its_prefix_gets_sample_indices_of_its_own(tmp_path):
    """megatron names its indices by path, sizes and settings: without the contents in the key, the
    second dataset was read through the first one's indices (an IndexError, or, at the same
    document count, other documents' tokens)."""
    from tokenizer_fixtures import write_prepared

    byte = build_tokenizer("byte")
    prefix = tmp_path / "data" / "web"
    cfg = OmegaConf.structured(DataConfig(blend=[str(prefix)], split=[100.0, 0.0, 0.0], cache_dir=str(tmp_path / "c")))
    write_prepared(prefix, ["a" * 300 + str(i) for i in range(40)], byte)
    first = build_datasets(cfg, byte, 64, 8)[0]
    assert set(first[0]["tokens"].tolist()) <= set(byte.tokenize("a0123456789")) | {byte.eod}
    for ext in (".bin", ".idx", ".json"):
        Path(f"{prefix}{ext}").unlink()
    write_prepared(prefix, ["b" * 40, "c" * 30], byte)  # as `data.prepare --overwrite` would
    second = build_datasets(cfg, byte, 64, 8)[0]
    for i in range(8):
        assert set(second[i]["tokens"].tolist()) <= {*byte.tokenize("bc"), byte.eod}


def test_a_dataset_the_run_reads_more_than_once_is_said(tmp_path):
    """megatron repeats a split smaller than the run in shuffled passes and says so only in its own
    (silenced) log: 113 tokens (more than one sample: fewer are refused) read for a 4-sample run of
    64 tokens."""
    from data.datasets import repeat_lines
    from tokenizer_fixtures import write_prepared

    byte = build_tokenizer("byte")
    prefix = write_prepared(tmp_path / "small", ["hello world" * 10, "x"], byte)
    cfg = OmegaConf.structured(DataConfig(blend=[str(prefix)], split=[100.0, 0.0, 0.0], cache_dir=str(tmp_path / "c")))
    train = build_datasets(cfg, byte, 64, 4)[0]
    (line,) = repeat_lines(train, "training")
    assert line.startswith(f"data: the training share of {prefix} holds 113 tokens; the run reads ")
    assert repeat_lines(None, "validation") == []
    large = write_prepared(tmp_path / "large", ["y" * 2000], byte)
    cfg.blend = [str(large)]
    assert repeat_lines(build_datasets(cfg, byte, 64, 2)[0], "training") == []


def test_a_dataset_of_split_sentences_is_counted_by_sequences(tmp_path):
    """Megatron-LM's --split-sentences writes several sequences a document, and megatron's split
    cuts a dataset by sequences: the one-sample check counts the tokens of those sequences (it read
    the cut as document numbers: an IndexError past the last document)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from data.prepared import split_problems, write_metadata

    byte = build_tokenizer("byte")
    prefix = tmp_path / "sentences"
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    for doc in range(4):  # 4 documents of 5 sentences of 20 tokens
        sentences = [np.full(20, 65 + doc, dtype=np.int32) for _ in range(5)]
        sentences[-1][-1] = byte.eod
        builder.add_document(np.concatenate(sentences), [20] * 5)
    builder.finalize(f"{prefix}.idx")
    write_metadata(prefix, {"source": ["test"], "tokenizer": {**byte.identity, "path": "byte"}, "add_bos": False,
                            "documents": 4, "sequences": 20, "tokens": 400, "skipped": {}})
    cfg = OmegaConf.structured(DataConfig(blend=[str(prefix)], split=[90.0, 10.0, 0.0], cache_dir=str(tmp_path / "c")))
    # validation: sequences 18-19 (round(0.9 * 20)), 40 tokens: fewer than one 64-token sample
    (problem,) = split_problems(cfg, evaluating=True, seq_length=64)
    assert "the validation documents of" in problem and "(2 of 20) hold 40 tokens" in problem
    assert split_problems(cfg, evaluating=True, seq_length=32) == []
    with pytest.raises(DataCacheError, match=r"the validation documents of .* \(2 of 20\) hold 40 tokens"):
        build_datasets(cfg, byte, 64, train_samples=4, valid_samples=2)
    train, valid = build_datasets(cfg, byte, 32, train_samples=4, valid_samples=2)
    assert len(train) >= 4 and len(valid) >= 2


def test_the_records_of_jsonl_files_in_the_corpus_are_its_documents(tmp_path):
    """data.source with .jsonl files beside text files: each record's "text" is a document, as
    `python -m data.prepare` and the evaluation read them (not the file's JSON as one document);
    a .jsonl file without one is refused naming it, and its build leaves nothing in the cache."""
    import json

    from megatron.core.datasets.indexed_dataset import IndexedDataset

    root = tmp_path / "corpus"
    root.mkdir()
    records = ["first record", "second, with \"quotes\"", "third"]
    (root / "a.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(records)))
    (root / "b.txt").write_text("plain text file")
    cfg = OmegaConf.structured(DataConfig(source=str(root), glob="*", cache_dir=str(tmp_path / "cache")))
    dataset = IndexedDataset(prepare_tokens(cfg), mmap=True)
    eod = build_tokenizer("byte").eod
    docs = [bytes(dataset[i][:-1].tolist()).decode() for i in range(len(dataset))]
    assert docs == [*records, "plain text file"] and all(dataset[i][-1] == eod for i in range(len(dataset)))

    (root / "c.jsonl").write_text(json.dumps({"content": "no text field"}) + "\n")
    with pytest.raises(DataCacheError, match=r"data.source: .*c.jsonl: no documents"):
        prepare_tokens(cfg)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir() if p.name.startswith(".corpus-")) == []


def test_a_split_that_leaves_a_corpus_share_without_files_is_refused_before_tokenizing(tmp_path):
    """31 files at data.split [99, 1, 0]: validation gets none (megatron cuts the documents by the
    shares, rounded); said from the file count, before anything is tokenized or written."""
    from msa_model.training.data_setup import corpus_split_problems

    root = tmp_path / "corpus"
    root.mkdir()
    for i in range(31):
        (root / f"f{i:02}.txt").write_text(f"file {i}\n" * 50)
    cfg = OmegaConf.structured(DataConfig(source=str(root), glob="*.txt", cache_dir=str(tmp_path / "cache")))
    (line,) = corpus_split_problems(cfg, evaluating=True)
    assert line == (f"data.split [99.0, 1.0, 0.0] leaves no validation document of data.source={root} (31 files "
                    "matching data.glob='*.txt', one document each): give it more files, a larger validation "
                    "share, or data.valid_blend")
    assert corpus_split_problems(cfg, evaluating=False) == []
    cfg.split = [90.0, 10.0, 0.0]
    assert corpus_split_problems(cfg, evaluating=True) == []
    # the split the build would have refused after tokenizing
    cfg.split = [99.0, 1.0, 0.0]
    with pytest.raises(DataCacheError, match="leaves no validation document"):
        build_datasets(cfg, build_tokenizer("byte"), 16, train_samples=4, valid_samples=2)
