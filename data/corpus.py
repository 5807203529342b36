"""Which files make the corpus. The default is the standard library of the running interpreter."""

from __future__ import annotations

import sysconfig
from pathlib import Path

# third-party packages can live inside the stdlib directory; they are not part of it
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}
# files of JSON records, which the evaluation reads as `python -m data.prepare` does (not a plain
# .json, which data.prepare reads as records only when it is an input itself: a directory of text
# files may hold one)
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".jsonl.gz", ".ndjson.gz")
JSONL_FIELD = "text"


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


def is_jsonl(path: Path) -> bool:
    """A .jsonl/.ndjson(.gz) file: its records are its documents (file_documents)."""
    return path.name.lower().endswith(JSONL_SUFFIXES)


def file_documents(path: Path) -> list[bytes]:
    """The documents of one corpus file as the evaluation reads them: the whole file, one document;
    for a .jsonl/.ndjson(.gz) file, each record's JSONL_FIELD string, read as `python -m
    data.prepare` reads it (records without one left out). Raises ValueError naming the file when
    none of its records holds a document."""
    if not is_jsonl(path):
        return [path.read_bytes()]
    if path.stat().st_size == 0:
        return []
    from collections import Counter

    from data.prepare_inputs import iter_chunks, list_sources, read_records

    docs, skipped = [], Counter()
    for chunk in iter_chunks(list_sources([str(path)], None, JSONL_FIELD), JSONL_FIELD):
        records = read_records(chunk, JSONL_FIELD, JSONL_FIELD)
        docs += [text.encode() for text in records.texts]
        skipped.update(records.skipped)
    if not docs and skipped:
        reasons = ", ".join(f"{n:,} {reason}" for reason, n in skipped.most_common())
        raise ValueError(f"{path}: no documents ({reasons}); each record's {JSONL_FIELD!r} string is read")
    return docs
