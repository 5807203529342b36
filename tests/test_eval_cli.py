"""The offline evaluation without a trained model (placeholder checkpoints, stand-in models):
inputs it cannot use (options, a damaged checkpoint, a run without one) are refused in one line,
exit code 2, before the model loads or the output directory exists; an interrupted evaluation
keeps the retrieval it scored and the next call goes on from it; results.json appears only whole
and last; the report names its checkpoint, an untrained index branch and a key budget only where
one applies; the held-out loss masks packed documents as the run did."""

from __future__ import annotations

import json
import logging
import random

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from msa_model.config import TrainConfig
from skeleton_helpers import placeholder_run


def _run(tmp_path):
    """A run directory (config.yaml, a placeholder checkpoint) and a corpus of three small Python
    files as its data.source."""
    rng = random.Random(0)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(3):
        (corpus / f"m{i}.py").write_text("\n".join(f"x{j} = {rng.randrange(1000)}  # line {j}" for j in range(400)))
    run, _ = placeholder_run(tmp_path, source=str(corpus))
    return run, corpus


def _main(*argv):
    from msa_model.eval.__main__ import main

    return main([str(a) for a in argv])


@pytest.mark.parametrize("option", ["--samples", "--loss-sequences", "--loss-length"])
def test_counts_below_one_are_refused_by_the_parser(tmp_path, option, capsys):
    """--samples 0 divided by zero after the model had loaded; --loss-sequences 0 said the held-out
    text was too short, after the whole retrieval."""
    with pytest.raises(SystemExit) as e:
        _main(tmp_path, "--out", tmp_path / "eval", option, "0")
    assert e.value.code == 2 and f"argument {option}: must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("case", ["out_is_a_file", "no_cuda", "no_tasks", "no_depths", "empty_corpus",
                                  "corpus_is_a_file", "jsonl_without_text", "short_heldout"])
def test_inputs_it_cannot_use_are_refused_before_the_model_and_the_output(tmp_path, case, capsys, monkeypatch):
    run, corpus = _run(tmp_path)
    out = tmp_path / "eval"
    args = ["--lengths", "256", "--samples", "1"]
    if case == "no_cuda":
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        args += ["--device", "cuda"]
        message = "--device cuda: CUDA is not available here"
    elif case == "out_is_a_file":
        out.write_text("notes\n")
        message = f"--out {out}: a file is in the way"
    elif case == "no_tasks":
        args += ["--tasks", ","]
        message = "--tasks: unknown none given"
    elif case == "no_depths":
        args += ["--depths", ""]
        message = "--depths: one or more in [0, 1], got []"
    elif case == "empty_corpus":
        empty = tmp_path / "empty"
        empty.mkdir()
        (empty / "a.py").write_text("")
        args += ["--corpus", empty]
        message = f"--corpus {empty}: haystack: the corpus files are empty"
    elif case == "corpus_is_a_file":
        args += ["--corpus", corpus / "m0.py"]
        message = f"--corpus {corpus / 'm0.py'}: a file, not a directory of text files"
    elif case == "jsonl_without_text":
        records = tmp_path / "records"
        records.mkdir()
        (records / "a.jsonl").write_text('{"content": "x = 1"}\n{"content": "y = 2"}\n')
        args += ["--corpus", records, "--glob", "*.jsonl"]
        message = (f"--corpus {records}: {records / 'a.jsonl'}: no documents (2 no field); each record's 'text' "
                   "string is read")
    else:
        args += ["--loss-length", "1000000"]
        message = "is shorter than one 1000000-token sequence (--loss-length)"
    assert _main(run, "--out", out, *args) == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]
    assert out.is_file() if case == "out_is_a_file" else not out.exists()


def test_a_jsonl_corpus_is_read_as_data_prepare_reads_it(tmp_path, monkeypatch):
    """--corpus DIR of .jsonl files: the haystacks and the held-out documents are the records'
    text, as `python -m data.prepare` reads it; they were the JSON lines, syntax and all."""
    from data import retrieval
    from msa_model.eval import runner
    from msa_model.training import manifest

    # a run on prepared datasets: --corpus is read whole (a run on a file directory keeps its data.glob)
    run, _ = placeholder_run(tmp_path, blend=[str(tmp_path / "web")])
    corpus = tmp_path / "records"
    corpus.mkdir()
    rng = random.Random(1)
    texts = ["\n".join(f"y{j} = {rng.randrange(1000)}  # record {i}" for j in range(100)) for i in range(6)]
    (corpus / "a.jsonl").write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)))
    seen = {}

    class Haystack(retrieval.Haystack):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            seen["haystack"] = self.text

    def stop(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(retrieval, "Haystack", Haystack)
    monkeypatch.setattr(runner, "heldout_stream", lambda docs, *args, **kwargs: seen.setdefault("heldout", docs))
    monkeypatch.setattr(manifest, "verify_checkpoint", lambda *args, **kwargs: None)  # a placeholder checkpoint
    monkeypatch.setattr(runner, "build_model", stop)
    assert _main(run, "--out", tmp_path / "eval", "--corpus", corpus, "--lengths", "256") == 130
    assert seen["haystack"] == "\n".join(texts).encode()
    assert seen["heldout"] == [t.encode() for t in texts]


class _Model(torch.nn.Module):
    """Logits of zeros over the byte vocabulary; counts its calls and raises KeyboardInterrupt at
    call `stop_at` (a Ctrl-C in the middle of the retrieval)."""

    def __init__(self, stop_at: int | None = None):
        super().__init__()
        self.calls, self.stop_at = 0, stop_at

    def forward(self, tokens_BS, pos, mask):
        self.calls += 1
        if self.calls == self.stop_at:
            raise KeyboardInterrupt
        return torch.zeros(*tokens_BS.shape, 257)


def test_an_interrupted_retrieval_keeps_its_cells_and_the_next_call_goes_on(tmp_path):
    """Two tasks x two lengths, one depth, one sample: one forward a cell. Interrupted in the third
    cell, the first two are in partial.json; the next call scores the last two only and gives what
    one uninterrupted call gives; other settings start afresh."""
    from data.retrieval import Haystack
    from data.tokenizer import ByteTokenizer
    from msa_model.eval.runner import EXAMPLE_VERSION, Progress, retrieval_results

    _, corpus = _run(tmp_path)
    haystack = Haystack(sorted(corpus.glob("*.py")), pool_bytes=1 << 20, seed=0)
    grid = (["passkey", "multikey"], [256, 384], [0.5], 1, 0, ByteTokenizer())
    settings = {"checkpoint": "x", "samples": 1}
    with pytest.raises(KeyboardInterrupt):
        retrieval_results(_Model(stop_at=3), "cpu", haystack, *grid, progress=Progress(tmp_path, settings))
    saved = json.loads((tmp_path / Progress.FILE).read_text())
    assert saved["settings"] == {**settings, "example_version": EXAMPLE_VERSION}
    assert sorted(saved["cells"]) == ["passkey/256", "passkey/384"]

    model = _Model()
    resumed = retrieval_results(model, "cpu", haystack, *grid, progress=Progress(tmp_path, settings))
    assert model.calls == 2
    assert resumed == retrieval_results(_Model(), "cpu", haystack, *grid)
    fresh = _Model()
    retrieval_results(fresh, "cpu", haystack, *grid, progress=Progress(tmp_path, {**settings, "samples": 2}))
    assert fresh.calls == 4


def test_cells_scored_on_examples_made_another_way_are_not_reused(tmp_path, monkeypatch, caplog):
    """partial.json's settings did not say how the examples were made: cells scored before a change
    of their construction (a tokenization, a haystack read another way) were taken for the new
    ones'. A partial.json from before the version, or of another one, starts afresh, said in a line."""
    from msa_model.eval import runner

    settings, cell = {"checkpoint": "x", "samples": 1}, {"accuracy": 1.0}
    path = tmp_path / runner.Progress.FILE
    path.write_text(json.dumps({"settings": settings, "cells": {"passkey/256": cell}}))
    with caplog.at_level(logging.INFO, logger="msa_model.eval"):
        assert runner.Progress(tmp_path, settings).get("passkey", 256) is None
    assert caplog.messages == [f"{path} holds cells scored with other settings (differing: example_version); "
                               "they are not reused"]
    runner.Progress(tmp_path, settings).put("passkey", 256, cell)
    assert runner.Progress(tmp_path, settings).get("passkey", 256) == cell
    monkeypatch.setattr(runner, "EXAMPLE_VERSION", runner.EXAMPLE_VERSION + 1)
    assert runner.Progress(tmp_path, settings).get("passkey", 256) is None


def test_an_interrupted_main_says_what_it_kept(tmp_path, monkeypatch, capsys):
    from msa_model.eval import runner

    def interrupted(args):
        (tmp_path / runner.Progress.FILE).write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "run_eval", interrupted)
    assert _main(tmp_path / "run", "--out", tmp_path) == 130
    assert capsys.readouterr().err.strip() == (f"interrupted: the retrieval scored so far is kept in "
                                               f"{tmp_path / runner.Progress.FILE}; the same command goes on from it")


def test_results_json_comes_last_and_whole(tmp_path, monkeypatch):
    """A kill while the plots are drawn leaves no results.json (whose presence a quality study
    takes for a finished evaluation); a complete report has every file."""
    from msa_model.eval import report

    results = {"label": "r", "model": "tiny", "attention": "dense", "phase": "dense", "context": 512,
               "key_budget": None, "samples": 1, "depths": [0.5], "seed": 0, "lengths": [256],
               "tasks": {"passkey": {"256": {"accuracy": 1.0, "mean_rank": 0.0, "by_depth": {"0.5": 1.0}}}},
               "accuracy_by_length": {"256": 1.0}, "checkpoint": "run/checkpoints/step_00000001",
               "loss_by_position": {"source": "held-out", "sequences": 1, "length": 256,
                                    "buckets": [{"from": 0, "to": 256, "loss": 2.0}]}}

    def killed(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(report, "plot_accuracy", killed)
    with pytest.raises(KeyboardInterrupt):
        report.write_report(results, tmp_path)
    assert not (tmp_path / "results.json").exists()
    monkeypatch.undo()
    report.write_report(results, tmp_path)
    assert json.loads((tmp_path / "results.json").read_text()) == results
    assert sorted(p.name for p in tmp_path.iterdir()) == ["accuracy.png", "loss_by_position.png", "results.json",
                                                         "results.md"]


def test_the_report_names_its_checkpoint_and_an_untrained_index_branch(tmp_path, monkeypatch):
    """Runs compared side by side: each report says which step it scored (a run still training
    moves on), and a sparse phase that selected with an index branch nothing trained (a
    conversion of a dense model, a run inside its indexer warmup) says so."""
    from msa_model.eval import runner
    from msa_model.eval.report import markdown
    from msa_model.training import index_history

    history = {"a": (False, "untrained (derived from a dense model)"), "b": (True, "trained"),
               "c": (None, "of unknown history")}
    monkeypatch.setattr(index_history, "index_branch_history", lambda step: history[step])
    assert [runner.untrained_index(k) for k in "abc"] == ["untrained (derived from a dense model)", None, None]
    results = {"label": "r", "model": "tiny", "attention": "msa", "phase": "sparse", "context": 512,
               "key_budget": 128, "samples": 1, "depths": [0.5], "seed": 0, "lengths": [256],
               "index_untrained": "untrained (derived from a dense model)",
               "tasks": {"passkey": {"256": {"accuracy": 1.0, "mean_rank": 0.0, "by_depth": {"0.5": 1.0}}}},
               "accuracy_by_length": {"256": 1.0}, "checkpoint": "run/checkpoints/step_00000010",
               "loss_by_position": {"source": "held-out", "sequences": 1, "length": 256,
                                    "buckets": [{"from": 0, "to": 256, "loss": 2.0}]}}
    text = markdown(results)
    assert ("checkpoint run/checkpoints/step_00000010; **index branch untrained (derived from a dense model)**: "
            "the sparse phase selected with it") in text
    assert "index branch" not in markdown({**results, "index_untrained": None})


@pytest.mark.parametrize("checkpoints", ["none", "empty", "elsewhere"])
def test_a_run_without_a_checkpoint_is_named_as_such(tmp_path, checkpoints, capsys):
    """A run still before its first save (or one that saves none) is a run without a checkpoint,
    not 'not a checkpoint'; one saving to a checkpoint.dir of its own points there."""
    run = tmp_path / "run"
    run.mkdir()
    cfg = OmegaConf.structured(TrainConfig)
    if checkpoints == "elsewhere":
        cfg.checkpoint.dir = str(tmp_path / "ckpt")
    (run / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    if checkpoints == "empty":
        (run / "checkpoints").mkdir()
    assert _main(run, "--out", tmp_path / "eval") == 2
    said = (f"the run keeps its checkpoints in checkpoint.dir {tmp_path / 'ckpt'}: give that directory"
            if checkpoints == "elsewhere" else "the run has saved no checkpoint (yet)")
    assert f"error: {run}: {said}" in capsys.readouterr().err
    assert not (tmp_path / "eval").exists()


def test_a_hugging_face_model_is_named_with_its_conversion(tmp_path, capsys):
    """An export (msa-to-hf) given to the evaluation says how to evaluate it, not only "not a
    checkpoint"."""
    hf = tmp_path / "export"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert _main(hf, "--out", tmp_path / "eval") == 2
    assert (f"; a Hugging Face model (config.json): convert it first, `python -m msa_model.convert hf-to-msa {hf} "
            "OUT`, then evaluate OUT") in capsys.readouterr().err
    assert not (tmp_path / "eval").exists()


def test_only_the_sparse_phase_of_msa_layers_has_a_key_budget():
    """The dense phase reads every key: its report named the sparse phase's budget and explained
    a needle selection it did not measure."""
    from msa_model.config import MSAConfig
    from msa_model.eval.runner import key_budget

    msa = OmegaConf.structured(MSAConfig(block_size=32, topk=4))
    assert key_budget(msa, 4, "sparse") == 128
    assert key_budget(msa, 4, "dense") is None and key_budget(msa, 0, "sparse") is None


class _LossModel(torch.nn.Module):
    """Per-token losses of ones; keeps the positions and document starts it was given."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, tokens_BS, pos, doc_start, labels=None):
        self.seen.append((pos.clone(), None if doc_start is None else doc_start.clone()))
        return torch.ones(tokens_BS.shape, dtype=torch.float32)


def test_the_held_out_loss_masks_documents_as_the_run_trained():
    """A run on packed documents (data.document_mask) never attended across an end-of-document
    token; its held-out windows were scored attending across them. Masked, each window's
    documents start where training starts them; positions stay the window's, as in training."""
    from data.datasets import document_starts
    from data.tokenizer import ByteTokenizer
    from msa_model.eval.runner import heldout_stream, loss_by_position

    tok = ByteTokenizer()
    flat = heldout_stream([b"a" * 100, b"b" * 50, b"c" * 400], tok, 256)
    model = _LossModel()
    out = loss_by_position(model, "cpu", flat, 256, 2, document_eod=tok.eod)
    assert out["documents_masked"] and out["sequences"] == 2 and len(model.seen) == 2
    for i, (pos, doc_start) in enumerate(model.seen):
        want = document_starts(torch.from_numpy(flat[i * 256:(i + 1) * 256])[None], tok.eod)
        assert torch.equal(doc_start, want)
        assert torch.equal(pos, torch.arange(256)[None])
    # the first window holds two document starts after its first
    assert sorted(set(model.seen[0][1][0].tolist())) == [0, 101, 152]
    unmasked = _LossModel()
    assert not loss_by_position(unmasked, "cpu", flat, 256, 2)["documents_masked"]
    assert all(doc_start is None for _, doc_start in unmasked.seen)


def test_held_out_documents_start_as_the_runs_did():
    """A run with data.add_bos=true started each training document with the BOS; the held-out
    loss reads its documents framed alike (a blend's datasets record their own framing: none)."""
    from types import SimpleNamespace

    from msa_model.eval.runner import heldout_stream
    from msa_model.training.data_setup import document_bos

    tok = SimpleNamespace(bos=7, eod=0, tokenize_batch=lambda docs: [np.frombuffer(d, np.uint8).astype(np.int32)
                                                                      for d in docs])
    assert heldout_stream([b"ab", b"c" * 300], tok, 256, bos=7)[:8].tolist() == [7, 97, 98, 0, 7, 99, 99, 99]
    assert heldout_stream([b"ab", b"c" * 300], tok, 256)[:4].tolist() == [97, 98, 0, 99]
    data = OmegaConf.structured(TrainConfig).data
    assert document_bos(data, tok) is None
    data.add_bos = True
    assert document_bos(data, tok) == 7
    data.blend = ["/x/y"]
    assert document_bos(data, tok) is None


def test_a_damaged_checkpoint_is_refused_before_the_model_and_the_output(tmp_path, capsys):
    """It ended in a traceback from the load, after the output directory had been made."""
    from msa_model.training.manifest import write_manifest

    run, _ = _run(tmp_path)
    step = run / "checkpoints" / "step_00000001"
    (step / "__0_0.distcp").write_bytes(b"x" * 4096)
    write_manifest(step)
    (step / "__0_0.distcp").write_bytes(b"x" * 1000)
    out = tmp_path / "eval"
    assert _main(run, "--out", out, "--lengths", "256") == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: checkpoint {step} is damaged: __0_0.distcp is 1,000 bytes, the manifest says 4,096")
    assert not out.exists()


def test_a_new_evaluation_into_an_earlier_ones_out_removes_its_results_first(tmp_path, monkeypatch):
    """An evaluation interrupted in an OUT that held an earlier one's results.json left that file
    beside the new partial.json: a finished evaluation, to a quality study and to a reader."""
    from msa_model.eval import runner

    run, _ = _run(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").write_text('{"label": "an earlier evaluation"}')

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    from msa_model.training import manifest

    monkeypatch.setattr(manifest, "verify_checkpoint", lambda *args, **kwargs: None)  # a placeholder checkpoint
    monkeypatch.setattr(runner, "build_model", interrupted)
    assert _main(run, "--out", out, "--lengths", "256") == 130
    assert not (out / "results.json").exists()
