"""Graceful stop on a signal: the handler only raises a flag; the loop finishes the current step,
saves a checkpoint and exits cleanly. Inside a SLURM batch job, a stop on one of
`launch.requeue_signals` (USR1: the time-limit warning of `#SBATCH --signal`) then puts the job back
in the queue, and the requeued job resumes from that checkpoint (resume=auto)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess

log = logging.getLogger(__name__)


class StopSignal:
    """Installs handlers for the named signals (e.g. ["SIGUSR1", "SIGTERM"]) and records receipt."""

    def __init__(self, names: list[str]):
        self.received: str | None = None
        self._previous = {}
        for name in names:
            sig = getattr(signal, name, None)
            if not isinstance(sig, signal.Signals):
                raise ValueError(f"trainer.stop_signals: unknown signal {name!r}")
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        # keep the handler trivial: logging from a signal handler can deadlock on its lock
        self.received = signal.Signals(signum).name

    @property
    def requested(self) -> bool:
        return self.received is not None

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def should_requeue(stop_signal: StopSignal | None, requeue_signals: list[str], finished: bool) -> bool:
    """True when an unfinished run inside a SLURM job stopped on one of `requeue_signals`."""
    return (stop_signal is not None and stop_signal.received in requeue_signals and not finished
            and "SLURM_JOB_ID" in os.environ)


def requeue_slurm_job(timeout: float = 60.0) -> bool:
    """`scontrol requeue $SLURM_JOB_ID`; returns whether SLURM accepted it.

    Call it on one rank, after the stop checkpoint is complete on every rank: SLURM ends the running
    job at once (SIGTERM, then SIGKILL) and starts it again from its batch script. The job must have
    been submitted with --requeue (the launchers in launch/ do this).
    """
    job_id = os.environ["SLURM_JOB_ID"]
    try:
        out = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.error("could not requeue SLURM job %s: %s; relaunch it by hand to resume", job_id, e)
        return False
    if out.returncode != 0:
        log.error("scontrol requeue %s failed: %s; relaunch it by hand to resume", job_id, out.stderr.strip())
        return False
    log.info("requeued SLURM job %s; it resumes from the checkpoint just saved", job_id)
    return True
