"""Stops on signals in one process: the stop save survives a signal delivered to every process of
the trainer (as SLURM delivers it), the stop ends with one line, nothing the trainer starts outlives
a kill -9, a second Ctrl-C aborts; and what a stop does to a SLURM job."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from msa_model.training.manifest import check_manifest
from msa_model.training.preemption import REQUEST_ENV, StopSignal, plan_requeue, requeue_slurm_job
from skeleton_helpers import REPO, TINY_TEST, _env, metrics

LONG = ("trainer.max_steps=200", "trainer.indexer_warmup_tokens=2048", "checkpoint.interval=2", "checkpoint.keep=0")


def test_a_second_sigint_aborts_other_signals_only_set_the_flag():
    stop = StopSignal(["SIGUSR1", "SIGINT"])
    try:
        signal.raise_signal(signal.SIGUSR1)
        signal.raise_signal(signal.SIGUSR1)
        assert stop.received == "SIGUSR1"
        signal.raise_signal(signal.SIGINT)  # not a second Ctrl-C: the first stop was USR1
        assert stop.received == "SIGUSR1"
    finally:
        stop.restore()
    stop = StopSignal(["SIGINT"])
    try:
        signal.raise_signal(signal.SIGINT)
        assert stop.received == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    finally:
        stop.restore()


@pytest.fixture
def fake_scontrol(tmp_path, monkeypatch):
    """`scontrol show job` answering with the fields in JOB_FIELDS; `scontrol requeue` logged."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "scontrol"
    script.write_text('#!/bin/sh\nif [ "$1" = requeue ]; then echo "$@" >> "$SCONTROL_LOG"; exit 0; fi\n'
                      'echo "JobId=$4 JobName=x $JOB_FIELDS"\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("SCONTROL_LOG", str(tmp_path / "scontrol.log"))
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    monkeypatch.delenv(REQUEST_ENV, raising=False)
    return tmp_path / "scontrol.log"


@pytest.mark.parametrize("fields,restart,requeue,note", [
    ("JobState=RUNNING Restarts=0 BatchFlag=1", None, True, "requeueing job 42"),
    ("JobState=RUNNING Restarts=2 BatchFlag=1", "2", True, "requeueing job 42"),
    # scontrol requeue / preemption: SLURM already counted the restart
    ("JobState=COMPLETING Restarts=1 BatchFlag=1", None, False, "SLURM is requeueing job 42"),
    # scancel: the user ends the job
    ("JobState=COMPLETING Restarts=0 BatchFlag=1", None, False, "job 42 is ending (COMPLETING"),
    ("JobState=CANCELLED Restarts=0 BatchFlag=1", None, False, "job 42 is ending (CANCELLED"),
    ("JobState=RUNNING Restarts=0 BatchFlag=0", None, False, "job 42 is not a batch job"),
])
def test_a_stop_requeues_only_a_running_batch_job(fake_scontrol, monkeypatch, fields, restart, requeue, note):
    monkeypatch.setenv("JOB_FIELDS", fields)
    if restart is not None:
        monkeypatch.setenv("SLURM_RESTART_COUNT", restart)
    plan = plan_requeue("SIGTERM", ["SIGUSR1", "SIGTERM"], finished=False)
    assert plan.requeue is requeue and plan.note.startswith(note), plan


def test_what_is_never_requeued(fake_scontrol, monkeypatch):
    monkeypatch.setenv("JOB_FIELDS", "JobState=RUNNING Restarts=0 BatchFlag=1")
    assert not plan_requeue(None, ["SIGUSR1"], finished=False).requeue  # no signal
    assert not plan_requeue("SIGUSR1", ["SIGUSR1"], finished=True).requeue  # the run is complete
    plan = plan_requeue("SIGTERM", ["SIGUSR1"], finished=False)
    assert not plan.requeue and "SIGTERM is not in launch.requeue_signals" in plan.note
    monkeypatch.delenv("SLURM_JOB_ID")
    plan = plan_requeue("SIGUSR1", ["SIGUSR1"], finished=False, relaunch="run x/launch.sh")
    assert not plan.requeue and plan.note == "not a SLURM job; run x/launch.sh to resume"


def test_the_batch_shell_requeues_when_it_asks_for_it(fake_scontrol, monkeypatch, tmp_path):
    request = tmp_path / "requeue-42"
    monkeypatch.setenv(REQUEST_ENV, str(request))
    assert requeue_slurm_job() and request.read_text() == "42\n"
    assert not fake_scontrol.exists()  # scontrol is left to the batch shell
    monkeypatch.delenv(REQUEST_ENV)
    assert requeue_slurm_job() and fake_scontrol.read_text().split() == ["requeue", "42"]


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(proc.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _start(run_dir: Path, data_cache: Path, *overrides: str) -> subprocess.Popen:
    cmd = [sys.executable, "train.py", *TINY_TEST, f"run_dir={run_dir}", f"data.cache_dir={data_cache}", *overrides]
    return subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for_steps(proc: subprocess.Popen, run_dir: Path, steps: int, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    jsonl = run_dir / "metrics.jsonl"
    while not (jsonl.exists() and len(jsonl.read_text().splitlines()) >= steps):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"training did not reach step {steps}:\n{proc.communicate()[0][-3000:]}")
        time.sleep(0.2)


def test_a_stop_signal_to_every_process_after_a_checkpoint_saves_and_nothing_outlives_kill_9(tmp_path, data_cache):
    run_dir = tmp_path / "run"
    proc = _start(run_dir, data_cache, *LONG)
    try:
        _wait_for_steps(proc, run_dir, 3)  # the step-2 checkpoint exists
        assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000002"
        # the checkpoint writer keeps no process of its own (wandb is off: nothing else either)
        assert not _descendants(proc.pid)
        # as SLURM does: the signal reaches the trainer and everything it started
        for pid in [proc.pid, *_descendants(proc.pid)]:
            os.kill(pid, signal.SIGUSR1)
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    stop = max(metrics(run_dir))
    assert 3 <= stop < 200
    last = out.strip().splitlines()[-1]
    ckpt = run_dir / "checkpoints" / f"step_{stop:08d}"
    assert last.endswith(f"stopped by SIGUSR1 after step {stop}: checkpoint {ckpt}; not a SLURM job; "
                         f"run {run_dir / 'launch.sh'} to resume"), out[-2000:]
    assert "Traceback" not in out
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == ckpt.name
    assert check_manifest(ckpt) == (True, [])

    # the relaunch resumes from the stop save; with wandb on (its own helper process) it is killed
    # with SIGKILL after its next save: nothing it started may live on
    proc = _start(run_dir, data_cache, *LONG, "logging.wandb_mode=offline")
    try:
        _wait_for_steps(proc, run_dir, stop + 2)
        helpers = _descendants(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert f"resumed from {ckpt} at step {stop}" in out, out[-3000:]
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in helpers) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = {p: Path(f"/proc/{p}/cmdline").read_text().replace("\0", " ")[:120] for p in helpers if _alive(p)}
    assert not left, f"processes of the killed trainer live on: {left}"


def test_a_second_ctrl_c_aborts_without_saving(tmp_path, data_cache):
    run_dir = tmp_path / "run"
    # steps of about a second: both presses land within one step
    proc = _start(run_dir, data_cache, *LONG, "parallel.global_batch_size=8")
    try:
        _wait_for_steps(proc, run_dir, 1)
        _wait_for_steps(proc, run_dir, 2)  # step 3 has just begun
        proc.send_signal(signal.SIGINT)
        # two presses, not one: the kernel merges a signal sent while the first is still pending
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out[-3000:]
    assert out.strip().splitlines()[-1] == "error: interrupted; nothing was saved after the last checkpoint"
    assert "Traceback" not in out and "stopped by" not in out
    assert max(metrics(run_dir)) == 2 and (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000002"


def test_a_stop_whose_requeue_fails_exits_non_zero(fake_scontrol, monkeypatch, tmp_path, data_cache):
    """SIGTERM in a running batch job without the batch shell's request file (submitit, a
    hand-written script): rank 0 runs `scontrol requeue` itself. When that fails the job neither
    finished nor went back in the queue, so it must not end with 0, which SLURM (and `afterok`
    dependencies, submitit) would take as a completed job; the rendered batch script exits 1 then too."""
    script = fake_scontrol.parent / "bin" / "scontrol"
    script.write_text('#!/bin/sh\nif [ "$1" = requeue ]; then echo "Requested operation is presently disabled" >&2; '
                      'exit 1; fi\necho "JobId=$4 JobName=x $JOB_FIELDS"\n')
    monkeypatch.setenv("JOB_FIELDS", "JobState=RUNNING Restarts=0 BatchFlag=1")
    run_dir = tmp_path / "run"
    proc = _start(run_dir, data_cache, *LONG)
    try:
        _wait_for_steps(proc, run_dir, 1)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "stopped by SIGTERM after step" in out and "requeueing job 42" in out, out[-3000:]
    assert "scontrol requeue 42 failed: Requested operation is presently disabled" in out, out[-3000:]
    assert proc.returncode == 1, out[-3000:]
    assert out.strip().splitlines()[-1] == "error: the job was not requeued; resume it by relaunching it"
    assert "Traceback" not in out
