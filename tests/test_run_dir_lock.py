"""One training process per run directory: a second launch is refused naming the holder (host,
pid), also at two ranks; a lock whose holder is gone (killed, another host's without heartbeat, an
earlier run of a requeued SLURM job) is taken over with a warning; racing launches get one lock."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from msa_model.training.run_dir import RunDirBusy, RunDirLock
from skeleton_helpers import REPO, _env, run_train

STEPS = ("trainer.max_steps=2", "trainer.indexer_warmup_tokens=1024")
HOLD = """
import sys, time
from msa_model.training.run_dir import RunDirLock
RunDirLock(sys.argv[1]).acquire()
print("locked", flush=True)
time.sleep(600)
"""


def _holder(run_dir) -> subprocess.Popen:
    """A live process on this host that holds the lock of `run_dir`."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], cwd=REPO, env=_env(),
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def _plant(run_dir, **info):
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = run_dir / RunDirLock.NAME
    lock.write_text(json.dumps({"host": "node-17", "pid": 4242, "started": "earlier", **info}))
    return lock


def test_a_second_launch_is_refused_naming_the_holder(tmp_path, data_cache):
    run_dir = tmp_path / "run"
    holder = _holder(run_dir)
    try:
        proc = run_train(run_dir, *STEPS, data_cache=data_cache, check=False)
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    err = proc.stderr.strip().splitlines()
    assert f"in use by pid {holder.pid} on host {socket.gethostname()}" in err[-1], err[-5:]
    assert "Traceback" not in proc.stderr
    # it wrote nothing: the holder's config, log, checkpoints and metrics are not its to touch
    assert not [n for n in ("config.yaml", "launch.sh", "checkpoints", "metrics.jsonl", "train.log")
                if (run_dir / n).exists()]


@pytest.mark.slow
def test_every_rank_stops_when_rank_0_is_refused(tmp_path, data_cache):
    run_dir = tmp_path / "run"
    holder = _holder(run_dir)
    try:
        proc = run_train(run_dir, *STEPS, data_cache=data_cache, nproc=2, check=False, timeout=240)
    finally:
        holder.kill()
        holder.wait()
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    # rank 0 names the holder once; rank 1 learns the refusal from rank 0 and stops too (a hang
    # would run into the timeout above)
    assert f"in use by pid {holder.pid}" in out and "failed (exitcode: 2)" in out, out[-3000:]
    assert out.count("error: ") == 1, out[-3000:]
    assert json.loads((run_dir / "run.lock").read_text())["pid"] == holder.pid


def test_the_lock_of_a_killed_process_is_taken_over(tmp_path, caplog):
    run_dir = tmp_path / "run"
    holder = _holder(run_dir)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    lock = RunDirLock(run_dir)
    with caplog.at_level(logging.WARNING):
        lock.acquire()
    try:
        assert f"process {holder.pid} on {socket.gethostname()} is no longer running" in caplog.text
        assert json.loads((run_dir / "run.lock").read_text())["pid"] == os.getpid()
    finally:
        lock.release()
    assert not (run_dir / "run.lock").exists()


def test_another_hosts_lock_is_busy_while_it_beats_then_stale(tmp_path, caplog):
    lock_file = _plant(tmp_path)
    with pytest.raises(RunDirBusy, match="in use by pid 4242 on host node-17"):
        RunDirLock(tmp_path).acquire()
    old = time.time() - 3600
    os.utime(lock_file, (old, old))
    lock = RunDirLock(tmp_path)
    with caplog.at_level(logging.WARNING):
        lock.acquire()
    assert "from pid 4242 on node-17: its holder on node-17 has not refreshed it for" in caplog.text
    lock.release()


def test_an_earlier_run_of_a_requeued_slurm_job_is_stale(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SLURM_JOB_ID", "991")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    _plant(tmp_path, slurm_job_id="991", slurm_restart_count="1")
    lock = RunDirLock(tmp_path)
    with caplog.at_level(logging.WARNING):
        lock.acquire()
    assert "earlier run of SLURM job 991" in caplog.text
    lock.release()
    # the same run of another job is alive as far as anyone here can tell
    _plant(tmp_path, slurm_job_id="990", slurm_restart_count="2")
    with pytest.raises(RunDirBusy):
        RunDirLock(tmp_path).acquire()


def test_the_holder_refreshes_its_heartbeat(tmp_path):
    lock = RunDirLock(tmp_path, heartbeat_s=0.05)
    lock.acquire()
    try:
        old = time.time() - 3600
        os.utime(lock.path, (old, old))
        deadline = time.time() + 30
        while lock.path.stat().st_mtime < old + 60 and time.time() < deadline:
            time.sleep(0.05)
        assert lock.path.stat().st_mtime > old + 60
    finally:
        lock.release()


def _race(run_dir, start, results):
    while not start.is_set():
        pass
    try:
        RunDirLock(run_dir).acquire()
        results.put(os.getpid())
        time.sleep(3)  # hold it while the others look
    except RunDirBusy:
        results.put(None)


def test_racing_launches_take_a_stale_lock_once(tmp_path):
    # a lock left by a process of this host that no longer runs: every racer sees it as stale
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _plant(tmp_path, host=socket.gethostname(), pid=dead.pid)
    ctx = multiprocessing.get_context("fork")
    start, results = ctx.Event(), ctx.Queue()
    racers = [ctx.Process(target=_race, args=(tmp_path, start, results)) for _ in range(4)]
    for p in racers:
        p.start()
    start.set()
    winners = [w for w in (results.get(timeout=60) for _ in racers) if w is not None]
    for p in racers:
        p.join()
    assert len(winners) == 1, winners
