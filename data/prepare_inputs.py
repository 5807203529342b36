"""The inputs of `python -m data.prepare`: what each INPUT is, the chunks it is cut into, and the
records of a chunk.

Kinds, by what the path is:
    text     a directory of text files (--glob, default every file; hidden ones left out), one
             document per file, in the order of their sorted relative paths; or one .txt file
    jsonl    .jsonl / .ndjson / .json (one JSON object per line, as Megatron-LM's loose JSON),
             optionally .gz: the document is the string in --field
    parquet  .parquet: the document is the string in --column, read one row group at a time
    arrow    a Hugging Face `datasets` directory written by save_to_disk (data-*.arrow, Arrow IPC
             streams, listed by state.json), or one .arrow file: the string in --column

A chunk is about CHUNK_BYTES of input and says where its records are (files, a byte range of a
file, a row group, a range of record batches), so that a worker process reads it on its own; only
gzip streams, which cannot be entered in the middle, are decompressed by the main process and sent
as bytes. Chunks come in input order and records in file order: the order of the dataset. Nothing
here depends on the number of workers.
"""

from __future__ import annotations

import gzip
import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

CHUNK_BYTES = 1 << 20
_JSONL = (".jsonl", ".ndjson", ".json")
_GZ_JSONL = tuple(f"{s}.gz" for s in _JSONL)
_TEXT = (".txt",)
# files that hold records: a directory of text files holding one of these is a mistake
_RECORD_FILES = _JSONL[:2] + _GZ_JSONL + (".parquet", ".arrow")
_STRING_TYPES = ("string", "large_string", "string_view")
# reasons a record is skipped, as the summary and PREFIX.json name them
NOT_JSON, NOT_UTF8, NO_FIELD, NOT_STRING, EMPTY = "not JSON", "not valid UTF-8", "no field", "not a string", "empty"


class InputError(ValueError):
    """An input that cannot be read; the message names the file and the cause."""


@dataclass(frozen=True)
class Source:
    """One INPUT as given on the command line."""

    given: str
    path: Path  # resolved
    kind: str  # text, jsonl, parquet, arrow
    files: tuple[Path, ...]
    nbytes: int  # on disk: what the progress display counts


@dataclass(frozen=True)
class Chunk:
    """Where a worker finds the records of one chunk. `records_at` locates record i of the chunk
    for messages once the records before it in its file are known."""

    source: int  # index into the list of Sources
    kind: str
    path: str  # the file (text: the first file)
    nbytes: int  # input bytes this chunk accounts for (progress)
    files: tuple[str, ...] = ()  # text: one document per file
    start: int = 0  # jsonl: byte range; parquet: row group; arrow: first record batch
    stop: int = 0
    payload: bytes | None = None  # gzip: the decompressed lines

    def location(self, index: int, before: int) -> str:
        """Record `index` of this chunk as file:line (jsonl), file:row N (parquet/arrow) or the
        file (text); `before` is the number of records of the same file in earlier chunks."""
        if self.kind == "text":
            return self.files[index]
        if self.kind == "jsonl":
            return f"{self.path}:{before + index + 1}"
        return f"{self.path}:row {before + index}"


@dataclass
class Records:
    """The documents of a chunk and the records skipped on the way."""

    texts: list[str] = field(default_factory=list)
    indices: list[int] = field(default_factory=list)  # record index of each text, within the chunk
    count: int = 0  # records (lines, rows, files) read, for the file:line of later chunks
    skipped: Counter = field(default_factory=Counter)
    bad: list[tuple[int, str]] = field(default_factory=list)  # (record index, reason), the first few

    KEEP = 8

    def skip(self, index: int, reason: str) -> None:
        self.skipped[reason] += 1
        # empty documents are counted; the summary names only records that are wrong
        if reason != EMPTY:
            self.bad.append((index, reason))
            if len(self.bad) > 2 * self.KEEP:
                self.first_bad()

    def first_bad(self) -> list[tuple[int, str]]:
        """The first few bad records in record order (the tokenizer finds some after the reader)."""
        self.bad.sort()
        del self.bad[self.KEEP:]
        return self.bad

    def add(self, index: int, text: str) -> None:
        if text:
            self.texts.append(text)
            self.indices.append(index)
        else:
            self.skip(index, EMPTY)


def list_sources(inputs: list[str], glob: str | None, column: str) -> list[Source]:
    """Each INPUT's kind and files. Raises InputError naming the first input that cannot be read."""
    return [_source(given, glob, column) for given in inputs]


def _source(given: str, glob: str | None, column: str) -> Source:
    path = Path(given).expanduser().resolve()
    if not path.exists():
        raise InputError(f"{given}: no such file or directory")
    if path.is_dir():
        if (path / "dataset_dict.json").is_file():
            splits = sorted(p.name for p in path.iterdir() if p.is_dir())
            hint = f"give one split's directory, e.g. {Path(given) / splits[0]}" if splits else "it holds no split"
            raise InputError(f"{given}: a Hugging Face DatasetDict (splits: {', '.join(splits) or 'none'}); {hint}")
        if (path / "state.json").is_file() or (path / "dataset_info.json").is_file():
            files = _arrow_files(path, given)
            kind = "arrow"
        else:
            files = _text_files(path, given, glob or "**/*")
            kind = "text"
    else:
        name = path.name.lower()
        if name.endswith(_JSONL + _GZ_JSONL):
            kind = "jsonl"
        elif name.endswith(".parquet"):
            kind = "parquet"
        elif name.endswith(".arrow"):
            kind = "arrow"
        elif name.endswith(_TEXT):
            kind = "text"
        else:
            raise InputError(f"{given}: unknown kind of input (expected a directory of text files, a Hugging Face "
                             "datasets directory, .jsonl[.gz], .json[.gz], .parquet, .arrow or .txt)")
        files = (path,)
    if kind in ("parquet", "arrow"):
        for f in files:
            _check_column(f, kind, column)
    nbytes = sum(f.stat().st_size for f in files)
    if nbytes == 0:
        raise InputError(f"{given}: empty (no documents)")
    return Source(given, path, kind, files, nbytes)


def _text_files(root: Path, given: str, glob: str) -> tuple[Path, ...]:
    files = sorted((p for p in root.glob(glob)
                    if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)),
                   key=lambda p: p.relative_to(root).as_posix())
    if not files:
        raise InputError(f"{given}: no files match --glob {glob!r} (no documents)")
    records = [p for p in files if p.name.lower().endswith(_RECORD_FILES)]
    if records:
        raise InputError(f"{given}: a directory is read as text files, one document each, but it holds "
                         f"{records[0].relative_to(root)}: give record files themselves "
                         f"(e.g. {Path(given) / '*.jsonl'}), or --glob to pick the text files")
    return tuple(files)


def _arrow_files(root: Path, given: str) -> tuple[Path, ...]:
    state = root / "state.json"
    if state.is_file():
        try:
            record = json.loads(state.read_text())
            names = [entry["filename"] for entry in record["_data_files"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise InputError(f"{state}: not a Hugging Face datasets state file ({type(e).__name__}: {e})") from e
        if record.get("_indices_data_files"):
            raise InputError(f"{given}: saved with an indices mapping (a select or shuffle): save it again after "
                             "flatten_indices()")
        bad = [n for n in names if Path(n).name != n]
        if bad:
            raise InputError(f"{state}: {bad[0]!r} is not a file name of the directory")
        files = tuple(root / n for n in names)
        missing = [f for f in files if not f.is_file()]
        if missing:
            raise InputError(f"{missing[0]}: listed in {state} but missing")
    else:
        files = tuple(sorted(root.glob("data-*.arrow")))
    if not files:
        raise InputError(f"{given}: a Hugging Face datasets directory without data-*.arrow files (no documents)")
    return files


def _check_column(path: Path, kind: str, column: str) -> None:
    import pyarrow as pa

    try:
        if kind == "parquet":
            import pyarrow.parquet as pq

            schema = pq.ParquetFile(path).schema_arrow
        else:
            with _open_arrow(path) as reader:
                schema = reader.schema
    except (OSError, pa.ArrowException) as e:
        raise InputError(f"{path}: not a readable {kind} file ({_first_line(e)})") from e
    if column not in schema.names:
        raise InputError(f"{path}: no column {column!r} (columns: {', '.join(schema.names)}); choose one with --column")
    kind_of = str(schema.field(column).type)
    if kind_of not in _STRING_TYPES:
        raise InputError(f"{path}: column {column!r} holds {kind_of}, not strings; choose another with --column")


class _ArrowReader:
    """An Arrow IPC file or stream, memory-mapped: record batches by number (stream batches are
    found by reading through the ones before, which costs only their headers)."""

    def __init__(self, path: Path):
        import pyarrow as pa

        self._source = pa.memory_map(str(path))
        try:
            self._file = pa.ipc.open_file(self._source)
            self._stream = None
        except pa.ArrowInvalid:
            self._file = None
            self._source.seek(0)
            self._stream = pa.ipc.open_stream(self._source)
        self.schema = (self._file or self._stream).schema

    def batches(self, start: int = 0, stop: int | None = None):
        if self._file is not None:
            for i in range(start, self._file.num_record_batches if stop is None else stop):
                yield self._file.get_batch(i)
            return
        for i, batch in enumerate(self._stream):
            if stop is not None and i >= stop:
                return
            if i >= start:
                yield batch

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._source.close()


def _open_arrow(path: Path) -> _ArrowReader:
    return _ArrowReader(path)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def iter_chunks(sources: list[Source], column: str, chunk_bytes: int | None = None) -> Iterator[Chunk]:
    """The chunks of every source, in order, of about `chunk_bytes` (default CHUNK_BYTES)."""
    chunk_bytes = chunk_bytes or CHUNK_BYTES
    for i, source in enumerate(sources):
        if source.kind == "text":
            yield from _text_chunks(i, source, chunk_bytes)
        for path in source.files if source.kind != "text" else ():
            if source.kind == "jsonl":
                gz = path.name.lower().endswith(".gz")
                yield from (_gzip_chunks if gz else _jsonl_chunks)(i, path, chunk_bytes)
            elif source.kind == "parquet":
                yield from _parquet_chunks(i, path, column)
            else:
                yield from _arrow_chunks(i, path, column, chunk_bytes)


def _text_chunks(i: int, source: Source, chunk_bytes: int) -> Iterator[Chunk]:
    group, size = [], 0
    for path in source.files:
        group.append(str(path))
        size += path.stat().st_size
        if size >= chunk_bytes or len(group) >= 4096:
            yield Chunk(i, "text", group[0], size, files=tuple(group))
            group, size = [], 0
    if group:
        yield Chunk(i, "text", group[0], size, files=tuple(group))


def _jsonl_chunks(i: int, path: Path, chunk_bytes: int) -> Iterator[Chunk]:
    size = path.stat().st_size
    start = 0
    with open(path, "rb") as f:
        while start < size:
            f.seek(min(start + chunk_bytes, size))
            f.readline()  # to the end of the line the cut falls in
            stop = min(f.tell(), size)
            yield Chunk(i, "jsonl", str(path), stop - start, start=start, stop=stop)
            start = stop


def _gzip_chunks(i: int, path: Path, chunk_bytes: int) -> Iterator[Chunk]:
    with open(path, "rb") as raw, gzip.GzipFile(fileobj=raw) as gz:
        rest, counted = b"", 0
        while True:
            try:
                block = gz.read(chunk_bytes)
            except (OSError, EOFError, gzip.BadGzipFile) as e:
                raise InputError(f"{path}: not a readable gzip file ({_first_line(e)})") from e
            if not block:
                break
            data = rest + block
            cut = data.rfind(b"\n") + 1
            if cut == 0:  # one line longer than a chunk: keep reading it
                rest = data
                continue
            rest = data[cut:]
            # progress counts compressed bytes (those the input's size is made of)
            done = raw.tell()
            yield Chunk(i, "jsonl", str(path), done - counted, payload=data[:cut])
            counted = done
        size = path.stat().st_size
        if rest or counted < size:
            yield Chunk(i, "jsonl", str(path), size - counted, payload=rest)


def _parquet_chunks(i: int, path: Path, column: str) -> Iterator[Chunk]:
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(path).metadata
    weights = [sum(meta.row_group(g).column(c).total_compressed_size for c in range(meta.num_columns))
               for g in range(meta.num_row_groups)]
    for g, nbytes in enumerate(_shares(path.stat().st_size, weights)):
        yield Chunk(i, "parquet", str(path), nbytes, start=g, stop=g + 1)


def _arrow_chunks(i: int, path: Path, column: str, chunk_bytes: int) -> Iterator[Chunk]:
    with _open_arrow(path) as reader:
        sizes = [batch.column(column).nbytes for batch in reader.batches()]
    ranges, start, size = [], 0, 0
    for b, n in enumerate(sizes):
        size += n
        if size >= chunk_bytes or b == len(sizes) - 1:
            ranges.append((start, b + 1, size))
            start, size = b + 1, 0
    for (start, stop, _), nbytes in zip(ranges, _shares(path.stat().st_size, [r[2] for r in ranges])):
        yield Chunk(i, "arrow", str(path), nbytes, start=start, stop=stop)


def _shares(total: int, weights: list[int]) -> list[int]:
    """`total` split in proportion to `weights`, as integers that sum to `total`."""
    whole, acc, edges = sum(weights) or 1, 0, [0]
    for w in weights:
        acc += w
        edges.append(total * acc // whole)
    edges[-1] = total
    return [b - a for a, b in zip(edges, edges[1:])]


def read_records(chunk: Chunk, field_name: str, column: str) -> Records:
    """The documents of `chunk` (in order) and its skipped records. Runs in a worker process."""
    out = Records()
    if chunk.kind == "text":
        for k, name in enumerate(chunk.files):
            with open(name, "rb") as f:
                data = f.read()
            try:
                out.add(k, data.decode("utf-8"))
            except UnicodeDecodeError:
                out.skip(k, NOT_UTF8)
        out.count = len(chunk.files)
    elif chunk.kind == "jsonl":
        if chunk.payload is not None:
            data = chunk.payload
        else:
            with open(chunk.path, "rb") as f:
                f.seek(chunk.start)
                data = f.read(chunk.stop - chunk.start)
        lines = data.split(b"\n")
        if lines and not lines[-1]:
            lines.pop()  # the newline that ends the last line
        for k, line in enumerate(lines):
            _json_record(out, k, line, field_name)
        out.count = len(lines)
    else:
        import pyarrow as pa

        try:
            _table_records(out, chunk, column)
        except (OSError, pa.ArrowException) as e:
            raise InputError(f"{chunk.path}: cannot be read ({_first_line(e)})") from e
    return out


def _table_records(out: Records, chunk: Chunk, column: str) -> None:
    if chunk.kind == "parquet":
        import pyarrow.parquet as pq

        values = pq.ParquetFile(chunk.path).read_row_group(chunk.start, columns=[column]).column(0)
        _string_records(out, values.to_pylist())
    else:
        with _open_arrow(Path(chunk.path)) as reader:
            for batch in reader.batches(chunk.start, chunk.stop):
                _string_records(out, batch.column(column).to_pylist(), offset=out.count)


def _json_record(out: Records, k: int, line: bytes, field_name: str) -> None:
    if not line.strip():
        out.skip(k, EMPTY)
        return
    try:
        record = json.loads(line)
    except UnicodeDecodeError:
        out.skip(k, NOT_UTF8)
        return
    except ValueError:
        out.skip(k, NOT_JSON)
        return
    if not isinstance(record, dict) or field_name not in record:
        out.skip(k, NO_FIELD)
    elif not isinstance(record[field_name], str):
        out.skip(k, NOT_STRING)
    else:
        out.add(k, record[field_name])


def _string_records(out: Records, values: list, offset: int = 0) -> None:
    for k, value in enumerate(values, start=offset):
        if value is None:
            out.skip(k, NOT_STRING)
        else:
            out.add(k, value)
    out.count = offset + len(values)
