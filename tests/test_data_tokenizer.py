"""Tokenizers (byte and a real Hugging Face BPE trained here) and the checks of prepared datasets:
what ids text becomes, what identifies a tokenizer, and each damaged or inconsistent dataset
named as it is."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tokenizer_fixtures import EOS, make_bpe_tokenizer, stdlib_texts, write_prepared

TEXT = 'def greet(name):\n    return f"hello, {name}!"  # ünïcödé\n'


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> Path:
    return make_bpe_tokenizer(tmp_path_factory.mktemp("tok") / "bpe")


def test_token_index_names_the_token_holding_a_byte(bpe):
    """token_index(text, at): the token of tokenize(text) whose bytes hold byte `at`, after
    multi-byte characters too (offsets count characters); the byte tokenizer's is the byte."""
    from data.tokenizer import ByteTokenizer, HFTokenizer

    tok = HFTokenizer(bpe)
    text = "caf\u00e9 = '\u00fcber'\nVAR_x = 48213\nKEY = \"90817\"\n".encode()
    ids = tok.tokenize(text)
    for value in (b"48213", b"90817", b"ber", b"VAR_x"):
        at = text.index(value)
        t = tok.token_index(text, at)
        before, through = (len(tok.detokenize(ids[:n]).encode()) for n in (t, t + 1))
        assert before <= at < through, (value, t, before, through)
    assert ByteTokenizer().token_index(text, 17) == 17


def test_hf_tokenizer_encodes_as_transformers_does_without_special_tokens(bpe):
    from transformers import AutoTokenizer

    from data.tokenizer import build_tokenizer

    tok = build_tokenizer(str(bpe))
    hf = AutoTokenizer.from_pretrained(str(bpe))
    want = hf(TEXT, add_special_tokens=False).input_ids
    assert tok.tokenize(TEXT).tolist() == want and tok.tokenize(TEXT).dtype == np.int32
    texts = stdlib_texts(3)
    assert [ids.tolist() for ids in tok.tokenize_batch(texts)] == [hf(t, add_special_tokens=False).input_ids
                                                                    for t in texts]
    assert tok.detokenize(tok.tokenize(TEXT)) == TEXT
    assert tok.eod == hf.convert_tokens_to_ids(EOS) and tok.bos == hf.bos_token_id
    assert tok.vocab_size == len(hf) == 1000


def test_identity_survives_a_resave_and_changes_with_the_vocabulary_or_the_eod(bpe, tmp_path):
    from transformers import AutoTokenizer

    from data.tokenizer import HFTokenizer, identities_match

    a = HFTokenizer(bpe).identity
    AutoTokenizer.from_pretrained(str(bpe)).save_pretrained(str(tmp_path / "again"))
    b = HFTokenizer(tmp_path / "again").identity
    assert identities_match(a, b) and a["sha256"] == b["sha256"]
    assert not identities_match(a, HFTokenizer(bpe, eod_token="<s>").identity)
    other = make_bpe_tokenizer(tmp_path / "other", vocab_size=900)
    assert not identities_match(a, HFTokenizer(other).identity)


def test_bad_tokenizer_directories_are_named(tmp_path, bpe):
    from data.tokenizer import TokenizerError, build_tokenizer

    (tmp_path / "empty").mkdir()
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer.json").write_text("{not json")
    # a byte-tokenizer checkpoint's tokenizer folder holds its identity only
    (tmp_path / "byte").mkdir()
    (tmp_path / "byte" / "identity.json").write_text(json.dumps(build_tokenizer("byte").identity))
    cases = {str(tmp_path / "missing"): "does not exist", str(tmp_path / "empty"): "holds no tokenizer files",
             str(tmp_path / "broken"): "could not be loaded as a Hugging Face tokenizer: tokenizer.json is not valid "
                                       "JSON \\(Expecting property name",
             str(tmp_path / "byte"): "records the byte tokenizer, which has no files: use `byte`"}
    for spec, why in cases.items():
        with pytest.raises(TokenizerError, match=why) as e:
            build_tokenizer(spec)
        assert spec in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(TokenizerError, match="'<nope>' is not a token"):
        build_tokenizer(str(bpe), "<nope>")
    # a real tokenizer's file damaged past its start (the tokenizers library's own error names no file)
    import shutil

    shutil.copytree(bpe, tmp_path / "damaged")
    text = (tmp_path / "damaged" / "tokenizer.json").read_text()
    (tmp_path / "damaged" / "tokenizer.json").write_text(text[:500] + "\x01" + text[500:])
    with pytest.raises(TokenizerError, match=r"damaged could not be loaded as a Hugging Face tokenizer: "
                                             r"tokenizer.json is not valid JSON \(.* line \d+ column \d+"):
        build_tokenizer(str(tmp_path / "damaged"))


def _dataset(root: Path, tokenizer, name: str = "web", count: int = 4) -> Path:
    return write_prepared(root / name, stdlib_texts(count), tokenizer)


def test_a_prepared_dataset_checks_out_and_each_damage_is_named(tmp_path):
    from data.prepared import check_prefix
    from data.tokenizer import build_tokenizer

    prefix = _dataset(tmp_path, build_tokenizer("byte"))
    assert check_prefix(prefix) is None
    copies = {}
    for case in ("idx_truncated", "bin_grown", "bin_swapped", "no_json", "no_idx"):
        d = tmp_path / case
        d.mkdir()
        for ext in (".bin", ".idx", ".json"):
            shutil.copy(f"{prefix}{ext}", d / f"web{ext}")
        copies[case] = d / "web"
    Path(f"{copies['idx_truncated']}.idx").write_bytes(Path(f"{prefix}.idx").read_bytes()[:40])
    with open(f"{copies['bin_grown']}.bin", "ab") as f:
        f.write(b"\0" * 8)
    Path(f"{copies['no_json']}.json").unlink()
    Path(f"{copies['no_idx']}.idx").unlink()
    # a .bin of the right size but other bytes: the sampled hashes see it, the full hash too
    data = bytearray(Path(f"{prefix}.bin").read_bytes())
    data[:64] = bytes(64)
    Path(f"{copies['bin_swapped']}.bin").write_bytes(bytes(data))

    assert "web.idx is " in check_prefix(copies["idx_truncated"]) and "truncated" in check_prefix(copies["idx_truncated"])
    assert "web.bin is " in check_prefix(copies["bin_grown"])
    assert "differs from what was built" in check_prefix(copies["bin_swapped"], full=True)
    assert "web.json is missing" in check_prefix(copies["no_json"]) and "data.prepare" in check_prefix(copies["no_json"])
    assert "web.idx is missing" in check_prefix(copies["no_idx"])


def test_an_index_that_does_not_describe_its_bin_is_refused(tmp_path):
    """Two files of different datasets under one prefix, each matching its own description."""
    from data.prepared import check_prefix, write_metadata
    from data.tokenizer import build_tokenizer

    tok = build_tokenizer("byte")
    a, b = _dataset(tmp_path / "a", tok, count=3), _dataset(tmp_path / "b", tok, count=5)
    shutil.copy(f"{b}.bin", f"{a}.bin")
    meta = json.loads(Path(f"{a}.json").read_text())
    write_metadata(a, {k: v for k, v in meta.items() if k not in ("format", "files")})
    assert "do not belong together" in check_prefix(a)


def test_blend_entries_and_tokenizers_are_checked_together(tmp_path, bpe):
    from types import SimpleNamespace

    from data.prepared import check_blends, parse_blend
    from data.tokenizer import build_tokenizer

    byte, hf = build_tokenizer("byte"), build_tokenizer(str(bpe))
    x, y = _dataset(tmp_path, byte, "x"), _dataset(tmp_path, hf, "y")
    prefixes, weights, problems = parse_blend([[0.3, str(x)], str(y)], "data.blend")
    assert (prefixes, weights, problems) == ([str(x), str(y)], [0.3, 1.0], [])
    _, _, problems = parse_blend([[0, "a"], [1, "b"], [2, "b"], ["w", "c"], [1, "d.bin"]], "data.blend")
    assert problems == ["data.blend[0]: weight 0.0 of a must be > 0", "data.blend: b is listed twice (give it one weight)",
                        "data.blend[3]: weight 'w' is not a number",
                        "data.blend[4]: d.bin names a file; give the prefix without its extension"]
    # weights outside the pairs: one line each, not a weight read as a prefix ("0.3.json is missing")
    # nor a prefix as a weight of 1
    assert parse_blend([0.7, "a", 0.3, "b"], "data.blend")[2] == [
        "data.blend: weights and prefixes in one list (Megatron-LM's --data-path order); give pairs: "
        "data.blend=[[0.7,a],[0.3,b]]"]
    assert parse_blend([0.7, "a", 0.3], "data.blend")[2] == [
        "data.blend: 2 weight(s) [0.7, 0.3] among 1 prefix(es) ['a']: give one [weight, prefix] pair per dataset, "
        "data.blend=[[weight,prefix],...] (or prefixes alone, weight 1)"]
    assert parse_blend([[0.7, 0.3], ["a", "b"]], "data.blend")[2] == [
        "data.blend: weights and prefixes in two lists; give one [weight, prefix] pair per dataset: "
        "data.blend=[[0.7,a],[0.3,b]]"]
    assert parse_blend([[0.7, 0.3, 0.1], ["a", "b"]], "data.blend")[2] == [
        "data.blend: 3 weight(s) [0.7, 0.3, 0.1] for 2 prefix(es) ['a', 'b']; give one [weight, prefix] pair per "
        "dataset: data.blend=[[weight,prefix],...]"]
    assert parse_blend([[1, "a"], [0.3, 0.2]], "data.blend")[2] == [
        "data.blend[1]: [0.3, 0.2] has no prefix (0.2 is a number); give one [weight, prefix] pair per dataset: "
        "data.blend=[[weight,prefix],...], and quote a prefix that reads as a number: [0.3,'0.2']"]
    # a dataset named 2024: Hydra reads data.blend=[[1,2024]] (or [2024]) as a number
    assert parse_blend([2024], "data.blend")[2] == [
        "data.blend: 1 weight(s) [2024] among 0 prefix(es) []: give one [weight, prefix] pair per dataset, "
        "data.blend=[[weight,prefix],...] (or prefixes alone, weight 1); quote a prefix that reads as a number: "
        "['2024']"]
    assert parse_blend([[1, 2024]], "data.blend")[2] == [
        "data.blend[0]: [1, 2024] has no prefix (2024 is a number); give one [weight, prefix] pair per dataset: "
        "data.blend=[[weight,prefix],...], and quote a prefix that reads as a number: [1,'2024']"]

    cfg = SimpleNamespace(blend=[[1, str(x)], [1, str(y)]], valid_blend=None, verify_cache=False,
                          tokenizer_mismatch="refuse")
    problems = check_blends(cfg, byte.identity)
    assert len(problems) == 1 and "prepared with different tokenizers" in problems[0]
    cfg.blend = [[1, str(y)]]
    problems = check_blends(cfg, byte.identity)
    assert len(problems) == 1 and f"is not the tokenizer {y} was prepared with" in problems[0]
    assert check_blends(cfg, hf.identity) == []
    cfg.tokenizer_mismatch = "allow"
    assert check_blends(cfg, byte.identity) == []


def test_a_validation_dataset_holding_training_tokens_is_refused(tmp_path):
    """data.valid_blend naming a data.blend dataset, or a copy of one under another prefix, would
    measure the validation loss on training data; other documents pass."""
    from types import SimpleNamespace

    from data.prepared import check_blends
    from data.tokenizer import build_tokenizer

    byte = build_tokenizer("byte")
    train, held_out = _dataset(tmp_path, byte, "train"), _dataset(tmp_path, byte, "held", count=2)
    copy = tmp_path / "copy" / "train"
    copy.parent.mkdir()
    for ext in (".bin", ".idx", ".json"):
        shutil.copy(f"{train}{ext}", f"{copy}{ext}")
    cfg = SimpleNamespace(blend=[[1, str(train)]], valid_blend=[[1, str(held_out)]], verify_cache=False,
                          tokenizer_mismatch="refuse")
    assert check_blends(cfg, byte.identity) == []
    for valid in (train, copy):
        cfg.valid_blend = [[1, str(held_out)], [1, str(valid)]]
        assert check_blends(cfg, byte.identity) == [
            f"data.valid_blend: {valid} holds the same tokens as data.blend's {train}, so validation would measure "
            "training data; leave data.valid_blend unset (data.split holds out a share of each dataset's "
            "documents), or prepare held-out documents as a dataset of their own"]


def test_train_tokenizer_writes_a_tokenizer_the_trainer_and_prepare_read(tmp_path):
    """`python -m data.train_tokenizer` on a text directory: a BPE of the asked size whose EOS ends
    documents, that encodes any text (bytes it never saw too) and round-trips; bad input is one line."""
    from data.prepare import main as prepare
    from data.prepared import read_metadata
    from data.tokenizer import build_tokenizer
    from data.train_tokenizer import BOS, EOS
    from data.train_tokenizer import main as train_tokenizer

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, text in enumerate(stdlib_texts(12)):
        (corpus / f"{i:02d}.py").write_text(text)
    (corpus / "notes.md").write_text("not a .py file")
    out = tmp_path / "tok"
    assert train_tokenizer([str(corpus), "--glob", "*.py", "--vocab-size", "400", "--output", str(out)]) == 0
    tok = build_tokenizer(str(out))
    assert tok.vocab_size == 400 and tok.detokenize([tok.eod]) == EOS and tok.detokenize([tok.bos]) == BOS
    unseen = "λx → 𝔼[x] 漢字 " + TEXT
    seen = stdlib_texts(1)[0]
    assert tok.detokenize(tok.tokenize(unseen)) == unseen and len(tok.tokenize(seen)) < len(seen.encode()) / 1.5  # merges learned

    assert prepare([str(corpus), "--glob", "*.py", "--tokenizer", str(out), "--output-prefix",
                    str(tmp_path / "ds"), "--workers", "1"]) == 0
    meta = read_metadata(tmp_path / "ds")
    assert meta["documents"] == 12 and meta["tokenizer"]["sha256"] == tok.identity["sha256"]

    assert train_tokenizer([str(corpus), "--vocab-size", "400", "--output", str(out)]) == 2  # exists, not empty
    assert train_tokenizer([str(corpus), "--vocab-size", "100", "--output", str(tmp_path / "t2")]) == 2
    assert train_tokenizer([str(tmp_path / "missing"), "--vocab-size", "400", "--output", str(tmp_path / "t3")]) == 2


def test_init_from_without_a_recorded_tokenizer_needs_one_named(tmp_path):
    """A checkpoint converted without its tokenizer files records none: the run refuses to fall
    back on the byte tokenizer (its ids would train another vocabulary's embedding rows) until
    data.tokenizer names one or the mismatch is allowed; a recorded tokenizer is taken as before."""
    from types import SimpleNamespace

    from data.tokenizer import build_tokenizer
    from msa_model.training.data_setup import IDENTITY_FILE, TOKENIZER_DIR, tokenizer_problems

    bare, recorded = tmp_path / "bare", tmp_path / "recorded"
    bare.mkdir()
    (recorded / TOKENIZER_DIR).mkdir(parents=True)
    (recorded / TOKENIZER_DIR / IDENTITY_FILE).write_text(json.dumps(build_tokenizer("byte").identity))

    def problems(init_dir, tokenizer=None, mismatch="refuse"):
        data = SimpleNamespace(tokenizer=tokenizer, eod_token=None, add_bos=False, blend=None, valid_blend=None,
                               tokenizer_mismatch=mismatch, source=None)
        cfg = SimpleNamespace(data=data, model=SimpleNamespace(vocab_size=32000), trainer=SimpleNamespace(eval_interval=0))
        return tokenizer_problems(cfg, None, init_dir)[2]

    (refused,) = problems(bare)
    assert f"init_from {bare} records no tokenizer" in refused and "its 32000 embedding rows" in refused
    assert "data.tokenizer=<its directory>" in refused
    assert problems(bare, tokenizer="byte") == []
    assert problems(bare, mismatch="allow") == []
    assert problems(recorded) == [] and problems(None) == []


def test_train_tokenizer_refuses_inputs_without_documents_and_says_what_it_did(tmp_path, capsys, caplog, monkeypatch):
    """A --field the records do not have trained a 258-entry tokenizer on nothing and wrote it; a
    file as --output was a traceback; an unreached --vocab-size and a long read without a terminal
    were silent."""
    import json

    from data import train_tokenizer as module

    records = tmp_path / "a.jsonl"
    records.write_text("".join(json.dumps({"text": t}) + "\n" for t in stdlib_texts(6)))
    out = tmp_path / "tok"
    assert module.main([str(records), "--field", "body", "--vocab-size", "400", "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert "no documents to train on (6 no field skipped; --field is 'body'" in err and not out.exists(), err
    assert module.main([str(records), "--vocab-size", "400", "--output", str(records)]) == 2
    assert "is not an empty directory" in capsys.readouterr().err

    # a progress line at every read (as if 30 s passed each time), then one before the merges
    monkeypatch.setattr(module, "PLAIN_PROGRESS_SECONDS", 0.0)
    monkeypatch.setattr(module.sys.stderr, "isatty", lambda: False, raising=False)
    with caplog.at_level("INFO", logger="data.train_tokenizer"):
        assert module.main([str(records), "--vocab-size", "100000", "--output", str(out)]) == 0
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("train_tokenizer: read 1 documents") for line in lines), lines
    assert any(line.startswith("train_tokenizer: read 6 documents") and "computing the merges" in line for line in lines)
    assert any("--vocab-size 100000 not reached" in line for line in lines), lines


def test_a_blend_whose_tokenizer_directory_moved_is_named_as_such(tmp_path, bpe):
    """Not "data.tokenizer: byte-v1 is not the tokenizer ... was prepared with": the run fell back
    on the byte tokenizer because the recorded directory is gone, and data.tokenizer was never set."""
    from types import SimpleNamespace

    from data.tokenizer import build_tokenizer
    from msa_model.training.data_setup import tokenizer_problems

    shutil.copytree(bpe, tmp_path / "tok")
    prefix = _dataset(tmp_path, build_tokenizer(str(tmp_path / "tok")))
    (tmp_path / "tok").rename(tmp_path / "moved")

    def problems(tokenizer=None):
        data = SimpleNamespace(tokenizer=tokenizer, eod_token=None, add_bos=False, blend=[str(prefix)], valid_blend=None,
                               tokenizer_mismatch="refuse", verify_cache=False, split=[99, 1, 0])
        cfg = SimpleNamespace(data=data, model=SimpleNamespace(vocab_size=None, seq_length=64),
                              trainer=SimpleNamespace(eval_interval=0))
        return tokenizer_problems(cfg, None, None)[2]

    assert problems() == [f"data.blend: the tokenizer its datasets were prepared with, {tmp_path / 'tok'}, no longer "
                          "exists; name it where it is now: data.tokenizer=DIR"]
    assert problems(str(tmp_path / "moved")) == []
    assert "is not the tokenizer" in problems("byte")[0]


def test_a_blend_on_a_run_dir_that_resumes_another_tokenizer_says_to_start_a_new_run(tmp_path, bpe):
    """`make train` then the README's blend command on CPU: run_dir is still runs/tiny-pt, whose
    checkpoint holds the byte tokenizer. Not "data.tokenizer: byte-v1 ... use that one" (the user
    named none, and naming the blend's would be refused against the checkpoint): the line says
    where the tokenizer came from and that these datasets need a run of their own."""
    from types import SimpleNamespace

    from data.tokenizer import build_tokenizer
    from msa_model.training.data_setup import IDENTITY_FILE, TOKENIZER_DIR, tokenizer_problems

    prefix = _dataset(tmp_path, build_tokenizer(str(bpe)))
    step_dir = tmp_path / "run" / "checkpoints" / "step_00000080"
    (step_dir / TOKENIZER_DIR).mkdir(parents=True)
    (step_dir / TOKENIZER_DIR / IDENTITY_FILE).write_text(json.dumps(build_tokenizer("byte").identity))
    data = SimpleNamespace(tokenizer=None, eod_token=None, add_bos=False, blend=[str(prefix)], valid_blend=None,
                           tokenizer_mismatch="refuse", verify_cache=False, split=[99, 1, 0])
    cfg = SimpleNamespace(data=data, model=SimpleNamespace(vocab_size=None, seq_length=64),
                          trainer=SimpleNamespace(eval_interval=0))
    (line,) = tokenizer_problems(cfg, step_dir, None)[2]
    assert f"(the checkpoint this run resumes ({step_dir})) is not the tokenizer {prefix} was prepared" in line, line
    assert line.endswith("; train on them in a new run (another run_dir=)"), line
