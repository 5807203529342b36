"""Sizes and hashes of the data cache's files, recorded when they are written and checked before
they are read, so that a damaged cache is rebuilt (or refused) instead of trained on.

`manifest.json` in a directory lists its recorded files: size, sha256 of the whole file, and
sha256 of 64 blocks of 4 KiB spread evenly over it. Every check compares sizes and the sampled
blocks (cheap at any size: 256 KiB read per file); a full check (data.verify_cache=true) also
hashes every byte. A file absent from the manifest is not trusted.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

MANIFEST = "manifest.json"
_BLOCKS, _BLOCK = 64, 4096


class DataCacheError(RuntimeError):
    """A data cache that cannot be used; the message names the path and the problem."""


def _sampled_sha256(path: Path, size: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= _BLOCKS * _BLOCK:
            h.update(f.read())
        else:
            for i in range(_BLOCKS):
                f.seek(i * (size - _BLOCK) // (_BLOCKS - 1))
                h.update(f.read(_BLOCK))
    return h.hexdigest()


def _full_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def describe(path: Path) -> dict:
    size = path.stat().st_size
    return {"size": size, "sampled_sha256": _sampled_sha256(path, size), "sha256": _full_sha256(path)}


def read_manifest(directory: Path) -> dict[str, dict] | None:
    try:
        return json.loads((directory / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def record(directory: Path, names: list[str]) -> None:
    """Add `names` (files in `directory`) to its manifest, replacing the manifest atomically."""
    files = read_manifest(directory) or {}
    for name in names:
        files[name] = describe(directory / name)
    tmp = directory / f".{MANIFEST}.{os.getpid()}"
    tmp.write_text(json.dumps({"files": files}, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, directory / MANIFEST)


def problem(directory: Path, full: bool = False, required: tuple[str, ...] = ()) -> str | None:
    """What is wrong with the recorded files of `directory` (naming the file), or None.

    `required` files must be recorded; `full` also compares the sha256 of every byte."""
    files = read_manifest(directory)
    if files is None:
        return f"{MANIFEST} is missing or unreadable (an interrupted build, or one by an older version)"
    for name in required:
        if name not in files:
            return f"{name} was never recorded in {MANIFEST}"
    return files_problem(directory, files, full)


def files_problem(directory: Path, files: dict[str, dict], full: bool = False) -> str | None:
    """What is wrong with `files` (name -> describe() as recorded) in `directory`, or None: sizes
    and sampled blocks always, the sha256 of every byte with `full`."""
    for name, want in sorted(files.items()):
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != want["size"]:
            return f"{name} is {size:,} bytes, {want['size']:,} when it was built (truncated or overwritten)"
        if _sampled_sha256(path, size) != want["sampled_sha256"]:
            return f"{name} differs from what was built (sampled blocks do not match their hashes)"
        if full and _full_sha256(path) != want["sha256"]:
            return f"{name} differs from what was built (sha256 mismatch)"
    return None


def unrecorded(directory: Path) -> list[Path]:
    """Files of `directory` its manifest does not list (e.g. written by a build that died)."""
    files = read_manifest(directory) or {}
    return sorted(p for p in directory.iterdir() if p.is_file() and p.name != MANIFEST
                  and not p.name.startswith(".") and p.name not in files)
