"""Builds several processes want at once are made by one of them: the others wait for its lock
and reuse what it built; a lock whose builder died is taken over; a live builder on another host
is waited for, then named when the wait times out."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from data.cache_check import DataCacheError
from data.shared_build import BuildLock
from skeleton_helpers import REPO, _env

# a process that builds `target` under its lock: announces itself, starts at the go file, and
# (with a release file given) holds the lock until the test lets it go
BUILDER = """
import logging, os, sys, time
from pathlib import Path
from data.shared_build import BuildLock
target, go, log_file = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
release = Path(sys.argv[4]) if len(sys.argv) > 4 else None
logging.basicConfig(filename=log_file, level=logging.INFO, format="%(message)s")
log = logging.getLogger("builder")
log.info("ready")
while not go.exists():
    time.sleep(0.01)
with BuildLock(target, f"thing {target}", timeout_s=120):
    if not target.exists():
        log.info("build started")
        tmp = target.with_name(f".{target.name}-{os.getpid()}")
        tmp.mkdir()
        (tmp / "data").write_text(str(os.getpid()))
        while release is not None and not release.exists():
            time.sleep(0.01)
        os.rename(tmp, target)
        log.info("build done")
print((target / "data").read_text(), flush=True)
"""


def _start(tmp_path: Path, name: str, target: Path, release: Path | None = None) -> tuple[subprocess.Popen, Path]:
    log_file = tmp_path / f"{name}.log"
    args = [sys.executable, "-c", BUILDER, str(target), str(tmp_path / "go"), str(log_file)]
    proc = subprocess.Popen([*args, *([str(release)] if release else [])], cwd=REPO, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, log_file


def _wait_for(what: str, predicate, timeout: float = 60.0) -> None:
    """Poll until `predicate()` (a guard against a hang, not a speed check)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not seen within {timeout:.0f} s: {what}"
        time.sleep(0.05)


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def test_one_process_builds_the_others_wait_and_reuse_it(tmp_path):
    target, release = tmp_path / "cache" / "thing", tmp_path / "release"
    procs = [_start(tmp_path, f"p{i}", target, release) for i in range(3)]
    try:
        _wait_for("every process ready", lambda: all("ready" in _read(log) for _, log in procs))
        (tmp_path / "go").touch()
        # one builds and holds its lock until released; the two others wait for it, naming it
        _wait_for("one building and two waiting", lambda: (
            sum("build started" in _read(log) for _, log in procs) == 1
            and sum("waiting for pid" in _read(log) for _, log in procs) == 2))
        builder = next(p for p, log in procs if "build started" in _read(log))
        waiting = [_read(log) for _, log in procs if "waiting for" in _read(log)]
        assert all(f"thing {target}: waiting for pid {builder.pid} on " in w for w in waiting), waiting
        assert not target.exists()
        release.touch()
        outs = [(p.communicate(timeout=120), p.returncode) for p, _ in procs]
    finally:
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(rc == 0 for _, rc in outs), outs
    # all read the one build; nobody built again after it; no lock or temporary left behind
    assert {out.strip() for (out, _), _ in outs} == {str(builder.pid)}
    assert sum("build done" in _read(log) for _, log in procs) == 1
    assert sorted(p.name for p in target.parent.iterdir()) == ["thing"]


def test_the_lock_of_a_builder_that_died_is_taken_over(tmp_path, caplog):
    target, release = tmp_path / "cache" / "thing", tmp_path / "release"
    proc, log = _start(tmp_path, "killed", target, release)
    (tmp_path / "go").touch()
    try:
        _wait_for("the build under way", lambda: "build started" in _read(log))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    lock = target.with_name("thing.lock")
    assert json.loads(lock.read_text())["pid"] == proc.pid and not target.exists()
    with caplog.at_level(logging.WARNING), BuildLock(target, "thing", timeout_s=60):
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert f"thing: taking over the build from pid {proc.pid} on " in caplog.text
    assert "is no longer running" in caplog.text
    assert not lock.exists()


def _plant(target: Path, age_s: float) -> Path:
    lock = target.with_name(f"{target.name}.lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.write_text(json.dumps({"host": "node-17", "pid": 4242, "started": "earlier", "slurm_job_id": "77"}))
    os.utime(lock, (time.time() - age_s, time.time() - age_s))
    return lock


def test_another_hosts_live_builder_is_waited_for_then_named(tmp_path):
    target = tmp_path / "thing"
    lock = _plant(target, age_s=0)
    with pytest.raises(DataCacheError) as info:
        BuildLock(target, f"data cache {target}", timeout_s=0.5).acquire()
    message = str(info.value)
    assert message.startswith(f"data cache {target}: still being built by pid 4242 on node-17 (since earlier, "
                              "SLURM job 77) after "), message
    assert f"data.cache_wait_s); wait longer, or if that build is gone, delete {lock}" in message
    assert json.loads(lock.read_text())["pid"] == 4242  # left alone


@pytest.mark.parametrize("age_s", [0, 600])
def test_another_hosts_lock_without_heartbeat_is_taken_over(tmp_path, caplog, age_s):
    """Stale by the file's age (600 s old), or by having seen it unchanged for stale_after_s
    whatever the clocks of the two hosts say (a fresh mtime)."""
    target = tmp_path / "thing"
    lock = _plant(target, age_s=age_s)
    with caplog.at_level(logging.WARNING), BuildLock(target, "thing", timeout_s=60, stale_after_s=1.0, poll_s=0.05):
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert "thing: taking over the build from pid 4242 on node-17 (since earlier, SLURM job 77): its builder on " \
           "node-17 has not refreshed it for" in caplog.text
    assert not lock.exists()


def test_a_held_lock_beats(tmp_path):
    """The holder refreshes its lock while it builds, so that others do not take it over."""
    target = tmp_path / "thing"
    with BuildLock(target, "thing", timeout_s=60, heartbeat_s=0.05) as held:
        os.utime(held.path, (0, 0))
        _wait_for("a heartbeat", lambda: held.path.stat().st_mtime > 0, timeout=30)
