"""Graceful stop on a signal: the handler only raises a flag; the loop finishes the current step,
saves a checkpoint and exits cleanly. (A SLURM requeue hook belongs here too.)"""

from __future__ import annotations

import logging
import signal

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
