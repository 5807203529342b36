"""End-to-end runs of train.py on CPU: loss falls, the indexer warms up then routes, checkpoints
and run files appear; the dense baseline trains; a dense checkpoint initialises an MSA model."""

from __future__ import annotations

import re
import time

import pytest

from skeleton_helpers import metrics, run_train

# 4 samples x 256 tokens per step: warmup covers steps 1-3, top-k from step 4
WARMUP_3_STEPS = "trainer.indexer_warmup_tokens=3072"


@pytest.fixture(scope="module")
def short_run(tmp_path_factory, data_cache):
    run_dir = tmp_path_factory.mktemp("short") / "run"
    proc = run_train(run_dir, "trainer.max_steps=8", WARMUP_3_STEPS, "checkpoint.interval=4", "checkpoint.keep=2",
                     "logging.time_modules=true", data_cache=data_cache)
    return run_dir, proc


def test_loss_falls_and_phases_follow_the_token_schedule(short_run):
    run_dir, _ = short_run
    m = metrics(run_dir)
    assert sorted(m) == list(range(1, 9))
    assert [m[s]["phase"] for s in range(1, 9)] == ["warmup"] * 3 + ["sparse"] * 5
    assert m[8]["lm_loss"] < m[1]["lm_loss"] - 1.0, [m[s]["lm_loss"] for s in m]
    # the indexer learns during warmup
    assert m[3]["kl_loss"] < m[1]["kl_loss"], [m[s]["kl_loss"] for s in m]
    # warmup reads every key of the query's document (packed documents are masked by default):
    # at most the causal (256 + 1) / 2 on average, and near it, the stdlib's files being mostly
    # longer than a sample; top-4 of 16-token blocks at most 64
    assert 64 < m[1]["keys_per_query"] <= 128.5
    assert 16 < m[8]["keys_per_query"] <= 64
    assert all(m[s]["moe_aux_loss"] > 0 and m[s]["grad_norm"] > 0 for s in m)
    # model FLOPs per second, and the step split by logging.time_modules (wall clocks on CPU)
    assert all(m[s]["tflops_per_gpu"] > 0 for s in m)
    assert all(0 < m[s]["attention_ms"] and 0 < m[s]["moe_ms"] for s in m)
    assert all(m[s]["attention_ms"] + m[s]["moe_ms"] < m[s]["step_ms"] for s in m)


def test_the_output_has_no_library_notices(short_run):
    """Warnings the project has handled are filtered where they are raised, with one line instead;
    no 0.0 TFLOP/s on CPU (the achieved FLOP/s in a unit that shows it)."""
    _, proc = short_run
    lines = (proc.stdout + proc.stderr).splitlines()
    for noise in ("UserWarning", "FutureWarning", "warnings.warn", "GPTModel IS DEPRECATED", "Falling back to",
                  "Setting accelerator to CPU", "0.0 TFLOP/s"):
        assert not [line for line in lines if noise in line], (noise, lines[:30])
    assert len([line for line in lines if "Transformer Engine and Apex are not installed (not needed)" in line]) == 1
    rates = [line for line in lines if "FLOP/s" in line]
    assert rates and all(re.search(r" \| [0-9.]+ [GM]FLOP/s \| ", line) for line in rates), rates


def test_checkpoints_latest_and_run_files(short_run):
    run_dir, proc = short_run
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_00000008"
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_00000004", "step_00000008"]
    assert not list(ckpts.glob(".tmp-*"))
    assert (ckpts / "step_00000008" / "metadata.json").is_file()
    assert "trainer:" in (run_dir / "config.yaml").read_text()
    assert len((run_dir / "git.txt").read_text().split()[0]) in (40, 7)  # a commit, or "unknown"
    launch = (run_dir / "launch.sh").read_text()
    assert "train.py" in launch and f"run_dir={run_dir.resolve()}" in launch
    log = (run_dir / "train.log").read_text()
    assert "switching to sparse attention" in log and "saved checkpoint" in log
    # the run's first line says whether packed documents are masked (the recipes' default)
    first = log.splitlines()[0]
    assert "] run dir " in first and "documents: masked (data.document_mask=true)" in first, first


def test_rerun_of_a_finished_run_does_nothing(short_run, data_cache):
    run_dir, _ = short_run
    proc = run_train(run_dir, "trainer.max_steps=8", WARMUP_3_STEPS, data_cache=data_cache)
    assert "nothing to do" in proc.stdout + proc.stderr
    assert max(metrics(run_dir)) == 8


def test_dense_baseline_then_cpt_from_its_checkpoint(tmp_path, data_cache):
    dense_dir = tmp_path / "dense"
    run_train(dense_dir, "recipe=dense", "trainer.max_steps=3", data_cache=data_cache)
    m = metrics(dense_dir)
    # the first steps move little (the lr warms up from 0): the loss falls by step 3
    assert m[3]["phase"] == "dense" and "kl_loss" not in m[3] and m[3]["lm_loss"] < m[1]["lm_loss"] - 0.3

    cpt_dir = tmp_path / "cpt"
    proc = run_train(cpt_dir, "recipe=cpt", "trainer.max_steps=2", "trainer.indexer_warmup_tokens=1024",
                     f"init_from={dense_dir / 'checkpoints'}",
                     data_cache=data_cache)
    out = proc.stdout + proc.stderr
    assert "initialised model weights" in out and "index-branch tensors absent" in out
    cpt = metrics(cpt_dir)
    # the backbone starts where the dense run ended, far below a fresh model's loss (~5.9)
    assert cpt[1]["lm_loss"] < m[1]["lm_loss"] - 0.5 and "kl_loss" in cpt[1]


def test_an_msa_model_of_full_attention_layers_only_logs_the_dense_phase(tmp_path, data_cache):
    """model.attention=msa with every layer full: no index branch, no warmup schedule to follow."""
    run_dir = tmp_path / "full"
    run_train(run_dir, "trainer.max_steps=2", "model.attention_types=[full,full]",
              "trainer.indexer_warmup_tokens=1024", data_cache=data_cache)
    for r in metrics(run_dir).values():
        assert r["phase"] == "dense" and "kl_loss" not in r, r
        # every row: when (UNIX seconds) and the mean step time, here without logging.time_modules
        assert abs(r["time"] - time.time()) < 3600 and r["step_ms"] > 0 and "attention_ms" not in r, r
