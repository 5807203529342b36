"""Files that several processes may build at once, built by one of them: the ranks of a job, and
other jobs started on the same cache directory (on a file system every node sees).

- `BuildLock(path, ...)`: held by whoever builds `path`; the others wait for it, then find the
  result and use it. Across processes, nodes and jobs.
- `wait_for_rank_0(timeout_s)`: the other ranks of a job wait there while rank 0 builds (or waits
  for another job's build), however long that takes within `timeout_s`.
- `build_megatron_datasets(builder, ...)`: megatron's BlendedMegatronDatasetBuilder.build() with its
  sample indices (`path_to_cache`) built once, checked before use and recorded after.

The lock makes a build exclusive, not atomic: what it builds must still appear complete or not at
all to readers that do not take it (a temporary name renamed into place), or be read only after
the builder released the lock (megatron writes its indices in place; rank 0 holds the lock until
every rank of its job has them).

`<path>.lock` is created atomically (a complete file hard-linked into place, or O_EXCL) and holds
the builder's host, pid and SLURM job; its modification time is a heartbeat, refreshed every
`heartbeat_s` while the builder lives. A waiter takes over a lock whose builder is provably gone:
on the same host its pid no longer runs; elsewhere its heartbeat stopped for `stale_after_s`. A
waiter that has waited `timeout_s` for a live builder gives up with an error naming it and the lock.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path

from msa_model.platform.lock_files import create_lock, pid_state, read_lock, remove_stale

from .cache_check import DataCacheError, problem, record, unrecorded

log = logging.getLogger(__name__)


class BuildLock:
    """`<path>.lock`: one builder of `path` at a time (module docstring). `what` names the thing
    built in messages; waiting longer than `timeout_s` for a live builder raises DataCacheError.

    A directory this process cannot write is read as it is: no lock is taken (nothing could be
    built there either). `stale_after_s` is generous: the heartbeat is a thread, which a build
    holding the interpreter lock (a long native call) holds up."""

    def __init__(self, path: str | Path, what: str, timeout_s: float, stale_after_s: float = 300.0,
                 heartbeat_s: float = 10.0, poll_s: float = 0.5):
        path = Path(path)
        self.path = path.with_name(f"{path.name}.lock")
        self.what, self.timeout_s = what, timeout_s
        self.stale_after_s, self.heartbeat_s, self.poll_s = stale_after_s, heartbeat_s, poll_s
        self.info = {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": pid_state(os.getpid())[1],
                     "slurm_job_id": os.environ.get("SLURM_JOB_ID"), "rank": os.environ.get("RANK"),
                     "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        self.held = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> BuildLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def _read(self, path: Path) -> tuple[dict | None, float | None]:
        return read_lock(path)

    def _try_create(self) -> bool:
        tmp = self.path.with_name(f".{self.path.name}.{self.info['host']}.{self.info['pid']}")
        return create_lock(self.path, tmp, json.dumps(self.info) + "\n")

    def _gone(self, holder: dict, mtime: float, unchanged_s: float) -> str | None:
        """Why the holder is gone, or None while it may be alive."""
        if holder.get("host") == self.info["host"]:
            pid = holder.get("pid")
            if not isinstance(pid, int) or pid <= 0:
                return "it names no process"
            alive, start = pid_state(pid)
            if not alive or (holder.get("pid_start") and start and start != holder["pid_start"]):
                return f"process {pid} on {holder['host']} is no longer running"
            if pid == self.info["pid"]:
                return "this very process left it"
            return None
        # another host: its heartbeat, judged by the file's age and, whatever the clocks say, by
        # how long this process has seen it unchanged
        age = max(time.time() - mtime, unchanged_s)
        if age > self.stale_after_s:
            return f"its builder on {holder.get('host')} has not refreshed it for {age:.0f} s"
        return None

    def _describe(self, holder: dict) -> str:
        job = f", SLURM job {holder['slurm_job_id']}" if holder.get("slurm_job_id") else ""
        rank = f", rank {holder['rank']}" if holder.get("rank") is not None else ""
        return f"pid {holder.get('pid')} on {holder.get('host')} (since {holder.get('started')}{job}{rank})"

    def acquire(self) -> None:
        """Take the lock, waiting while a live builder holds it."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            created = self._try_create()
        except PermissionError:
            return
        except OSError as e:
            if e.errno == errno.EROFS:
                return
            raise
        started = time.monotonic()
        seen, seen_since, announced = None, started, False
        while not created:
            holder, mtime = self._read(self.path)
            if mtime is not None:
                now = time.monotonic()
                if (holder, mtime) != seen:
                    seen, seen_since = (holder, mtime), now
                if holder is None:
                    # being written (no hard links), or damaged: a live writer finishes at once
                    reason = "it is unreadable" if now - seen_since > 5 else None
                else:
                    reason = self._gone(holder, mtime, now - seen_since)
                if reason is not None:
                    self._take_over(holder, reason)
                elif now - started > self.timeout_s:
                    raise DataCacheError(
                        f"{self.what}: still being built by {self._describe(holder or {})} after {now - started:.0f} s "
                        f"of waiting (data.cache_wait_s); wait longer, or if that build is gone, delete {self.path}")
                else:
                    if not announced and holder is not None:
                        log.info("%s: waiting for %s, which holds its lock (building or checking it)", self.what,
                                 self._describe(holder))
                        announced = True
                    time.sleep(self.poll_s)
            created = self._try_create()
        self.held = True
        self._thread = threading.Thread(target=self._beat, name="build-lock-heartbeat", daemon=True)
        self._thread.start()

    def _take_over(self, holder: dict | None, reason: str) -> None:
        aside = self.path.with_name(f".{self.path.name}.stale.{self.info['host']}.{self.info['pid']}")
        if remove_stale(self.path, aside, holder):
            log.warning("%s: taking over the build from %s: %s", self.what,
                        self._describe(holder) if holder else "an unknown builder", reason)

    def _owned(self) -> bool:
        return self._read(self.path)[0] == self.info

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                if self._owned():
                    os.utime(self.path)
            except OSError:
                pass

    def release(self) -> None:
        if not self.held:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._owned():
            self.path.unlink(missing_ok=True)
        self.held = False


# timeout -> (the default group it was made in, the group)
_groups: dict[float, tuple] = {}


def wait_for_rank_0(timeout_s: float) -> None:
    """Every rank of the job calls this; the others return once rank 0 has (up to `timeout_s`).

    A barrier of a gloo group of its own: the default group's timeout (minutes with NCCL) would
    end a wait for a long build, and NCCL would hold a GPU stream for it. A rank 0 that fails
    ends the wait at once (its process exits)."""
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    world, group = _groups.get(timeout_s, (None, None))
    if world is not dist.group.WORLD:
        # every rank creates it here, at the same call (again after a new default group)
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        _groups[timeout_s] = (dist.group.WORLD, group)
    dist.barrier(group=group)


def discard(path: Path) -> None:
    """Remove a damaged cache directory; renamed first, so a process that has its files open keeps
    reading the old ones undisturbed."""
    aside = path.with_name(f".{path.name}.damaged-{os.getpid()}")
    os.rename(path, aside)
    shutil.rmtree(aside, ignore_errors=True)


def _check_index_dir(index_dir: Path, full: bool) -> None:
    """Before megatron reads its sample indices: remove damaged or unrecorded ones (megatron
    rebuilds them, cheaply; it checks only that the files exist)."""
    if not index_dir.is_dir():
        return
    files = [p for p in index_dir.iterdir() if p.is_file()]
    found = problem(index_dir, full=full) if files else None
    if found is not None:
        log.warning("data cache %s: %s; rebuilding the sample indices", index_dir, found)
        discard(index_dir)
        return
    for path in unrecorded(index_dir):
        log.warning("data cache %s: %s was never recorded (a build that died?); rebuilding it", index_dir, path.name)
        path.unlink()


def build_megatron_datasets(builder, verify: bool, wait_s: float) -> list:
    """`builder.build()` (a BlendedMegatronDatasetBuilder) on every rank, its sample indices in
    `builder.config.path_to_cache` built once across jobs.

    Rank 0 takes the indices' BuildLock, removes damaged or unrecorded index files (`verify`:
    hashing every byte), lets megatron build the missing ones (rank 0 builds, the others then read
    them), records them in the directory's manifest and releases the lock. The other ranks wait
    for rank 0 up to `wait_s` (wait_for_rank_0)."""
    import torch.distributed as dist

    index_dir = Path(builder.config.path_to_cache)
    lock = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        lock = BuildLock(index_dir, f"sample indices {index_dir}", wait_s)
        lock.acquire()
    try:
        if lock is not None:
            _check_index_dir(index_dir, verify)
        wait_for_rank_0(wait_s)
        datasets = builder.build()
        if lock is not None and index_dir.is_dir():
            # megatron has written any missing indices by now (rank 0 builds them first)
            new = [p.name for p in unrecorded(index_dir)]
            if new:
                record(index_dir, new)
    finally:
        if lock is not None:
            lock.release()
    return datasets
