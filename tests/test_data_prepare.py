"""`python -m data.prepare`: every input kind read back exactly (megatron's IndexedDataset against
the tokenizer's own ids), the same bytes whatever the worker count or sharding, bad records
skipped and counted (--strict refuses them), bad input refused with one line and nothing written,
an interrupted run leaving nothing, and --describe on a dataset made without a .json.

A real BPE tokenizer (tests/tokenizer_fixtures.py) and small chunks, so that a few hundred KB of
input make dozens of chunks in flight at once. Runs are in-process through data.prepare.main (as
`python -m` calls it) except the interrupted ones, which are real processes sent real signals.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizer_fixtures import make_bpe_tokenizer

from data import prepare, prepare_inputs
from data.prepared import check_prefix, read_metadata
from data.tokenizer import build_tokenizer

REPO = Path(__file__).resolve().parents[1]
UNICODE = "naïve café — 日本語のテキスト ✓ \U0001f600\n"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return make_bpe_tokenizer(tmp_path_factory.mktemp("tok") / "bpe")


@pytest.fixture(scope="module")
def tok(tok_dir):
    return build_tokenizer(str(tok_dir))


@pytest.fixture(scope="module")
def texts():
    """~150 KB of real text: slices of stdlib modules, some with non-ASCII characters."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))[100:170]
    out = []
    for i, path in enumerate(files):
        text = path.read_text(encoding="utf-8")[: 500 + 97 * i % 3000]
        out.append(text + UNICODE if i % 3 == 0 else text)
    return out


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(prepare_inputs, "CHUNK_BYTES", 4096)


def run(*args) -> tuple[int, str, str]:
    """data.prepare's main with `args`; (exit status, stdout, stderr)."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = prepare.main([str(a) for a in args])
    return rc, out.getvalue(), err.getvalue()


def read_back(prefix) -> list[list[int]]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(str(prefix), mmap=True)
    assert len(ds.document_indices) == len(ds) + 1  # one sequence per document
    return [ds[i].tolist() for i in range(len(ds))]


def expected(tok, docs, bos=False) -> list[list[int]]:
    return [([tok.bos] if bos else []) + tok.tokenize(d).tolist() + [tok.eod] for d in docs]


def write_jsonl(path: Path, records) -> Path:
    lines = "".join(json.dumps(r) + "\n" for r in records).encode()
    path.write_bytes(gzip.compress(lines) if path.name.endswith(".gz") else lines)
    return path


def write_datasets_dir(path: Path, docs: list[str], shards: int = 2, batch: int = 4) -> Path:
    """What datasets' save_to_disk writes: Arrow IPC streams data-*.arrow listed by state.json."""
    path.mkdir()
    names, per = [], -(-len(docs) // shards)
    for s in range(shards):
        name = f"data-{s:05d}-of-{shards:05d}.arrow"
        part = docs[s * per:(s + 1) * per]
        table = pa.table({"id": list(range(len(part))), "text": part})
        with pa.ipc.new_stream(str(path / name), table.schema) as writer:
            for b in table.to_batches(max_chunksize=batch):
                writer.write_batch(b)
        names.append(name)
    (path / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names], "_split": "train"}))
    (path / "dataset_info.json").write_text(json.dumps({"features": {"text": {"dtype": "string", "_type": "Value"}}}))
    return path


def test_every_input_kind_reads_back_as_the_tokenizers_ids(tmp_path, tok, tok_dir, texts):
    # a text directory (sorted relative paths, hidden files left out), a jsonl.gz, a parquet file
    # of several row groups, a datasets directory of two shards: one call, in the order given
    text_dir = tmp_path / "texts"
    (text_dir / "b").mkdir(parents=True)
    tdocs = texts[:6]
    for i, d in enumerate(tdocs):
        (text_dir / ("b" if i % 2 else "") / f"{i:02d}.txt").write_text(d, encoding="utf-8")
    (text_dir / ".hidden.txt").write_text("left out")
    text_order = sorted(range(6), key=lambda i: f"b/{i:02d}.txt" if i % 2 else f"{i:02d}.txt")
    jdocs, pdocs, adocs = texts[6:30], texts[30:50], texts[50:]
    jsonl = write_jsonl(tmp_path / "docs.jsonl.gz", [{"id": i, "text": d} for i, d in enumerate(jdocs)])
    parquet = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"text": pdocs}), parquet, row_group_size=7)
    hf = write_datasets_dir(tmp_path / "hf", adocs)

    prefix = tmp_path / "out" / "mixed"
    rc, out, err = run(text_dir, jsonl, parquet, hf, "--tokenizer", tok_dir, "--output-prefix", prefix,
                       "--workers", 2)
    assert rc == 0, err
    docs = [tdocs[i] for i in text_order] + jdocs + pdocs + adocs
    assert read_back(prefix) == expected(tok, docs)
    meta = read_metadata(prefix)
    assert meta["documents"] == len(docs)
    assert meta["tokens"] == sum(len(e) for e in expected(tok, docs))
    assert meta["source"] == [str(p.resolve()) for p in (text_dir, jsonl, parquet, hf)]
    assert meta["tokenizer"] == {**tok.identity, "path": str(tok_dir.resolve())}
    assert meta["add_bos"] is False and meta["skipped"] == {} and meta["dtype"] == "uint16"
    assert check_prefix(prefix, full=True) is None  # what the trainer checks before training
    assert f"{len(docs):,} documents" in out and str(prefix) + ".json" in out
    # a small input's size in kB, not as "0.0 MB"
    assert re.search(r"[1-9][0-9.,]* kB of input", out), out
    assert sorted(p.name for p in prefix.parent.iterdir()) == ["mixed.bin", "mixed.idx", "mixed.json"]


def test_same_bytes_whatever_the_workers_and_shards(tmp_path, tok, tok_dir, texts, monkeypatch):
    data = write_jsonl(tmp_path / "docs.jsonl", [{"text": d} for d in texts])
    common = [data, "--tokenizer", tok_dir, "--add-bos"]
    built = []
    real_builder = prepare._builder
    monkeypatch.setattr(prepare, "_builder", lambda *a: built.append(a) or real_builder(*a))

    files = {}
    for name, extra in (("one", ["--workers", 1]), ("two", ["--workers", 2]),
                        ("shards", ["--workers", 2, "--shard-size", "20K"])):
        built.clear()
        rc, _, err = run(*common, "--output-prefix", tmp_path / name, *extra)
        assert rc == 0, err
        files[name] = [Path(f"{tmp_path / name}{ext}").read_bytes() for ext in (".bin", ".idx")]
        if name == "shards":
            assert len(built) >= 4  # at least three shards and the merge
    assert files["one"] == files["two"] == files["shards"]
    assert read_back(tmp_path / "one") == expected(tok, texts, bos=True)
    assert read_metadata(tmp_path / "shards")["add_bos"] is True

    # an existing dataset is refused, then replaced with --overwrite
    rc, _, err = run(*common, "--output-prefix", tmp_path / "one")
    assert rc == 2 and "--overwrite" in err
    rc, _, err = run(data, "--tokenizer", tok_dir, "--output-prefix", tmp_path / "one", "--overwrite")
    assert rc == 0, err
    assert read_back(tmp_path / "one") == expected(tok, texts)
    assert check_prefix(tmp_path / "one") is None


def test_bad_records_are_skipped_counted_and_named(tmp_path, tok, tok_dir):
    good = ["first document", "second one " + UNICODE, "third"]
    lines = [
        json.dumps({"text": good[0]}).encode(),
        b'{"text": "unterminated',  # line 2: not JSON
        json.dumps({"body": "no text field"}).encode(),  # 3
        json.dumps({"text": 17}).encode(),  # 4: not a string
        b'{"text": "caf\xe9"}',  # 5: Latin-1 bytes, not UTF-8
        b'{"text": "lone \\ud800 surrogate"}',  # 6: valid JSON, not UTF-8 text
        json.dumps({"text": ""}).encode(),  # 7: empty
        b"",  # 8: blank line (empty)
        json.dumps({"text": good[1]}).encode(),
        b"[1, 2]",  # 10: no field
        json.dumps({"text": good[2]}).encode(),
    ]
    data = tmp_path / "bad.jsonl"
    data.write_bytes(b"\n".join(lines) + b"\n")
    parquet = tmp_path / "nulls.parquet"
    pq.write_table(pa.table({"text": ["kept", None, ""]}), parquet)

    rc, out, err = run(data, parquet, "--tokenizer", tok_dir, "--output-prefix", tmp_path / "out")
    assert rc == 0, err
    assert read_back(tmp_path / "out") == expected(tok, good + ["kept"])
    skipped = read_metadata(tmp_path / "out")["skipped"]
    assert skipped == {"not JSON": 1, "no field": 2, "not a string": 2, "not valid UTF-8": 2, "empty": 3}
    line = next(x for x in out.splitlines() if x.startswith("skipped"))
    assert line.startswith("skipped 10 records")
    for where in ("bad.jsonl:2: not JSON", "bad.jsonl:3: no field", "bad.jsonl:4: not a string",
                  "bad.jsonl:5: not valid UTF-8", "bad.jsonl:6: not valid UTF-8"):
        assert where in line

    # --strict: the first bad record is an error, and nothing is written
    out_dir = tmp_path / "strict"
    rc, _, err = run(data, "--tokenizer", tok_dir, "--output-prefix", out_dir / "x", "--strict")
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("error: ") and f"{data}:2: not JSON" in err
    assert not out_dir.exists()


def _bad_inputs(tmp: Path, tok_dir: Path):
    """(name, args, what the error names)"""
    (tmp / "empty.jsonl").write_bytes(b"")
    (tmp / "data.csv").write_text("text\nhello\n")
    write_jsonl(tmp / "wrong_field.jsonl", [{"content": "a"}, {"content": "b"}])
    pq.write_table(pa.table({"body": ["a"]}), tmp / "nocol.parquet")
    (tmp / "no_tokenizer").mkdir()
    (tmp / "no_tokenizer" / "config.json").write_text("{}")
    (tmp / "a_file").write_text("not a directory")
    (tmp / "taken.bin").write_bytes(b"")
    ok = write_jsonl(tmp / "ok.jsonl", [{"text": "fine"}])
    out = ["--output-prefix", tmp / "out" / "x"]
    tok = ["--tokenizer", tok_dir]
    return [
        ("missing input", [tmp / "nope.jsonl", *tok, *out], "nope.jsonl: no such file"),
        ("empty input", [ok, tmp / "empty.jsonl", *tok, *out], "empty.jsonl: empty"),
        ("no documents", [ok, tmp / "wrong_field.jsonl", *tok, *out], "wrong_field.jsonl: no documents (2 no field"),
        ("unknown kind", [tmp / "data.csv", *tok, *out], "data.csv: unknown kind"),
        ("no column", [tmp / "nocol.parquet", *tok, *out], "nocol.parquet: no column 'text'"),
        ("no tokenizer files", [ok, "--tokenizer", tmp / "no_tokenizer", *out], "no_tokenizer holds no tokenizer"),
        ("output not writable", [ok, *tok, "--output-prefix", tmp / "a_file" / "x"], "a_file"),
        ("output exists", [ok, *tok, "--output-prefix", tmp / "taken"], "taken.bin exists"),
        # not a sibling DIR.bin of the directory
        ("output a directory", [ok, *tok, "--output-prefix", f"{tmp}/out/"], f"{tmp}/out/ names a directory"),
        ("described a directory", ["--describe", f"{tmp}/", *tok], f"{tmp}/ names a directory"),
    ]


def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, tok_dir):
    cases = _bad_inputs(tmp_path, tok_dir)
    before = sorted(p.name for p in tmp_path.iterdir())
    for name, args, names in cases:
        rc, out, err = run(*args)
        assert rc == 2, (name, err)
        assert err.startswith("error: ") and err.count("\n") == 1, (name, err)
        assert names in err, (name, err)
        assert sorted(p.name for p in tmp_path.iterdir()) == before, name  # not even a directory


def _work_in_progress(out_dir: Path, proc, timeout: float = 240.0) -> None:
    """Wait until the run has written tokens into its temporary directory."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        if any(p.stat().st_size > 0 for p in out_dir.glob(".*.prepare-*/data.bin")):
            return
        time.sleep(0.2)
    raise AssertionError("the run never started writing")


def test_a_directory_another_prepare_makes_meanwhile_is_used_and_kept(tmp_path, monkeypatch):
    """Two prepares of prefixes in one new directory, started together: the one whose mkdir comes
    second finds it made (as a parallel run does between the check and the mkdir) and goes on,
    and does not count it as its own to remove on failure."""
    shared = tmp_path / "new" / "data"
    shared.mkdir(parents=True)
    real_exists = Path.exists
    # seen as missing by the check, present by the time of the mkdir
    monkeypatch.setattr(Path, "exists", lambda p: False if p in (shared, shared.parent) else real_exists(p))
    assert prepare._make_parent(shared / "web") == []
    assert shared.is_dir()
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(Path, "exists", lambda p: False if p == tmp_path / "file" else real_exists(p))
    with pytest.raises(prepare.InputError, match="cannot write in"):
        prepare._make_parent(tmp_path / "file" / "web")


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_interrupted_run_leaves_nothing(tmp_path, tok_dir, texts, how):
    # ~15 MB: minutes of tokenizing here, interrupted after the first chunks are written
    data = write_jsonl(tmp_path / "big.jsonl", [{"text": d} for d in texts * 100])
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "data.prepare", data, "--tokenizer", tok_dir, "--workers", "2",
                             "--output-prefix", out_dir / "big"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)},
                            # a terminal's shell starts it with SIGINT's default action; a suite run
                            # in the background (`nohup make test &`) ignores SIGINT, which a child
                            # would inherit (and Python then keeps ignoring it)
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        _work_in_progress(out_dir, proc)
        workers = psutil.Process(proc.pid).children(recursive=True)
        assert len(workers) == 2
        if how == "ctrl-c":  # a terminal sends SIGINT to the whole foreground process group
            os.killpg(proc.pid, signal.SIGINT)
            want = 128 + signal.SIGINT
        else:  # `kill PID`, a scheduler's preemption
            proc.send_signal(signal.SIGTERM)
            want = 128 + signal.SIGTERM
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == want, err
    assert "interrupted" in err and "Traceback" not in err
    assert list(out_dir.iterdir()) == []
    _, alive = psutil.wait_procs(workers, timeout=30)
    assert alive == []


def test_describe_a_dataset_made_elsewhere(tmp_path, tok, tok_dir, texts):
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    # as Megatron-LM's preprocess_data.py --append-eod writes one: a document per record + EOD
    prefix = tmp_path / "megatron_text_document"
    dtype = DType.optimal_dtype(tok.vocab_size)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    docs = expected(tok, texts[:10])
    for ids in docs:
        builder.add_document(np.array(ids, dtype=dtype), [len(ids)])
    builder.finalize(f"{prefix}.idx")
    assert ".json is missing" in check_prefix(prefix)

    rc, out, err = run("--describe", prefix, "--tokenizer", tok_dir)
    assert rc == 0, err
    meta = read_metadata(prefix)
    assert meta["documents"] == 10 and meta["tokens"] == sum(len(d) for d in docs)
    assert meta["tokenizer"]["sha256"] == tok.identity["sha256"] and meta["add_bos"] is False
    assert meta["sequences_without_eod"] == 0 and "warning" not in err
    assert check_prefix(prefix, full=True) is None

    # ids beyond the tokenizer's vocabulary: made with another tokenizer
    other = tmp_path / "other"
    builder = IndexedDatasetBuilder(f"{other}.bin", dtype=np.int32)
    builder.add_document(np.array([5, tok.vocab_size + 3, tok.eod], dtype=np.int32), [3])
    builder.finalize(f"{other}.idx")
    rc, _, err = run("--describe", other, "--tokenizer", tok_dir)
    assert rc == 2 and f"token id {tok.vocab_size + 3:,}" in err and err.count("\n") == 1
    assert not Path(f"{other}.json").exists()


def test_a_misspelled_option_is_named_with_the_closest_one(tmp_path, capsys):
    """`--tokenizr DIR` (argparse alone says "the following arguments are required: --tokenizer")."""
    for args, named in ((["a.jsonl", "--tokenizr", "byte", "--output-prefix", "x"],
                         "unrecognized option --tokenizr (did you mean --tokenizer?)"),
                        (["a.jsonl", "--tokenizer=byte", "--output-prefx=x"],
                         "unrecognized option --output-prefx (did you mean --output-prefix?)")):
        with pytest.raises(SystemExit) as e:
            prepare.main(args)
        assert e.value.code == 2 and named in capsys.readouterr().err
    # an unambiguous prefix stays an option, as argparse takes it
    rc, _, err = run("--tok", "byte", "--output", tmp_path / "x")
    assert rc == 2 and "give INPUT... and --output-prefix PREFIX" in err
