"""Turn a corpus into a megatron indexed dataset the trainer reads (`data.blend`).

    python -m data.prepare INPUT... --tokenizer DIR|byte --output-prefix PREFIX [--workers N]
        [--field text] [--column text] [--glob PATTERN] [--add-bos] [--eod-token TOKEN]
        [--shard-size SIZE] [--strict] [--overwrite]
    python -m data.prepare --describe PREFIX --tokenizer DIR|byte [--overwrite]

INPUTs (data/prepare_inputs.py): directories of text files, .jsonl/.json (.gz), .parquet, Hugging
Face `datasets` directories, in any mix. Output: PREFIX.bin and PREFIX.idx (one document per
record: [BOS] ids EOD, in input order, in the smallest dtype that holds the vocabulary, as
megatron's DType.optimal_dtype chooses) and PREFIX.json (data/prepared.py), written last.

How it runs: the main process cuts the inputs into chunks of about 1 MB and hands them to worker
processes, up to about 8 MB of input per worker in flight; each worker reads its chunk, tokenizes
it (one thread each) and returns the ids; the main process writes the results in chunk order, so
the bytes do not depend on the number of workers, and memory stays bounded whatever the input
size (the index keeps 12 bytes per document until it is written). Everything is written in a
temporary directory beside PREFIX and moved into place at the end; an interrupted or failed run
removes it. `--describe` writes PREFIX.json for a .bin/.idx made elsewhere (Megatron-LM's
preprocess_data.py), after checking the index and that every id fits the tokenizer.

Exit status: 0 done; 2 bad input (one line `error: ...` naming the file and the cause, nothing
written); 1 any other failure; 128 + the signal number when interrupted.
"""

from __future__ import annotations

import argparse
import array
import functools
import os
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter, deque
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .prepare_inputs import EMPTY, NO_FIELD, NOT_UTF8, Chunk, InputError, iter_chunks, list_sources, read_records

_PLAIN_PROGRESS_SECONDS = 30.0
# chunks in flight per worker: bytes of input and a count (memory: results wait in input order)
_AHEAD_BYTES, _AHEAD_CHUNKS = 8 << 20, 16
_EXAMPLES = 5  # bad records named in the summary


class Interrupted(BaseException):
    """A termination signal arrived (SIGTERM, SIGHUP); SIGINT arrives as KeyboardInterrupt."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    _refuse_unknown_options(parser, sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    try:
        with _signals_raise():
            if args.describe:
                return describe(args)
            return prepare(args, started)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted (SIGINT): nothing written", file=sys.stderr)
        return 128 + signal.SIGINT
    except Interrupted as e:
        print(f"interrupted ({e}): nothing written", file=sys.stderr)
        return 128 + e.signum
    except BrokenProcessPool:
        print("error: a worker process died (killed by the system: out of memory?); nothing written", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m data.prepare", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="*", metavar="INPUT",
                   help="text directory, .jsonl/.json(.gz), .parquet, .arrow, .txt, or a datasets directory")
    p.add_argument("--tokenizer", required=True, metavar="DIR|byte",
                   help="a local Hugging Face tokenizer directory, or `byte`")
    p.add_argument("--output-prefix", metavar="PREFIX", help="write PREFIX.bin, PREFIX.idx and PREFIX.json")
    p.add_argument("--workers", type=int, metavar="N", default=_cores(), help="worker processes (default: all cores)")
    p.add_argument("--field", default="text", metavar="NAME",
                   help="the JSON field that holds a document (default: text)")
    p.add_argument("--column", default="text", metavar="NAME",
                   help="the parquet/arrow column that holds a document (default: text)")
    p.add_argument("--glob", metavar="PATTERN",
                   help="the files of a text directory (default: every file, hidden ones left out)")
    p.add_argument("--add-bos", action="store_true", help="start every document with the tokenizer's BOS id")
    p.add_argument("--eod-token", metavar="TOKEN", help="the token that ends a document (default: the tokenizer's EOS)")
    p.add_argument("--shard-size", type=_size, metavar="SIZE",
                   help="write shards of about SIZE bytes of tokens (e.g. 500M, 20G), merged at the end")
    p.add_argument("--strict", action="store_true", help="stop at the first bad record instead of skipping it")
    p.add_argument("--overwrite", action="store_true", help="replace an existing PREFIX (at the end of the run)")
    p.add_argument("--describe", metavar="PREFIX", help="write PREFIX.json for a .bin/.idx made elsewhere")
    return p


def _refuse_unknown_options(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """A misspelled option is named, with the closest known one, before argparse reports the
    required option it then lacks (`--tokenizr DIR`: "the following arguments are required: --tokenizer")."""
    import difflib

    known = [o for action in parser._actions for o in action.option_strings if o.startswith("--")]
    for arg in argv:
        if arg == "--":
            return
        name = arg.split("=", 1)[0]
        # argparse takes an unambiguous prefix of an option too
        if name.startswith("--") and not any(o.startswith(name) for o in known):
            close = difflib.get_close_matches(name, known, n=1)
            parser.error(f"unrecognized option {name}" + (f" (did you mean {close[0]}?)" if close else ""))


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _size(text: str) -> int:
    units = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    t = text.strip().upper().removesuffix("B")
    number, unit = (t[:-1], t[-1]) if t and t[-1] in units else (t, "")
    try:
        value = int(float(number) * units[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 500M, 20G)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be more than 0 bytes")
    return value


def prepare(args, started: float) -> int:
    if not args.inputs or not args.output_prefix:
        raise InputError("give INPUT... and --output-prefix PREFIX (or --describe PREFIX)")
    if args.workers < 1:
        raise InputError(f"--workers {args.workers}: must be at least 1")
    prefix = _prefix("--output-prefix", args.output_prefix)
    _check_free(prefix, args.overwrite, (".bin", ".idx", ".json"))
    sources = list_sources(args.inputs, args.glob, args.column)
    tokenizer = _tokenizer(args.tokenizer, args.eod_token)
    if args.add_bos and tokenizer.bos is None:
        raise InputError(f"--add-bos: the tokenizer {args.tokenizer} has no BOS token")
    from megatron.core.datasets.indexed_dataset import DType

    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    created = _make_parent(prefix)
    output = _Output(prefix, dtype, args.shard_size, created)
    stats = _Stats(len(sources))
    progress = pool = None
    try:
        output.start()
        pool = _pool(args, dtype)
        for chunk, result in _in_order(pool, iter_chunks(sources, args.column), args.workers):
            # after the workers have started: tqdm's thread is not forked
            progress = progress or _Progress(sum(s.nbytes for s in sources))
            stats.add(chunk, result, args.strict)
            output.add(result.tokens, result.lengths)
            progress.update(chunk.nbytes, len(result.lengths))
            stats.check_done(sources, chunk.source, args.field)
        stats.check_done(sources, len(sources), args.field)
        if progress:
            progress.close()
        record = {
            "made_by": "data.prepare", "source": [str(s.path) for s in sources],
            "tokenizer": {**tokenizer.identity, "path": _tokenizer_path(args.tokenizer)},
            "add_bos": bool(args.add_bos), "documents": stats.documents, "tokens": stats.tokens,
            "skipped": dict(sorted(stats.skipped.items())), "dtype": np.dtype(dtype).name,
            "input_bytes": stats.input_bytes,
            "read": {"field": args.field, "column": args.column, "glob": args.glob},
        }
        written = output.commit(record)
    except BaseException:
        # the files first, not interrupted by another signal; waiting for the workers comes after
        with _signals_ignored():
            _quietly(output.discard)
        if progress:
            _quietly(progress.close)
        raise
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    seconds = time.perf_counter() - started
    if stats.skipped:
        print(stats.skipped_line(args.field), flush=True)
    mb = stats.input_bytes / 1e6
    # small inputs in kB: "0.0 MB of input" reads as nothing read
    size = f"{mb:,.1f} MB" if mb >= 0.1 else f"{stats.input_bytes / 1e3:,.1f} kB"
    print(f"prepared {prefix}: {stats.documents:,} documents, {stats.tokens:,} tokens "
          f"({stats.tokens / stats.documents:,.1f} tokens/document), {size} of input in {seconds:,.1f} s "
          f"({mb / seconds:,.2f} MB/s); wrote {', '.join(str(p) for p in written)}", flush=True)
    return 0


def _prefix(option: str, text: str) -> Path:
    """PREFIX as an absolute path. One that ends in a separator names a directory: Path would drop
    the separator and write DIR.bin beside the directory instead of a dataset in it."""
    if text.endswith(("/", os.sep)):
        raise InputError(f"{option} {text} names a directory; give a prefix in it, e.g. {text}web "
                         f"({text}web.bin, .idx and .json)")
    return Path(text).expanduser().absolute()


def _check_free(prefix: Path, overwrite: bool, extensions) -> None:
    for ext in extensions:
        path = Path(f"{prefix}{ext}")
        if path.exists() and not overwrite:
            raise InputError(f"{path} exists; --overwrite replaces it (when the new one is complete)")


def _make_parent(prefix: Path) -> list[Path]:
    """Create PREFIX's directory where missing and check that it can be written; returns the
    directories created (removed again if the run fails). One that another process (a prepare
    of another prefix beside this one) creates meanwhile is used, and not this run's to remove."""
    missing, parent, created = [], prefix.parent, []
    while not parent.exists():
        missing.append(parent)
        parent = parent.parent
    try:
        for d in reversed(missing):
            try:
                d.mkdir()
                created.insert(0, d)
            except FileExistsError:
                if not d.is_dir():
                    raise
        probe = tempfile.NamedTemporaryFile(dir=prefix.parent, prefix=f".{prefix.name}.probe-")
        probe.close()
    except OSError as e:
        for d in created:
            _quietly(d.rmdir)
        raise InputError(f"--output-prefix {prefix}: cannot write in {prefix.parent} "
                         f"({e.strerror or type(e).__name__})") from e
    return created


def _tokenizer(spec: str, eod_token: str | None):
    from .tokenizer import TokenizerError, build_tokenizer

    try:
        return build_tokenizer(spec, eod_token)
    except TokenizerError as e:
        # the tokenizer module speaks of the trainer's config keys; here they are options
        message = str(e).replace("data.tokenizer:", "--tokenizer").replace("data.eod_token", "--eod-token")
        raise InputError(message) from e


def _tokenizer_path(spec: str) -> str:
    from .tokenizer import BYTE

    return spec if spec == BYTE else str(Path(spec).expanduser().resolve())


# workers ---------------------------------------------------------------------------------------

@dataclass
class Result:
    """A chunk's documents as one array of ids ([BOS] ids EOD per document) and their lengths."""

    tokens: np.ndarray  # [sum(lengths)] dtype of the dataset
    lengths: np.ndarray  # [documents] int32
    count: int  # records read (for file:line of the chunks after)
    skipped: Counter
    bad: list[tuple[int, str]]  # (record index in the chunk, reason), the first few


_worker: dict = {}


def _init_worker(spec: str, eod_token: str | None, field: str, column: str, add_bos: bool, dtype) -> None:
    # Ctrl-C on a terminal reaches the whole process group: the main process handles it; a
    # termination signal ends a worker at once (it writes nothing), not the main process's way
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for s in _signals_raise.SIGNALS:
        signal.signal(s, signal.SIG_DFL)
    # one thread per worker: the workers are the parallelism
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from .tokenizer import build_tokenizer

    _worker.update(tokenizer=build_tokenizer(spec, eod_token), field=field, column=column, add_bos=add_bos,
                   dtype=dtype)


def _work(chunk: Chunk) -> Result:
    w = _worker
    tokenizer, dtype = w["tokenizer"], w["dtype"]
    records = read_records(chunk, w["field"], w["column"])
    ids = _encode(tokenizer, records)
    eod = np.array([tokenizer.eod], dtype=dtype)
    frame = (np.array([tokenizer.bos], dtype=dtype),) if w["add_bos"] else ()
    pieces = [p for x in ids for p in (*frame, x, eod)]
    tokens = np.concatenate(pieces, dtype=dtype, casting="unsafe") if pieces else np.empty(0, dtype=dtype)
    lengths = np.fromiter((len(x) + len(frame) + 1 for x in ids), dtype=np.int32, count=len(ids))
    return Result(tokens, lengths, records.count, records.skipped, records.first_bad())


def _encode(tokenizer, records) -> list[np.ndarray]:
    """Ids of the texts of `records` (all at once). A text the tokenizer cannot take because it is
    not UTF-8 (a lone surrogate from a JSON escape) is skipped, and so is a text without ids."""
    try:
        ids = tokenizer.tokenize_batch(records.texts)
    except Exception:
        ids = [_encode_one(tokenizer, text) for text in records.texts]
    kept = []
    for x, index in zip(ids, records.indices):
        if x is None:
            records.skip(index, NOT_UTF8)
        elif len(x) == 0:
            records.skip(index, EMPTY)
        else:
            kept.append(x)
    return kept


def _encode_one(tokenizer, text: str) -> np.ndarray | None:
    try:
        return tokenizer.tokenize(text)
    except Exception:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return None
        raise


def _pool(args, dtype):
    from concurrent.futures import ProcessPoolExecutor
    import multiprocessing as mp

    # fork: workers start at once with the tokenizer the main process has loaded
    context = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else None)
    return ProcessPoolExecutor(args.workers, mp_context=context, initializer=_init_worker,
                               initargs=(args.tokenizer, args.eod_token, args.field, args.column, args.add_bos, dtype))


def _in_order(pool, chunks, workers: int):
    """(chunk, result) in chunk order. Chunks are submitted ahead of the oldest one not yet taken
    so that a long chunk (one large document) does not leave the other workers idle: up to
    _AHEAD_BYTES of input per worker (and _AHEAD_CHUNKS chunks), at least two chunks per worker."""
    pending, ahead = deque(), 0
    for chunk in chunks:
        pending.append((chunk, pool.submit(_work, chunk)))
        ahead += chunk.nbytes
        while len(pending) >= 2 * workers and (ahead >= _AHEAD_BYTES * workers
                                               or len(pending) >= _AHEAD_CHUNKS * workers):
            chunk, future = pending.popleft()
            ahead -= chunk.nbytes
            yield chunk, future.result()
    while pending:
        chunk, future = pending.popleft()
        yield chunk, future.result()


# bookkeeping and display -----------------------------------------------------------------------

class _Stats:
    """Counts, the skipped records and where the first ones are, in dataset order."""

    def __init__(self, sources: int):
        self.documents = self.tokens = self.input_bytes = 0
        self.skipped: Counter = Counter()
        self.examples: list[tuple[str, str]] = []
        self.per_source = [0] * sources  # documents
        self.skipped_per_source = [Counter() for _ in range(sources)]
        self._file, self._records_before = None, 0  # records of the current file in its chunks so far
        self._checked = 0

    def add(self, chunk: Chunk, result: Result, strict: bool) -> None:
        # chunks come file after file, in order
        before = self._records_before if (chunk.source, chunk.path) == self._file else 0
        for index, reason in result.bad:
            if strict:
                raise InputError(f"{chunk.location(index, before)}: {reason} (--strict stops at the first bad record)")
            if len(self.examples) < _EXAMPLES:
                self.examples.append((chunk.location(index, before), reason))
        self._file, self._records_before = (chunk.source, chunk.path), before + result.count
        self.skipped.update(result.skipped)
        self.documents += len(result.lengths)
        self.tokens += len(result.tokens)
        self.input_bytes += chunk.nbytes
        self.per_source[chunk.source] += len(result.lengths)
        self.skipped_per_source[chunk.source].update(result.skipped)

    def check_done(self, sources, upto: int, field: str) -> None:
        """Refuse a source (before `upto`, all read) that gave no document."""
        for i in range(self._checked, upto):
            if self.per_source[i] == 0:
                skipped = self.skipped_per_source[i]
                why = f" ({_reasons(skipped)} skipped{_field_hint(skipped, field)})" if skipped else ""
                raise InputError(f"{sources[i].given}: no documents{why}")
        self._checked = max(self._checked, upto)

    def skipped_line(self, field: str) -> str:
        first = "; ".join(f"{where}: {reason}" for where, reason in self.examples)
        return (f"skipped {sum(self.skipped.values()):,} records: {_reasons(self.skipped)}"
                f"{_field_hint(self.skipped, field)}" + (f"; first: {first}" if first else ""))


def _reasons(skipped: Counter) -> str:
    return ", ".join(f"{n:,} {reason}" for reason, n in sorted(skipped.items(), key=lambda kv: -kv[1]))


def _field_hint(skipped: Counter, field: str) -> str:
    return f"; --field is {field!r}" if NO_FIELD in skipped else ""


class _Progress:
    """Input bytes done, documents/s, MB/s and ETA: a tqdm bar on a terminal, else a line every
    30 s."""

    def __init__(self, total: int, stream=None):
        self.stream = stream or sys.stderr
        self.total, self.done, self.documents = total, 0, 0
        self.start = self.last = time.perf_counter()
        self.bar = None
        if self.stream.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="B", unit_scale=True, desc="prepare", file=self.stream,
                            dynamic_ncols=True, smoothing=0.1)

    def update(self, nbytes: int, documents: int) -> None:
        self.done += nbytes
        self.documents += documents
        now = time.perf_counter()
        rate = self.documents / max(now - self.start, 1e-9)
        if self.bar is not None:
            self.bar.set_postfix_str(f"{rate:,.0f} docs/s", refresh=False)
            self.bar.update(nbytes)
        elif now - self.last >= _PLAIN_PROGRESS_SECONDS:
            self.last = now
            mbps = self.done / 1e6 / (now - self.start)
            eta = (self.total - self.done) / 1e6 / mbps if mbps > 0 else float("inf")
            print(f"prepare: {self.done / 1e6:,.1f} of {self.total / 1e6:,.1f} MB "
                  f"({100 * self.done / max(self.total, 1):.1f}%), {self.documents:,} documents ({rate:,.0f}/s), "
                  f"{mbps:,.2f} MB/s, ETA {_clock(eta)}", file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _clock(seconds: float) -> str:
    if seconds == float("inf"):
        return "?"
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


# output ----------------------------------------------------------------------------------------

def _builder(bin_path: Path, dtype):
    return _builder_class()(str(bin_path), dtype=dtype)


@functools.cache
def _builder_class():
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    class Builder(IndexedDatasetBuilder):
        """megatron's builder, keeping its index in arrays (12 bytes a document rather than
        Python lists of ints) and taking a chunk's documents in one write."""

        def __init__(self, bin_path: str, dtype):
            super().__init__(bin_path, dtype=dtype)
            self.sequence_lengths = array.array("i")
            self.document_indices = array.array("q", [0])
            self.nbytes = 0

        def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
            """One sequence and one document per length (what add_document does per document)."""
            self.data_file.write(tokens.tobytes())
            first = len(self.sequence_lengths) + 1
            self.sequence_lengths.extend(lengths.tolist())
            self.document_indices.extend(range(first, first + len(lengths)))
            self.nbytes += tokens.nbytes

    return Builder


class _Output:
    """PREFIX's files, written in a temporary directory beside them (shards, when asked, merged
    with the builder's add_index) and moved into place by commit(); discard() removes every trace."""

    def __init__(self, prefix: Path, dtype, shard_bytes: int | None, created_dirs: list[Path]):
        self.prefix, self.dtype, self.shard_bytes = prefix, dtype, shard_bytes
        self.created_dirs = created_dirs
        self.tmp: Path | None = None
        self.shards: list[Path] = []
        self.builder = None
        self.placed: list[Path] = []

    def start(self) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.prefix.name}.prepare-", dir=self.prefix.parent))

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        if not len(lengths):
            return
        if self.builder is None:
            if self.shard_bytes:
                (self.tmp / "shards").mkdir(exist_ok=True)
                self.shards.append(self.tmp / "shards" / f"{len(self.shards):05d}")
            self.builder = _builder(Path(f"{self._current()}.bin"), self.dtype)
        self.builder.add_documents(tokens, lengths)
        if self.shard_bytes and self.builder.nbytes >= self.shard_bytes:
            self._finish_builder()

    def _current(self) -> Path:
        return self.shards[-1] if self.shard_bytes else self.tmp / "data"

    def _finish_builder(self) -> None:
        self.builder.finalize(f"{self._current()}.idx")
        self.builder = None

    def commit(self, record: dict) -> list[Path]:
        from .prepared import metadata_path, write_metadata

        if self.builder is not None:
            self._finish_builder()
        data = self.tmp / "data"
        if self.shard_bytes:
            merged = _builder(Path(f"{data}.bin"), self.dtype)
            for shard in self.shards:
                merged.add_index(str(shard))
                for ext in (".bin", ".idx"):
                    Path(f"{shard}{ext}").unlink()  # as it goes: the disk holds one copy and a shard
            merged.finalize(f"{data}.idx")
        # a replaced dataset loses its description first: never a .json beside files it does not describe
        metadata_path(self.prefix).unlink(missing_ok=True)
        for ext in (".bin", ".idx"):
            target = Path(f"{self.prefix}{ext}")
            self.placed.append(target)
            os.replace(f"{data}{ext}", target)
        self.placed.append(metadata_path(self.prefix))
        write_metadata(self.prefix, record)
        shutil.rmtree(self.tmp)
        return self.placed

    def discard(self) -> None:
        if self.builder is not None:
            _quietly(self.builder.data_file.close)
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
        for path in self.placed:
            path.unlink(missing_ok=True)
        for d in self.created_dirs:
            _quietly(d.rmdir)


def _quietly(fn) -> None:
    try:
        fn()
    except (OSError, ValueError):
        pass


class _signals_raise:
    """SIGTERM and SIGHUP raise Interrupted in the main thread (SIGINT raises KeyboardInterrupt),
    so that the run unwinds and removes what it wrote; restored on exit."""

    SIGNALS = tuple(s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGHUP", None)) if s)

    def __init__(self, handler=None):
        self.handler = handler

    def __enter__(self):
        self.saved = {s: signal.signal(s, self.handler or self._raise) for s in self.SIGNALS}
        return self

    @staticmethod
    def _raise(signum, frame):
        raise Interrupted(signum)

    def __exit__(self, *exc):
        for s, handler in self.saved.items():
            signal.signal(s, handler)


class _signals_ignored(_signals_raise):
    """No signal interrupts what runs inside (SIGINT included)."""

    SIGNALS = (signal.SIGINT, *_signals_raise.SIGNALS)

    def __init__(self):
        super().__init__(signal.SIG_IGN)


# --describe ------------------------------------------------------------------------------------

def describe(args) -> int:
    """PREFIX.json for a .bin/.idx made elsewhere: documents and tokens from the index, every id
    checked against the tokenizer's vocabulary, BOS/EOD framing reported."""
    if args.inputs or args.output_prefix:
        raise InputError("--describe PREFIX takes no INPUT or --output-prefix")
    prefix = _prefix("--describe", args.describe)
    from .prepared import index_problem, write_metadata

    found = index_problem(prefix)
    if found is not None:
        raise InputError(found)
    _check_free(prefix, args.overwrite, (".json",))
    tokenizer = _tokenizer(args.tokenizer, args.eod_token)
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    index = IndexedDataset(str(prefix), mmap=True).index
    lengths = np.asarray(index.sequence_lengths, dtype=np.int64)
    starts = np.asarray(index.sequence_pointers, dtype=np.int64) // index.dtype_size
    tokens = np.memmap(f"{prefix}.bin", dtype=index.dtype, mode="r")
    largest = max((int(tokens[i:i + (1 << 26)].max()) for i in range(0, len(tokens), 1 << 26)), default=-1)
    if largest >= tokenizer.vocab_size:
        raise InputError(f"{prefix}.bin holds token id {largest:,} but the tokenizer {args.tokenizer} has "
                         f"{tokenizer.vocab_size:,} ids: the dataset was made with another tokenizer")
    full = lengths > 0
    without_eod = int((tokens[(starts + lengths - 1)[full]] != tokenizer.eod).sum()) + int((~full).sum())
    add_bos = bool(full.any()) and tokenizer.bos is not None and bool((tokens[starts[full]] == tokenizer.bos).all())
    documents = len(index.document_indices) - 1
    record = {
        "made_by": "data.prepare --describe", "source": [str(prefix)],
        "tokenizer": {**tokenizer.identity, "path": _tokenizer_path(args.tokenizer)},
        "add_bos": add_bos, "documents": documents, "tokens": int(lengths.sum()), "skipped": {},
        "dtype": np.dtype(index.dtype).name, "sequences": len(lengths),
        "sequences_without_eod": without_eod,
    }
    del tokens, index
    path = write_metadata(prefix, record)
    if without_eod:
        print(f"warning: {without_eod:,} of {len(lengths):,} sequences of {prefix}.bin do not end with the "
              f"end-of-document id {tokenizer.eod} (made without --append-eod?): the trainer will read documents "
              "run together", file=sys.stderr)
    print(f"described {prefix}: {documents:,} documents, {record['tokens']:,} tokens; wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
