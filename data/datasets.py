"""Tokenize the corpus once into a cached megatron indexed dataset and sample it with GPTDataset.

Cache layout (under data.cache_dir, default $MSA_DATA_CACHE_DIR or .cache/data):
    <source>-<key>/tokens.bin, tokens.idx   int32 token ids, one document per file + EOD
    <source>-<key>/manifest.json            their sizes and hashes, recorded at build
    <source>-<key>/index/                   GPTDataset's document/sample/shuffle indices (+ manifest.json;
                                            with data.valid_blend, in index/<contents key>/)
    indices/<contents key>/                 the same for data.blend's prepared datasets, one directory
                                            per set of dataset contents (data.prepared.contents_key)
where <key> hashes the tokenizer name and every file's relative path and contents, so a change to
either builds a new dataset and a stale one is never read. The build writes a temporary
directory and renames it into place, so an interrupted build leaves nothing behind. Before use,
the files are checked against their manifests (data/cache_check.py: sizes and sampled hashes,
every byte with data.verify_cache=true); a damaged cache is rebuilt by rank 0 with a warning
naming it, and refused on other ranks. Rank 0 builds while holding the cache's lock, so that
jobs started together on one cache directory build it once (data/shared_build.py); the other
ranks wait for rank 0.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from msa_model.platform.compat import fresh_loss_masks

from .cache_check import DataCacheError, problem, record
from .corpus import file_documents, is_jsonl, list_corpus_files
from . import retrieval
from .retrieval import DEFAULT_TASKS, Haystack, training_documents
from .shared_build import BuildLock, build_megatron_datasets, discard, wait_for_rank_0

log = logging.getLogger(__name__)

# data.retrieval_share's documents, a dataset of their own beside the corpus's tokens.*
RETRIEVAL_FILES = ("retrieval.bin", "retrieval.idx")
# windows of them made at least: the blend's weights set their share, and every split of data.split
# down to 1% gets some (megatron never ends a split without documents)
MIN_RETRIEVAL_WINDOWS = 200


def _cache_key(tokenizer_name: str, root: Path, files: list[Path], extra: str = "") -> str:
    h = hashlib.sha256(tokenizer_name.encode() + extra.encode())
    for path in files:
        h.update(path.relative_to(root).as_posix().encode())
        h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()[:16]


def prepare_tokens(data_cfg, tokenizer=None, build: bool = True, seq_length: int | None = None) -> str:
    """Return the indexed-dataset path prefix of the corpus, building it if `build` and missing.

    With `data_cfg.retrieval_share` > 0 synthetic retrieval documents (data.retrieval) of the tasks
    `data_cfg.retrieval_tasks`, up to `seq_length` tokens, make that share of the tokens. Only one
    rank should build (the caller synchronises); others call with build=False after. A build holds
    the cache's BuildLock: a process of another job that needs the same cache waits for it and uses
    what it built.
    `tokenizer`: data.tokenizer's by default.
    """
    if tokenizer is None:
        from .tokenizer import BYTE, build_tokenizer

        tokenizer = build_tokenizer(data_cfg.tokenizer or BYTE, data_cfg.eod_token)
    root, files = list_corpus_files(data_cfg.source, data_cfg.glob, data_cfg.max_bytes)
    tag = "stdlib" if data_cfg.source == "stdlib" else Path(data_cfg.source).name
    share = getattr(data_cfg, "retrieval_share", 0.0)
    if share > 0 and not seq_length:
        raise ValueError("data.retrieval_share needs the sequence length of the documents")
    extra = _mixture_key(data_cfg, share, seq_length, bytes_are_tokens=tokenizer.name == "byte-v1")
    # the tokenizer's identity (and the BOS choice) is part of the key: another tokenizer, another cache
    bos = tokenizer.bos if data_cfg.add_bos else None
    if data_cfg.add_bos and bos is None:
        raise DataCacheError(f"data.add_bos: the tokenizer {tokenizer.identity['name']} has no beginning-of-sequence token")
    name = tokenizer.name if tokenizer.name == "byte-v1" else tokenizer.identity["sha256"]
    extra += f"bos={bos}" if bos is not None else ""
    # .jsonl files are read as their records' documents (once as one document of JSON text)
    extra += ",jsonl=records" if any(is_jsonl(p) for p in files) else ""
    out_dir = Path(data_cfg.cache_dir) / f"{tag}-{_cache_key(name, root, files, extra)}"
    prefix = str(out_dir / "tokens")
    required = ("tokens.bin", "tokens.idx", *(RETRIEVAL_FILES if share > 0 else ()))
    if out_dir.exists():
        found = problem(out_dir, full=data_cfg.verify_cache, required=required)
        if found is None:
            return prefix
        if not build:
            raise DataCacheError(f"data cache {out_dir}: {found}")
    elif not build:
        raise DataCacheError(f"data cache {out_dir} does not exist after rank 0 built it: data.cache_dir must be "
                             "on a file system every node sees")
    with BuildLock(out_dir, f"data cache {out_dir}", data_cfg.cache_wait_s):
        # another job may have built (or rebuilt) it while this one waited for the lock
        found = problem(out_dir, full=data_cfg.verify_cache, required=required) \
            if out_dir.exists() else None
        if found is not None:
            log.warning("data cache %s: %s; rebuilding it", out_dir, found)
            discard(out_dir)
        if not out_dir.exists():
            # the temporary directories of builds that died: nobody else builds this one now
            for leftover in out_dir.parent.glob(f".{out_dir.name}-*"):
                shutil.rmtree(leftover, ignore_errors=True)
            _tokenize(out_dir, tokenizer, root, files, data_cfg, seq_length, bos)
    return prefix


def _retrieval_tasks(data_cfg) -> tuple[str, ...]:
    return tuple(getattr(data_cfg, "retrieval_tasks", DEFAULT_TASKS))


def _mixture_key(data_cfg, share: float, seq_length: int | None, bytes_are_tokens: bool = True) -> str:
    """What the synthetic documents depend on, for the cache key. The mixture counts only when there
    is one, so plain corpora keep their caches; chosen tasks count with the generator's source (a
    change to a task's documents builds a new cache), the default ones not. Documents sized in another
    tokenizer's tokens (once they were sized in bytes with every tokenizer) are marked so, and so are
    documents in a dataset of whole windows (once they were appended to the corpus's), and windows
    filled with the pad id (once with end-of-document tokens, which took loss)."""
    if share <= 0:
        return ""
    key = f"retrieval={share},{seq_length},{data_cfg.seed}" + ("" if bytes_are_tokens else ",lengths=tokens")
    key += ",windows,pad"
    if getattr(data_cfg, "retrieval_min_length", 0):
        key += f",min_length={data_cfg.retrieval_min_length}"
    tasks = _retrieval_tasks(data_cfg)
    if tasks != DEFAULT_TASKS:
        source = hashlib.sha256(Path(retrieval.__file__).read_bytes()).hexdigest()[:16]
        key += f",tasks={'+'.join(tasks)},generator={source}"
    return key


def _tokenize(out_dir: Path, tokenizer, root: Path, files: list[Path], data_cfg, seq_length: int | None,
              bos: int | None) -> None:
    share = getattr(data_cfg, "retrieval_share", 0.0)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared by every user of the checkout
    builder = IndexedDatasetBuilder(str(tmp / "tokens.bin"), dtype=np.int32)
    n_tokens = n_docs = 0
    head = [] if bos is None else [bos]
    try:
        # files in batches: a Hugging Face tokenizer encodes a batch on every core
        for first in range(0, len(files), 256):
            for doc in tokenizer.tokenize_batch([d for p in files[first:first + 256] for d in _documents(p)]):
                ids = np.concatenate([head, doc, [tokenizer.eod]]).astype(np.int32)
                builder.add_document(ids, [ids.size])
                n_tokens, n_docs = n_tokens + ids.size, n_docs + 1
        builder.finalize(str(tmp / "tokens.idx"))
        n_synthetic = 0
        if share > 0:
            target = max(int(n_tokens * share / (1.0 - share)), MIN_RETRIEVAL_WINDOWS * seq_length)
            n_synthetic = _write_retrieval(tmp, tokenizer, files, data_cfg, seq_length, head, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    record(tmp, ["tokens.bin", "tokens.idx", *(RETRIEVAL_FILES if share > 0 else ())])
    try:
        os.rename(tmp, out_dir)
    except OSError:
        # another process finished the same build first; its result is identical
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("tokenized %d files (%.1f MB%s) from %s into %s: %d tokens%s", len(files),
             sum(p.stat().st_size for p in files) / 1e6, f", {n_docs:,} documents" if n_docs != len(files) else "",
             root, out_dir, n_tokens + n_synthetic,
             f" ({n_synthetic} in windows of synthetic retrieval documents)" if n_synthetic else "")


def _documents(path: Path) -> list[bytes]:
    """A corpus file's documents (data.corpus.file_documents: the file, or a .jsonl file's records)."""
    try:
        return file_documents(path)
    except ValueError as e:
        raise DataCacheError(f"data.source: {e}") from e


def _write_retrieval(out: Path, tokenizer, files: list[Path], data_cfg, seq_length: int, head: list[int],
                     target: int) -> int:
    """Synthetic retrieval documents of about `target` tokens into out/retrieval.{bin,idx}, whole
    documents packed into entries of exactly `seq_length` tokens, each document followed by its
    end-of-document token and the rest of the entry the tokenizer's pad id; returns their tokens.
    megatron cuts samples of `seq_length` tokens at a stride of `seq_length`, so every sample of
    this dataset is one entry: a question and its needles share their window. Appended to the
    corpus's documents instead, a third of kvrecall's questions or more lost their needle to the
    window before (bench/retrieval_answerable.py).

    GPTDataset takes no loss where the label is the pad id and feeds the model id 0 in its place:
    filled with end-of-document tokens instead, the entries taught the model to repeat them (unless
    data.eod_mask_loss), a trivial target in the lm loss of every retrieval mixture."""
    haystack = Haystack(files, pool_bytes=64 * seq_length + 4_000_000, seed=data_cfg.seed,
                        read=lambda path: b"\n".join(_documents(path)))
    # lengths and the share in the model's tokens (bytes are the byte tokenizer's tokens)
    count = None if tokenizer.name == "byte-v1" else (lambda doc: len(tokenizer.tokenize(doc)))
    # megatron's own pad sentinel (-1, data/tokenizer.py PAD): int32 holds it, and no text is it
    pad = tokenizer.pad
    builder = IndexedDatasetBuilder(str(out / "retrieval.bin"), dtype=np.int32)
    entry: list[int] = []
    n_entries = 0

    def flush():
        nonlocal entry, n_entries
        ids = np.full(seq_length, pad, dtype=np.int32)
        ids[:len(entry)] = entry
        builder.add_document(ids, [seq_length])
        entry, n_entries = [], n_entries + 1

    # a document, its BOS and its end-of-document token fit an entry
    for doc in training_documents(haystack, target, seq_length - len(head) - 1, seed=data_cfg.seed + 1,
                                  tasks=_retrieval_tasks(data_cfg), count=count,
                                  min_length=getattr(data_cfg, "retrieval_min_length", 0)):
        ids = [*head, *tokenizer.tokenize(doc), tokenizer.eod]
        if len(entry) + len(ids) > seq_length:
            flush()
        entry += ids
    if entry:
        flush()
    builder.finalize(str(out / "retrieval.idx"))
    return n_entries * seq_length


def retrieval_prefix(prefix: str) -> str | None:
    """The retrieval documents' dataset beside the corpus's `prefix` (data.retrieval_share > 0),
    else None."""
    path = Path(prefix).parent / "retrieval"
    return str(path) if path.with_suffix(".idx").exists() else None


def build_datasets(data_cfg, tokenizer, seq_length: int, train_samples: int, valid_samples: int = 0):
    """(train, valid) GPTDatasets of samples of `seq_length` tokens (+1 for the shifted labels);
    valid is None when `valid_samples` is 0.

    The tokens come from the prepared datasets of data.blend (data.valid_blend for validation, or
    each dataset's data.split share of documents), else from the file-directory corpus tokenized
    into the cache (data.split cuts its documents likewise). Every rank calls this; rank 0 tokenizes
    the corpus (or finds it, or waits for another job that builds it) while the others wait, then
    megatron builds the sample indices on rank 0 and the others read them from the cache
    (data/shared_build.py). Each item: tokens/labels int64 [seq_length], loss_mask float
    [seq_length], position_ids int64 [seq_length].
    """
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    from .prepared import contents_key, parse_blend

    if data_cfg.blend:
        # checked before the run started (data.prepared.check_blends); megatron reads them as they are
        train_blend = tuple(parse_blend(data_cfg.blend, "data.blend")[:2])
        valid_prefixes = parse_blend(data_cfg.valid_blend, "data.valid_blend")[0]
        # one directory per set of dataset contents: a prefix prepared again gets indices of its own
        index_dir = Path(data_cfg.cache_dir) / "indices" / contents_key([*train_blend[0], *valid_prefixes])
    else:
        if rank == 0:
            prefix = prepare_tokens(data_cfg, tokenizer, build=True, seq_length=seq_length)
        wait_for_rank_0(data_cfg.cache_wait_s)
        if rank != 0:
            prefix = prepare_tokens(data_cfg, tokenizer, build=False, seq_length=seq_length)
        synthetic = retrieval_prefix(prefix)
        # the retrieval documents are their share of the samples (each a whole window)
        share = getattr(data_cfg, "retrieval_share", 0.0)
        train_blend = ([prefix], None) if synthetic is None else ([prefix, synthetic], [1.0 - share, share])
        index_dir = Path(prefix).parent / "index"
        if data_cfg.valid_blend:
            index_dir = index_dir / contents_key(parse_blend(data_cfg.valid_blend, "data.valid_blend")[0])
    split = {"blend": train_blend, "split": ",".join(f"{float(x):g}" for x in data_cfg.split)}
    if data_cfg.valid_blend:
        split = {"blend_per_split": [train_blend, tuple(parse_blend(data_cfg.valid_blend, "data.valid_blend")[:2]),
                                     None]}
    config = GPTDatasetConfig(
        random_seed=data_cfg.seed,
        sequence_length=seq_length,
        **split,
        path_to_cache=str(index_dir),
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=data_cfg.eod_mask_loss,
        # attention is causal by construction in our layers; no mask tensor is needed
        create_attention_mask=False,
    )
    if "split" in split:
        # only what the run reads is built: no test split, and a validation split only when evaluating
        # (megatron would build every split its matrix names; a split without documents never ends)
        config.split_matrix = [config.split_matrix[0], config.split_matrix[1] if valid_samples else None, None]
        _check_split_documents(train_blend[0], config.split_matrix, data_cfg.split, seq_length)
    builder = BlendedMegatronDatasetBuilder(GPTDataset, [train_samples, valid_samples, 0], lambda: True, config)
    train, valid, _ = build_megatron_datasets(builder, data_cfg.verify_cache, data_cfg.cache_wait_s)
    for dataset in (train, valid):
        fresh_loss_masks(dataset)
    if rank == 0:
        for line in repeat_lines(train, "training") + repeat_lines(valid, "validation"):
            log.info("%s", line)
    if valid_samples and valid is None:
        raise DataCacheError(f"no validation data: data.split {list(data_cfg.split)} leaves no document for "
                             "validation; give it a larger second share, or data.valid_blend")
    return train, valid


def repeat_lines(dataset, split: str) -> list[str]:
    """One line per dataset of `dataset` (a GPTDataset, or a BlendedDataset of them) whose share of
    `split` the run reads more than once (megatron repeats it in shuffled passes, saying so only in
    its own log): a corpus smaller than the run, or a context longer than its text."""
    lines = []
    for part in getattr(dataset, "datasets", [dataset] if dataset is not None else []):
        tokens = int(np.asarray(part.dataset.sequence_lengths)[part.indices].sum())
        wanted = part.num_samples * part.config.sequence_length + 1
        if tokens and wanted > tokens:
            lines.append(f"data: the {split} share of {part.dataset_path} holds {tokens:,} tokens; the run reads "
                         f"{wanted:,} of it, about {wanted / tokens:,.1f} passes")
    return lines


def _check_split_documents(prefixes: list[str], split_matrix, split, seq_length: int) -> None:
    """Every split the run reads holds documents of every dataset (megatron cuts each dataset's
    documents by the split's fractions, rounded), and at least one sample's tokens: fewer would
    be repeated to fill every sample (a file-directory corpus is counted here, once tokenized)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from .prepared import sequences_tokens

    for prefix in prefixes:
        n = len(IndexedDataset(prefix, mmap=True).index.sequence_lengths)
        for name, span in zip(("training", "validation"), split_matrix):
            if span is None:
                continue
            lo, hi = int(round(span[0] * n)), int(round(span[1] * n))
            if hi <= lo:
                raise DataCacheError(f"data.split {list(split)} leaves no {name} document of {prefix} ({n:,} documents); "
                                     f"give {name} a larger share"
                                     + (", or its own datasets (data.valid_blend)" if name == "validation" else ""))
            tokens = sequences_tokens(prefix, lo, hi)
            if tokens <= seq_length:
                raise DataCacheError(f"data.split {list(split)}: the {name} documents of {prefix} ({hi - lo:,} of "
                                     f"{n:,}) hold {tokens:,} tokens, fewer than one sample (model.seq_length + 1 = "
                                     f"{seq_length + 1:,}), which would repeat them; give more text or a larger "
                                     f"{name} share")


class MicroBatchSampler:
    """Yields this data-parallel rank's micro-batches of sample indices, starting at
    `consumed_samples` (the data position saved in checkpoints).

    Each global step of `global_batch_size` consecutive samples is cut into chunks of
    micro_batch_size * dp; rank r takes slice r of every chunk, so the samples seen by the whole
    job do not depend on dp.
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int):
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size

    def __len__(self) -> int:
        return (self.total_samples - self.consumed_samples) // (self.micro_batch_size * self.dp_size)

    def __iter__(self):
        chunk = self.micro_batch_size * self.dp_size
        for start in range(self.consumed_samples, self.total_samples - chunk + 1, chunk):
            first = start + self.dp_rank * self.micro_batch_size
            yield list(range(first, first + self.micro_batch_size))


def document_starts(tokens_BS: torch.Tensor, eod: int) -> torch.Tensor:
    """int32 [B, S]: the position of the first token of each token's document. A document ends
    with its end-of-document token, so the next one starts right after it; the first document of
    a row may have begun before the row (a sample is a window of the token stream), and starts
    at 0 here."""
    S = tokens_BS.shape[1]
    after_eod = torch.where(tokens_BS == eod, torch.arange(1, S + 1), 0)
    # the start at t is one past the last end-of-document token before t
    starts = torch.zeros_like(after_eod)
    starts[:, 1:] = torch.cummax(after_eod[:, :-1], dim=1).values
    return starts.to(torch.int32)


def sample_source(dataset, index: int, position: int) -> str:
    """Where token `position` of sample `index` of `dataset` (a GPTDataset, or a BlendedDataset of
    them) comes from: the document of its indexed dataset and the token within it."""
    if hasattr(dataset, "dataset_index"):
        dataset, index = dataset.datasets[dataset.dataset_index[index]], int(dataset.dataset_sample_index[index])
    # megatron's sample index: (position in the shuffled document order, token offset) of each
    # sample's first token; a sample runs on through the following documents
    order, offset = (int(x) for x in dataset.sample_index[dataset.shuffle_index[index]])
    lengths = dataset.dataset.sequence_lengths
    at = offset + position
    while at >= lengths[dataset.document_index[order]]:
        at -= int(lengths[dataset.document_index[order]])
        order += 1
    return f"token {at:,} of document {int(dataset.document_index[order]):,} of {dataset.dataset_path}"


def check_token_ids(batch: dict, indices: list[int], dataset, vocab_size: int) -> None:
    """Every token of the micro-batch of samples `indices` is an id of the tokenizer: an id past
    the embedding's rows would stop the run with an index error deep in the model, naming
    nothing; an id within its padding would train a row no text has. A file damaged in place
    (the cheap check of the cache samples its bytes) or prepared with another tokenizer."""
    tokens = torch.cat([batch["tokens"], batch["labels"][:, -1:]], dim=1)
    bad = (tokens < 0) | (tokens >= vocab_size)
    if not bool(bad.any()):
        return
    row, position = (int(x) for x in bad.nonzero()[0])
    raise DataCacheError(
        f"data: token id {int(tokens[row, position]):,} at {sample_source(dataset, indices[row], position)} "
        f"(sample {indices[row]:,} of the run) is not an id of the tokenizer ({vocab_size:,} ids): the file "
        "is damaged or was prepared with another tokenizer; prepare it again (a corpus cache: delete its "
        "directory and it is rebuilt), and data.verify_cache=true hashes every byte before use")


def build_train_iterator(dataset, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                         document_mask: bool = False):
    """An iterator of micro-batch dicts (tokens, labels, loss_mask, position_ids, and with
    `document_mask` doc_start from `document_starts`), [b, s] each; every token checked to be an
    id of the tokenizer (check_token_ids)."""
    sampler = MicroBatchSampler(len(dataset), consumed_samples, micro_batch_size, dp_rank, dp_size)
    # megatron's datasets carry their tokenizer (a plain torch Dataset, as in tests, is taken as it is)
    tokenizer = getattr(getattr(dataset, "config", None), "tokenizer", None)
    for indices in sampler:
        batch = torch.utils.data.default_collate([dataset[i] for i in indices])
        if tokenizer is not None:
            check_token_ids(batch, indices, dataset, tokenizer.vocab_size)
        if document_mask:
            batch["doc_start"] = document_starts(batch["tokens"], tokenizer.eod)
        yield batch


class TrainData:
    """This data-parallel rank's training micro-batches from any position of the sample order.

    The position is the number of samples the whole job has consumed (TrainState.consumed_samples,
    saved in every checkpoint), so a resumed run continues with the sample after the last one it
    trained on. The dataset is built at the first `iterator` call: a run with nothing left to do
    never reads (or tokenizes) the corpus.
    """

    def __init__(self, build_dataset: Callable[[], torch.utils.data.Dataset], micro_batch_size: int,
                 dp_rank: int, dp_size: int, document_mask: bool = False):
        self._build_dataset, self._dataset = build_dataset, None
        self.micro_batch_size, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size
        self.document_mask = document_mask

    @property
    def dataset(self) -> torch.utils.data.Dataset:
        if self._dataset is None:
            self._dataset = self._build_dataset()
        return self._dataset

    def iterator(self, consumed_samples: int):
        """Micro-batch dicts as `build_train_iterator` gives them, from sample `consumed_samples`."""
        return build_train_iterator(self.dataset, consumed_samples, self.micro_batch_size, self.dp_rank,
                                    self.dp_size, document_mask=self.document_mask)
