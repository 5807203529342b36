"""Restarts: 2N steps equal N steps + resume + N steps to the last digit (fp32, CPU), the validation
losses included; a save that
dies half-way never becomes `latest`; a stop signal finishes the step, saves and exits cleanly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from skeleton_helpers import REPO, TINY_TEST, _env, metrics, run_python, run_train

# 4 x 256 tokens a step: warmup for steps 1-3, top-k from step 4; validation after steps 2, 4 and 6
COMMON = ("trainer.max_steps=6", "trainer.indexer_warmup_tokens=3072", "checkpoint.interval=0",
          "trainer.eval_interval=2", "trainer.eval_iters=1")
COMPARED = ("lm_loss", "kl_loss", "moe_aux_loss", "grad_norm", "lr", "keys_per_query", "phase", "tokens",
            "valid/lm_loss", "valid/kl_loss")
SWITCH = "indexer warmup done after step 3"


@pytest.fixture(scope="module")
def straight(tmp_path_factory, data_cache):
    """The uninterrupted 6-step run the restarted ones are compared with (read only)."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    run_train(run_dir, *COMMON, data_cache=data_cache)
    return run_dir


def test_stop_and_resume_reproduces_the_uninterrupted_run_exactly(tmp_path, data_cache, straight):
    """Resumed mid-warmup (step 2) and exactly at the warmup->sparse switch (step 3): same numbers
    and one switch line, logged by the job that makes the switch."""
    split = tmp_path / "split"
    run_train(split, *COMMON, "trainer.stop_at_step=2", data_cache=data_cache)
    assert max(metrics(split)) == 2
    # not "finished at step 2 of 6": the job ended, the run goes on
    log = (split / "train.log").read_text()
    assert "stopped at step 2 of 6 (2,048 tokens)" in log and "finished at step 2" not in log, log[-2000:]
    assert f"trainer.stop_at_step=2 ended this job: run {split / 'launch.sh'} to continue" in log, log[-2000:]
    assert (split / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    run_train(split, *COMMON, "trainer.stop_at_step=3", data_cache=data_cache)
    proc = run_train(split, *COMMON, data_cache=data_cache)
    out = proc.stdout + proc.stderr
    assert "resumed from" in out and "step_00000003" in out and SWITCH in out

    a, b = metrics(straight), metrics(split)
    assert sorted(a) == sorted(b) == list(range(1, 7))
    # each validation reads the batches after the last one's, also across a resume (the position
    # is in the checkpoint): equal numbers at steps 4 and 6 mean equal batches
    assert [s for s in a if "valid/lm_loss" in a[s]] == [2, 4, 6]
    assert len({a[s]["valid/lm_loss"] for s in (2, 4, 6)}) == 3
    assert [a[s]["phase"] for s in a] == ["warmup"] * 3 + ["sparse"] * 3
    for step in a:
        assert {k: a[step].get(k) for k in COMPARED} == {k: b[step].get(k) for k in COMPARED}, step
    for run in (straight, split):
        log = (run / "train.log").read_text()
        assert log.count("switching to sparse attention") == 1 and SWITCH in log, run


def test_a_save_killed_half_way_never_becomes_latest(tmp_path, data_cache):
    run_dir = tmp_path / "run"
    overrides = [*TINY_TEST, f"run_dir={run_dir}", f"data.cache_dir={data_cache}", *COMMON, "checkpoint.interval=2"]
    env = _env() | {"DIE_ON_SAVE": "2"}  # the save after step 4
    proc = run_python(["tests/interrupted_save_main.py", *overrides], env)
    assert proc.returncode == 17, proc.stdout[-3000:] + proc.stderr[-3000:]
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_00000002"
    assert (ckpts / ".tmp-step_00000004").is_dir() and not (ckpts / "step_00000004").exists()

    proc = run_train(run_dir, *COMMON, "checkpoint.interval=2", data_cache=data_cache)
    out = proc.stdout + proc.stderr
    assert "step_00000002 at step 2" in out and "removing incomplete checkpoint" in out
    assert not (ckpts / ".tmp-step_00000004").exists()
    assert (ckpts / "latest").read_text().strip() == "step_00000006"
    # the killed run logged steps 3-4 after the checkpoint it resumed from; they are logged once
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 7)), steps


def test_stop_signal_handler_records_the_signal():
    from msa_model.training.preemption import StopSignal

    stop = StopSignal(["SIGUSR1", "SIGTERM"])
    try:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.requested and stop.received == "SIGUSR1"
    finally:
        stop.restore()
    with pytest.raises(ValueError, match="SIGNOPE"):
        StopSignal(["SIGNOPE"])


def test_sigterm_finishes_the_step_saves_and_exits_cleanly(tmp_path, data_cache):
    sig = signal.SIGTERM
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "train.py", *TINY_TEST, f"run_dir={run_dir}", f"data.cache_dir={data_cache}",
           "trainer.max_steps=200", "checkpoint.interval=0", "checkpoint.save_at_end=false"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 240
        jsonl = run_dir / "metrics.jsonl"
        while not (jsonl.exists() and len(jsonl.read_text().splitlines()) >= 2):
            assert proc.poll() is None and time.time() < deadline, "training did not start"
            time.sleep(0.5)
        os.kill(proc.pid, sig)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    last = max(metrics(run_dir))
    assert 2 <= last < 200
    assert f"stopped by {sig.name} after step {last}: checkpoint {run_dir / 'checkpoints' / f'step_{last:08d}'}" in out
    # save_at_end=false: this checkpoint exists only because of the signal
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{last:08d}"


def test_relaunch_with_stop_at_step_and_a_longer_schedule(tmp_path, data_cache, straight):
    """A job stopped at step 3 and relaunched with the same stop runs no step; a relaunch that
    trains longer follows the new config's lr schedule, not the checkpoint's (that of the
    uninterrupted 6-step run)."""
    base = ("trainer.indexer_warmup_tokens=3072", "checkpoint.interval=0", "checkpoint.keep=1")

    run = tmp_path / "run"
    run_train(run, *base, "trainer.max_steps=4", "trainer.stop_at_step=3", data_cache=data_cache)
    run_train(run, *base, "trainer.max_steps=4", "trainer.stop_at_step=3", data_cache=data_cache)
    assert max(metrics(run)) == 3 and (run / "checkpoints" / "latest").read_text().strip() == "step_00000003"
    assert "stop_at_step" not in (run / "launch.sh").read_text()

    run_train(run, *base, "trainer.max_steps=6", data_cache=data_cache)
    a, b = metrics(straight), metrics(run)
    assert sorted(b) == list(range(1, 7))
    # steps 4-6 run on the 6-step schedule; steps 1-3 ran on the 4-step one (a different decay)
    for step in (4, 5, 6):
        assert b[step]["lr"] == a[step]["lr"], step
    assert b[3]["lr"] != a[3]["lr"]
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_00000006"]


def test_dense_steps_after_the_warmup_resume_on_their_step_numbers(tmp_path, data_cache):
    """trainer.indexer_dense_interval=3: steps 1, 4, 7, ... past the warmup run dense attention
    (step 4, the first after the switch) and the rest top-k; the validation after the dense step
    runs top-k as the one after a sparse step does; a job stopped after the dense step resumes
    into the same sparse steps with the same numbers."""
    dense = (*COMMON, "trainer.indexer_dense_interval=3")
    straight_run = tmp_path / "straight"
    proc = run_train(straight_run, *dense, data_cache=data_cache)
    a = metrics(straight_run)
    assert [a[s]["phase"] for s in sorted(a)] == ["warmup"] * 3 + ["dense-step", "sparse", "sparse"]
    # top-4 of 16-token blocks read at most 64 keys; the dense step reads the causal mean
    assert a[4]["keys_per_query"] > 64 >= max(a[5]["keys_per_query"], a[6]["keys_per_query"])
    assert a[4]["valid/keys_per_query"] == a[6]["valid/keys_per_query"] <= 64
    assert "one step in 3 from here on (steps 4, 7, ...)" in proc.stdout + proc.stderr

    split = tmp_path / "split"
    run_train(split, *dense, "trainer.stop_at_step=4", data_cache=data_cache)
    proc = run_train(split, *dense, data_cache=data_cache)
    assert "one step in 3 from here on (steps 7, 10, ...)" in proc.stdout + proc.stderr
    b = metrics(split)
    for step in a:
        assert {k: a[step].get(k) for k in COMPARED} == {k: b[step].get(k) for k in COMPARED}, step
    assert (split / "train.log").read_text().count("switching to sparse attention") == 1
