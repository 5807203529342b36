"""Checkpoint manifests: the size and SHA-256 of every file of a checkpoint directory, written into
the directory before it is renamed into place and checked before anything is loaded from it.

    <step dir>/manifest.json   {"format": 1, "files": {"<relative path>": {"size": int, "sha256": str}}}

Both directions are collective when torch.distributed is initialised: rank 0 lists the files, every
rank hashes its share (file i goes to rank i % world), and the results meet on rank 0 (writing) or
on every rank (checking), so every rank raises the same error. On one process everything is local.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch.distributed as dist

from msa_model.training.checkpoint_checks import CheckpointError

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
_FORMAT = 1
_CHUNK = 8 << 20


class DamagedCheckpointError(CheckpointError, ValueError):
    """A checkpoint whose files differ from its manifest (or have none of it); names the files.

    A CheckpointError to the trainer (an input error: exit 2) and a ValueError to the conversion
    tools, which report bad input that way."""


def _dist() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _broadcast(obj):
    """Rank 0's `obj` on every rank."""
    if _dist()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _all_gather(obj) -> list:
    if _dist()[1] == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def file_digest(path: Path) -> dict:
    """{"size": bytes, "sha256": hex digest} of one file."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": h.hexdigest()}


def _list_files(directory: Path) -> list[str]:
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*")
                  if p.is_file() and p.name != MANIFEST)


def write_manifest(directory: str | Path) -> None:
    """Hash every file under `directory` and write `manifest.json` there (synced to disk).

    Call it once all ranks have finished writing the directory; collective across ranks."""
    directory = Path(directory)
    rank, world = _dist()
    files = _broadcast(_list_files(directory) if rank == 0 else None)
    mine = {name: file_digest(directory / name) for name in files[rank::world]}
    merged = {}
    for part in _all_gather(mine):
        merged.update(part)
    if rank == 0:
        tmp = directory / f".{MANIFEST}.tmp"
        with open(tmp, "w") as f:
            json.dump({"format": _FORMAT, "files": dict(sorted(merged.items()))}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, directory / MANIFEST)
        # the rename of the directory that follows must not overtake the files' own metadata
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    if world > 1:
        dist.barrier()


def _read_manifest(directory: Path) -> tuple[dict | None, str | None]:
    """(files, problem): files is None when there is no readable manifest."""
    path = directory / MANIFEST
    if not path.is_file():
        return None, None
    try:
        data = json.loads(path.read_text())
        files = data["files"]
        if not isinstance(files, dict) or not all(
                isinstance(v, dict) and isinstance(v.get("size"), int) and isinstance(v.get("sha256"), str)
                for v in files.values()):
            raise ValueError("unexpected layout")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        return None, f"{MANIFEST} is unreadable ({e.__class__.__name__}: {e})"
    return files, None


def _check_file(directory: Path, name: str, expected: dict) -> str | None:
    path = directory / name
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return f"{name} is missing"
    except OSError as e:
        return f"{name} cannot be read ({e.strerror})"
    if size != expected["size"]:
        return f"{name} is {size:,} bytes, the manifest says {expected['size']:,}"
    try:
        digest = file_digest(path)["sha256"]
    except OSError as e:
        return f"{name} cannot be read ({e.strerror})"
    if digest != expected["sha256"]:
        return f"{name} has different contents than when it was saved (sha256 {digest[:12]}..., manifest {expected['sha256'][:12]}...)"
    return None


def check_manifest(directory: str | Path) -> tuple[bool, list[str]]:
    """(has_manifest, problems) for a checkpoint directory; collective across ranks.

    problems name each file whose size or SHA-256 differs from the manifest, or that is missing;
    an empty list with has_manifest=False means the directory predates manifests."""
    directory = Path(directory)
    rank, world = _dist()
    files, problem = _broadcast(_read_manifest(directory) if rank == 0 else None)
    if problem is not None:
        return True, [problem]
    if files is None:
        return False, []
    names = sorted(files)
    mine = [p for name in names[rank::world] if (p := _check_file(directory, name, files[name])) is not None]
    problems = sorted(p for part in _all_gather(mine) for p in part)
    return True, problems


def describe(directory: str | Path, problems: list[str]) -> str:
    """One line: the directory and its damaged files (the first few)."""
    shown = "; ".join(problems[:6]) + (f"; and {len(problems) - 6} more" if len(problems) > 6 else "")
    return f"{directory} is damaged: {shown}"


def warn_unverified(directory: str | Path, what: str) -> None:
    log.warning("%s %s has no %s (saved before manifests existed): its files cannot be verified",
                what, directory, MANIFEST)


def verify_checkpoint(directory: str | Path, what: str = "checkpoint",
                      error: type[Exception] = DamagedCheckpointError) -> bool:
    """Raise `error` naming the damaged files of `directory`, if any; collective across ranks.

    Returns whether the directory had a manifest (one written before manifests existed is
    loaded as it is, with a warning)."""
    has_manifest, problems = check_manifest(directory)
    if problems:
        raise error(f"{what} {describe(directory, problems)}")
    if not has_manifest:
        warn_unverified(directory, what)
    return has_manifest
