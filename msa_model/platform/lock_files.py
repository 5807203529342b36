"""The file primitives of the project's lock files: the run directory's `run.lock`
(msa_model/training/run_dir.py) and a data cache's `<dir>.lock` (data/shared_build.py).

A lock file holds its holder's description as JSON; it is created atomically (a complete file
hard-linked into place, or exclusive creation where the file system has no hard links), so two
processes never both hold it, and read without trusting it (gone, unreadable, half-written).
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def read_lock(path: Path) -> tuple[dict | None, float | None]:
    """(holder or None if unreadable, mtime) of a lock file; (None, None) if it is gone."""
    try:
        mtime = path.stat().st_mtime
        return json.loads(path.read_text()), mtime
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError):
        return None, mtime


def create_lock(path: Path, tmp: Path, text: str) -> bool:
    """Create `path` holding `text` if it does not exist (through the scratch file `tmp`); whether
    this call created it."""
    tmp.write_text(text)
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    except OSError:
        # a file system without hard links: exclusive creation (a reader may find it empty for an
        # instant, which its caller reads as a live holder)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return True
    finally:
        tmp.unlink(missing_ok=True)


def pid_state(pid: int) -> tuple[bool, str | None]:
    """(alive, start time in clock ticks since boot) of a process of this host; a zombie has exited
    (only not been reaped)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        try:
            os.kill(pid, 0)  # no /proc: alive if it exists
        except ProcessLookupError:
            return False, None
        except PermissionError:
            pass
        return True, None
    return fields[0] not in ("Z", "X"), fields[19]


def remove_stale(path: Path, aside: Path, judged: dict | None) -> bool:
    """Remove the lock file at `path` whose holder was judged gone (`judged`: what it held then,
    None if unreadable). The file is moved aside first and checked: another process may have taken
    over in between, and its fresh lock is put back. Whether the judged lock was removed."""
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False
    moved, _ = read_lock(aside)
    removed = (moved or {}) == (judged or {})
    if not removed:
        try:
            os.link(aside, path)
        except OSError:
            pass
    aside.unlink(missing_ok=True)
    return removed
