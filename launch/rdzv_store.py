"""The c10d rendezvous store of a torchrun job, in a process of its own on the job's first node.

Left to itself, torchrun hosts this store in the agent of the first node. That agent exits as soon
as the agents' exit barrier passes, and an agent of another node still reading the barrier's result
then logs "Error waiting on exit barrier ... Failed to recv" with a traceback, after a run that went
well (a known race of torch's elastic agent). The submit script starts this process before srun,
passes `--rdzv-conf=is_host=false` to every torchrun, and ends it (SIGHUP) when the training step is
over. It ignores the stop signals the trainers act on (TERM, USR1, INT), so that it outlives them,
and exits by itself when the submit script is gone.

    python launch/rdzv_store.py PORT READY_FILE

READY_FILE is created once the store listens; the submit script waits for it before srun.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from pathlib import Path


def main(port: int, ready: Path) -> None:
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    from torch.distributed import TCPStore

    parent = os.getppid()
    store = TCPStore(socket.gethostname(), port, is_master=True, wait_for_workers=False)  # noqa: F841
    ready.touch()
    while os.getppid() == parent:
        time.sleep(1)


if __name__ == "__main__":
    if len(sys.argv) != 3 or not sys.argv[1].isdigit():
        sys.exit("usage: python launch/rdzv_store.py PORT READY_FILE")
    main(int(sys.argv[1]), Path(sys.argv[2]))
