"""A fatal error on one rank of a job is said once, by that rank, with its rank and host; every
other rank then stops with one line naming it, instead of a gloo/NCCL traceback or silence:

    error: [rank 1 on node2] data cache /scratch/c/stdlib-1f2e does not exist after rank 0 built it: ...
    [rank 0 on node1] stopping: rank 1 on node2 failed

The ranks share the job's store (the c10d TCPStore every multi-rank launch has, hosted by
torchrun's agent or by rank 0 at MASTER_ADDR:MASTER_PORT) over a connection of their own. The
first rank to fail records its error there; a watcher thread on every rank looks for it once a
second, so a rank blocked in a collective (NCCL would wait out its timeout) stops at once, and a
rank whose collective broke first finds it there too. Every rank that stops counts itself; the
failed rank waits for all of them (at most LINGER_S) before it exits, so a store it hosts
outlives the news. Rank 0 writes the error and its own line into train.log, when the run
directory's log is open.

Before the process group exists (a single process, or an error of the configuration, the same on
every rank) rank 0 alone says the error, as a plain `error: <message>`.

Under torchrun, whose report of a failed job (its own traceback, then a summary of the failed
ranks) comes after everything the ranks said, each rank also writes the error it stops for into
the error file torchrun gives it (TORCHELASTIC_ERROR_FILE): the summary, the job's last lines,
then ends with the error, whichever rank torchrun takes for the first to fail, instead of
"To enable traceback see ...". A rank stopping for another's failure writes its stop line with
that error.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import NoReturn

POLL_S = 1.0
LINGER_S = 5.0


def host() -> str:
    # the node's SLURM name where there is one (also tells apart the fake nodes of one host)
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


class _Channel:
    """The job's store, under keys of this launch attempt."""

    def __init__(self, rank: int, world_size: int):
        import torch.distributed as dist

        self.rank, self.world_size, self.host = rank, world_size, host()
        self.store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                   timeout=timedelta(seconds=60))
        # torchrun's store outlives a restart of its workers
        attempt = f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}.{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        self.key = f"msa/failure/{attempt}/"

    def first(self, wait_s: float = 0.0) -> dict | None:
        """The first failure recorded in the job, waiting up to `wait_s` for one."""
        deadline = time.monotonic() + wait_s
        while True:
            if self.store.check([self.key + "first"]):
                return json.loads(self.store.get(self.key + "first"))
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.1)

    def record_failure(self, message: str, code: int) -> dict:
        """Count this rank's failure; return the job's first (this one when it is)."""
        mine = {"rank": self.rank, "host": self.host, "code": code, "message": message}
        if self.store.add(self.key + "failed", 1) == 1:
            self.store.set(self.key + "first", json.dumps(mine))
            return mine
        return self.first(wait_s=LINGER_S) or mine

    def count_stopped(self) -> None:
        self.store.add(self.key + "stopped", 1)

    def linger(self) -> None:
        """Until every rank has failed or stopped, at most LINGER_S."""
        deadline = time.monotonic() + LINGER_S
        while time.monotonic() < deadline:
            if self.store.add(self.key + "failed", 0) + self.store.add(self.key + "stopped", 0) >= self.world_size:
                return
            time.sleep(0.1)


_channel: _Channel | None = None
_watcher: threading.Thread | None = None
_stop_watching = threading.Event()
# one report per process: the main thread's or the watcher's, whichever comes first
_reporting = threading.RLock()


def watch(rank: int, world_size: int) -> None:
    """Once the process group of a multi-rank job exists: share failures through its store and
    stop this rank when another one fails."""
    global _channel, _watcher
    if world_size <= 1 or "MASTER_ADDR" not in os.environ or _channel is not None:
        return
    try:
        _channel = _Channel(rank, world_size)
    except Exception as e:  # noqa: BLE001 - without it, errors are reported as before
        logging.getLogger(__name__).warning("failures of other ranks will not be named: no store connection (%s)", e)
        return
    _stop_watching.clear()
    _watcher = threading.Thread(target=_watch, name="failure-watcher", daemon=True)
    _watcher.start()


def stop_watching() -> None:
    """Before a clean shutdown: a rank that finished (and a store it hosts going away) is no failure."""
    global _channel, _watcher
    _stop_watching.set()
    if _watcher is not None:
        _watcher.join()
    _channel, _watcher = None, None


def active() -> bool:
    return _channel is not None


def _watch() -> None:
    channel = _channel
    while not _stop_watching.wait(POLL_S):
        try:
            first = channel.first()
        except Exception:  # noqa: BLE001 - the store is gone; the rank's own collectives will tell
            return
        if first is not None and first["rank"] != channel.rank:
            _stop_for(channel, first)


def _to_run_log(*lines: str) -> None:
    """Into train.log (rank 0's file handler, once the run directory is this run's)."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            for line in lines:
                handler.handle(logging.LogRecord(__name__, logging.ERROR, __file__, 0, line, None, None))


def _tell_launcher(message: str) -> None:
    """`message` into this rank's torchrun error file, in the format torchrun reads (its summary
    shows "py_callstack" under `traceback :`); nothing outside torchrun. Written before the error is
    printed: torchrun stops the other ranks as soon as one of them exits."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    report = {"message": {"message": message, "extraInfo": {"py_callstack": message,
                                                            "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(report, f)
    except OSError:
        pass  # torchrun's summary says "To enable traceback see ..." as before


def _hold_signals() -> None:
    """A rank saying why it stops is not cut short by its launcher's SIGTERM (torchrun and srun
    send it when a rank exits; the trainer's own handlers are gone by now). It exits within
    seconds anyway. Only the main thread can set handlers; the watcher's process keeps the
    trainer's, which only record a signal."""
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, signal.SIG_IGN)


def _exit(code: int) -> NoReturn:
    # os._exit: a process group with a failed peer can hang at interpreter exit (and NCCL's
    # destructor would warn); every line is flushed first
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _stop_for(channel: _Channel, first: dict) -> NoReturn:
    """Another rank failed first: one line, then exit with its code."""
    with _reporting:
        line = f"[rank {channel.rank} on {channel.host}] stopping: rank {first['rank']} on {first['host']} failed"
        _tell_launcher(f"{line}: {first['message']}")
        print(line, file=sys.stderr, flush=True)
        if channel.rank == 0:
            _to_run_log(f"error: [rank {first['rank']} on {first['host']}] {first['message']}", line)
        try:
            channel.count_stopped()
            channel.linger()
        except Exception:  # noqa: BLE001 - the store went away meanwhile
            pass
        _exit(first["code"])


def fail(message: str, code: int, every_rank: bool = False, this_rank: bool = False) -> NoReturn:
    """This rank's fatal error (`message`, one line unless it is a traceback): said once in the
    job, then exit with `code`. `every_rank`: every rank has the same error (Ctrl-C): rank 0 says it.
    `this_rank`: before the job's store exists, an error of this rank alone (the process group
    could not start): said by this rank, with its rank and host."""
    channel = _channel
    if channel is not None:
        _hold_signals()
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
    if channel is None and this_rank:
        _tell_launcher(f"[rank {rank} on {host()}] {message}")
        print(f"error: [rank {rank} on {host()}] {message}", file=sys.stderr, flush=True)
        sys.exit(code)
    if channel is None or every_rank:
        _tell_launcher(message)
        if rank == 0:
            print(f"error: {message}", file=sys.stderr, flush=True)
        if channel is None:
            sys.exit(code)
        _exit(code)
    with _reporting:
        try:
            first = channel.record_failure(message.splitlines()[0] if message else "", code)
        except Exception:  # noqa: BLE001 - no store: say it here, like the first
            first = None
        if first is not None and first["rank"] != channel.rank:
            _stop_for(channel, first)
        _tell_launcher(f"[rank {channel.rank} on {channel.host}] {message}")
        line = f"error: [rank {channel.rank} on {channel.host}] {message}"
        print(line, file=sys.stderr, flush=True)
        _to_run_log(line)
        try:
            channel.linger()
        except Exception:  # noqa: BLE001
            pass
        _exit(code)


def _lost_peer(exc: BaseException) -> bool:
    """Whether `exc` is a collective broken under this rank (NCCL's errors are DistErrors; gloo's
    lost connections plain RuntimeErrors from its transport)."""
    import torch.distributed as dist

    text = str(exc)
    return isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and (
        "/gloo/transport/" in text or "Connection closed by peer" in text or "Connection reset by peer" in text))


def crash(exc: BaseException) -> NoReturn:
    """An exception nobody expected (a bug, a lost peer) on a rank of a job whose failures are
    watched: the failure of another rank that it follows from, a peer that vanished without a
    word, or this rank's own error with its traceback."""
    channel = _channel
    _hold_signals()
    lost = _lost_peer(exc)
    try:
        # a collective broke because a peer exited: its failure is recorded by now
        first = channel.first(wait_s=2.0 if lost else 0.0)
    except Exception:  # noqa: BLE001
        first = None
    if first is not None and first["rank"] != channel.rank:
        _stop_for(channel, first)
    if lost:
        with _reporting:
            # gloo's "[<source>:<line>] Connection closed by peer [addr]:port. This is typically ..."
            what = re.sub(r"^\[[^\]]*\]\s*", "", (str(exc).strip().splitlines() or [""])[0]).split(". ")[0]
            what = what or type(exc).__name__
            line = (f"[rank {channel.rank} on {channel.host}] stopping: lost another rank of the job, which stopped "
                    f"without a message (killed, out of memory, or its node failed?): {what}")
            _tell_launcher(line)
            print(line, file=sys.stderr, flush=True)
            _to_run_log(line)
            _exit(1)
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip()
    fail(f"{type(exc).__name__}: {exc}\n{text}", 1)
