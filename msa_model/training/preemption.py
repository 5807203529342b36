"""Graceful stop on a signal: the handler only raises a flag; the loop finishes the current step,
saves a checkpoint and exits cleanly with one line saying what happened. A second Ctrl-C (SIGINT)
aborts at once.

Inside a SLURM batch job, a stop on one of `launch.requeue_signals` (USR1: the time-limit warning
of `#SBATCH --signal`; TERM: `scancel --signal=TERM`, a site's preemption) puts the job back in the
queue while it is still running, and the requeued job resumes from that checkpoint (resume=auto).
A job SLURM is already ending is left alone: `scancel` (cancelled: no requeue) and `scontrol
requeue` or preemption in requeue mode (SLURM requeues it itself) also send SIGTERM.

Who runs `scontrol requeue`: the batch script rendered by launch/slurm.py sets MSA_REQUEUE_REQUEST
to a file; rank 0 writes it and the batch shell requeues once the training step has exited, so no
trainer or torchrun is signalled mid-exit. Without it (submitit, a hand-written script) rank 0 runs
`scontrol requeue` itself as the last thing it does.

A stop exits 0: under SLURM the job's end (cancelled, preempted, timed out, requeued) is SLURM's
doing whatever the status. A requeue that fails exits 1, so the job does not end as completed
(README, "Preemption, time limits and failures").
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
from dataclasses import dataclass

log = logging.getLogger(__name__)

REQUEST_ENV = "MSA_REQUEUE_REQUEST"


class StopSignal:
    """Installs handlers for the named signals (e.g. ["SIGUSR1", "SIGTERM", "SIGINT"]) and
    records the first one received. A second SIGINT raises KeyboardInterrupt (abort)."""

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
        if signum == signal.SIGINT and self.received == "SIGINT":
            raise KeyboardInterrupt("a second SIGINT: aborting without saving")
        if self.received is None:
            self.received = signal.Signals(signum).name

    @property
    def requested(self) -> bool:
        return self.received is not None

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


@dataclass
class RequeuePlan:
    """What happens to the SLURM job after a requested stop: `requeue` (this job must requeue
    itself) and a few words for the stop line."""

    requeue: bool
    note: str


def _job_fields(job_id: str, timeout: float = 30.0) -> dict[str, str]:
    try:
        out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True,
                             timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return dict(re.findall(r"(\w+)=(\S*)", out.stdout)) if out.returncode == 0 else {}


def plan_requeue(signal_name: str | None, requeue_signals: list[str], finished: bool,
                 relaunch: str = "relaunch the run") -> RequeuePlan:
    """Whether a stop on `signal_name` requeues the SLURM job this process runs in (call on one
    rank). Asks slurmctld for the job's state: only a running batch job is requeued by us.
    `relaunch` says how to resume by hand (used in the notes)."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if signal_name is None or finished:
        return RequeuePlan(False, "")
    if job_id is None:
        return RequeuePlan(False, f"not a SLURM job; {relaunch} to resume")
    if signal_name not in requeue_signals:
        return RequeuePlan(False, f"job {job_id} not requeued ({signal_name} is not in launch.requeue_signals); "
                                  f"{relaunch} to resume")
    job = _job_fields(job_id)
    if not job:
        # slurmctld unreachable: try anyway; a failure is reported
        return RequeuePlan(True, f"requeueing job {job_id}")
    if int(job.get("Restarts", "0")) > int(os.environ.get("SLURM_RESTART_COUNT", "0")):
        return RequeuePlan(False, f"SLURM is requeueing job {job_id}")
    if job.get("BatchFlag") == "0":
        return RequeuePlan(False, f"job {job_id} is not a batch job and cannot be requeued; {relaunch} to resume")
    state = job.get("JobState")
    if state != "RUNNING":
        return RequeuePlan(False, f"job {job_id} is ending ({state}: cancelled or out of time), not requeued; "
                                  f"{relaunch} to resume")
    return RequeuePlan(True, f"requeueing job {job_id}")


def requeue_slurm_job(timeout: float = 60.0) -> bool:
    """Requeue this SLURM job; returns whether that was accepted (or handed to the batch shell).

    Call it on one rank, after the stop checkpoint is complete on every rank and the process group
    is gone. With MSA_REQUEUE_REQUEST set (launch/submit.sbatch.in) this only writes that file
    and the batch shell runs `scontrol requeue` after the step exits; otherwise it runs it here,
    and SLURM ends the running job at once (SIGTERM, then SIGKILL) and starts it again from its
    batch script. The job must have been submitted with --requeue (the launchers in launch/ do).
    """
    job_id = os.environ["SLURM_JOB_ID"]
    request = os.environ.get(REQUEST_ENV)
    if request:
        try:
            with open(request, "w") as f:
                f.write(f"{job_id}\n")
            return True
        except OSError as e:
            log.error("could not write %s (%s); requeueing job %s from here", request, e.strerror, job_id)
    try:
        out = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.error("could not requeue SLURM job %s: %s; relaunch it by hand to resume", job_id, e)
        return False
    if out.returncode != 0:
        log.error("scontrol requeue %s failed: %s; relaunch it by hand to resume", job_id, out.stderr.strip())
        return False
    return True
