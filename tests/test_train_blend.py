"""Training on prepared datasets, as a user runs it: a weighted blend of two datasets made with a
real BPE tokenizer, a validation loss, the tokenizer recorded in the checkpoint and taken from it on
resume; and every bad input refused before anything is written (one line each, exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from skeleton_helpers import metrics, run_train
from tokenizer_fixtures import make_bpe_tokenizer, stdlib_texts, write_prepared

# the tiny test model with a 1000-entry vocabulary: 4 x 256 tokens a step
STEPS = ("trainer.max_steps=4", "trainer.indexer_warmup_tokens=2048", "checkpoint.interval=0",
         "trainer.eval_interval=2", "trainer.eval_iters=1")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """(tokenizer dir, [prefix a, prefix b]): two datasets of different stdlib modules."""
    from data.tokenizer import build_tokenizer

    root = tmp_path_factory.mktemp("prepared")
    tok_dir = make_bpe_tokenizer(root / "tokenizer")
    tok = build_tokenizer(str(tok_dir))
    return tok_dir, [write_prepared(root / "code-a", stdlib_texts(40), tok),
                     write_prepared(root / "code-b", stdlib_texts(40, offset=40), tok)]


def _blend(a: Path, b: Path) -> str:
    return f"data.blend=[[0.7,{a}],[0.3,{b}]]"


def test_a_blend_trains_validates_and_resumes_with_its_tokenizer(tmp_path, prepared):
    tok_dir, (a, b) = prepared
    run = tmp_path / "run"
    proc = run_train(run, *STEPS, _blend(a, b), "data.split=[90,10,0]", f"data.tokenizer={tok_dir}",
                     "trainer.stop_at_step=2", data_cache=tmp_path / "cache")
    out = proc.stdout + proc.stderr
    assert "tokenizer tokenizer (vocabulary 1000" in out and "validation at step 2" in out
    ckpt = run / "checkpoints" / "step_00000002" / "tokenizer"
    identity = json.loads((ckpt / "identity.json").read_text())
    assert identity["vocab_size"] == 1000 and (ckpt / "tokenizer.json").is_file()
    # the relaunch names no tokenizer: it takes the checkpoint's
    proc = run_train(run, *STEPS, _blend(a, b), "data.split=[90,10,0]", data_cache=tmp_path / "cache")
    out = proc.stdout + proc.stderr
    assert "the checkpoint this run resumes" in out and "resumed from" in out
    m = metrics(run)
    assert sorted(m) == [1, 2, 3, 4] and [s for s in m if "valid/lm_loss" in m[s]] == [2, 4]
    # a 1000-id vocabulary starts near ln(1000) = 6.9, the 257 bytes near 5.5
    assert 6.0 < m[1]["lm_loss"] < 7.5 and m[4]["valid/lm_loss"] < m[2]["valid/lm_loss"] + 0.5
    # the sample indices went to the data cache, not next to the datasets
    assert list((tmp_path / "cache" / "indices").glob("*/*.npy")) and not (a.parent / "cache").exists()


def _refused(tmp_path, *overrides) -> list[str]:
    run = tmp_path / "run"
    proc = run_train(run, *STEPS, *overrides, data_cache=tmp_path / "cache", check=False)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert not run.exists() and not (tmp_path / "cache").exists()
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "Traceback" not in proc.stderr
    # each problem once, and no library notice from reading the datasets' indices before the
    # process group exists (megatron's "Could not determine rank")
    assert len(lines) == len(set(lines)) and "UserWarning" not in proc.stderr, lines
    return lines


def test_bad_blends_are_refused_before_anything_is_written(tmp_path, prepared):
    from data.tokenizer import build_tokenizer

    tok_dir, (a, b) = prepared
    byte_set = write_prepared(tmp_path / "bytes", stdlib_texts(3), build_tokenizer("byte"))
    lines = _refused(tmp_path, f"data.blend=[[0.5,{a}],[-1,{b}],[1,{tmp_path}/nothing],[1,{a}]]",
                     f"data.tokenizer={tok_dir}")
    text = "\n".join(lines)
    assert f"weight -1.0 of {b} must be > 0" in text and f"{a} is listed twice" in text
    assert f"{tmp_path}/nothing.json is missing" in text
    # Megatron-LM's flat --data-path order: named once, with the form that works
    lines = _refused(tmp_path, f"data.blend=[0.7,{a},0.3,{b}]", f"data.tokenizer={tok_dir}")
    assert lines[1:] == [f"  - data.blend: weights and prefixes in one list (Megatron-LM's --data-path order); "
                         f"give pairs: data.blend=[[0.7,{a}],[0.3,{b}]]"], lines
    lines = _refused(tmp_path, f"data.blend=[{a},{byte_set}]", f"data.tokenizer={tok_dir}")
    assert any("prepared with different tokenizers" in line for line in lines)
    lines = _refused(tmp_path, f"data.blend=[{a}]", "data.tokenizer=byte")
    assert any(f"is not the tokenizer {a} was prepared with" in line for line in lines)
    # 3 documents: 1% of them for validation rounds to none
    lines = _refused(tmp_path, f"data.blend=[{byte_set}]", "data.tokenizer=byte")
    assert any(f"leaves no validation document of {byte_set} (3 documents)" in line for line in lines)
    # datasets shorter than one 257-token sample: every sample would repeat their few tokens
    tok = build_tokenizer(str(tok_dir))
    short, short_valid = (write_prepared(tmp_path / name, [text] * 3, tok)
                          for name, text in (("short", "x = 1\n"), ("short-valid", "y = 2\n")))
    lines = _refused(tmp_path, f"data.blend=[{short}]", f"data.valid_blend=[{short_valid}]")
    assert any(f"the training documents of {short} (3 of 3) hold " in line and "fewer than one sample "
               "(model.seq_length + 1 = 257)" in line for line in lines), lines
    assert any(f"data.valid_blend: {short_valid} holds " in line and "fewer than one sample" in line
               for line in lines), lines


def test_bad_tokenizers_are_refused_before_anything_is_written(tmp_path, prepared):
    tok_dir, _ = prepared
    (tmp_path / "no-files").mkdir()
    lines = _refused(tmp_path, f"data.tokenizer={tmp_path / 'no-files'}")
    assert any(f"{tmp_path / 'no-files'} holds no tokenizer files" in line for line in lines)
    lines = _refused(tmp_path, f"data.tokenizer={tok_dir}", "model.vocab_size=600")
    assert any("model.vocab_size (600) is smaller than the vocabulary" in line for line in lines)
    # data.tokenizer_mismatch=allow lets another tokenizer through, not ids past the embedding
    # (a dataset of a 1200-id tokenizer into the 1000 rows of the run's: an IndexError at step 1)
    from data.tokenizer import build_tokenizer

    wide = build_tokenizer(str(make_bpe_tokenizer(tmp_path / "wide-tok", vocab_size=1200)))
    wide_set = write_prepared(tmp_path / "wide", stdlib_texts(20), wide)
    lines = _refused(tmp_path, f"data.tokenizer={tok_dir}", f"data.blend=[{wide_set}]", "data.split=[90,10,0]",
                     "data.tokenizer_mismatch=allow")
    assert any(f"data.blend: {wide_set} was prepared with " in line and "vocabulary 1200" in line
               and "past the model's 1000 embedding rows" in line for line in lines), lines
