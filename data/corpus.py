"""Which files make the corpus. The default is the standard library of the running interpreter."""

from __future__ import annotations

import sysconfig
from pathlib import Path

# third-party packages can live inside the stdlib directory; they are not part of it
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def corpus_root(source: str) -> Path:
    """The directory the corpus is read from: the stdlib for "stdlib", else `source` itself."""
    root = Path(sysconfig.get_paths()["stdlib"]) if source == "stdlib" else Path(source)
    if not root.is_dir():
        raise FileNotFoundError(f"data.source: {root} is not a directory")
    return root


def list_corpus_files(source: str, glob: str, max_bytes: int) -> tuple[Path, list[Path]]:
    """Files of the corpus in a machine-independent order (sorted relative paths), taken until
    their total size reaches `max_bytes`. Returns (root, files)."""
    root = corpus_root(source)
    candidates = sorted(
        (p for p in root.glob(glob) if p.is_file() and not _EXCLUDED_DIRS.intersection(p.relative_to(root).parts)),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    files, total = [], 0
    for path in candidates:
        if total >= max_bytes:
            break
        files.append(path)
        total += path.stat().st_size
    if not files:
        raise FileNotFoundError(f"data: no files match {glob!r} under {root}")
    return root, files
