"""Tokenize the corpus once into a cached megatron indexed dataset and sample it with GPTDataset.

Cache layout (under data.cache_dir, default .cache/data):
    <source>-<key>/tokens.bin, tokens.idx   int32 token ids, one document per file + EOD
    <source>-<key>/index/                   GPTDataset's document/sample/shuffle indices
where <key> hashes the tokenizer name and every file's relative path and contents, so a change to
either builds a new dataset and a stale one is never read. The build writes a temporary
directory and renames it into place, so an interrupted build leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from .corpus import list_corpus_files
from .retrieval import Haystack, training_documents
from .tokenizer import build_tokenizer

log = logging.getLogger(__name__)


def _cache_key(tokenizer_name: str, root: Path, files: list[Path], extra: str = "") -> str:
    h = hashlib.sha256(tokenizer_name.encode() + extra.encode())
    for path in files:
        h.update(path.relative_to(root).as_posix().encode())
        h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()[:16]


def prepare_tokens(data_cfg, build: bool = True, seq_length: int | None = None) -> str:
    """Return the indexed-dataset path prefix of the corpus, building it if `build` and missing.

    With `data_cfg.retrieval_share` > 0 synthetic retrieval documents (data.retrieval) of up to
    `seq_length` tokens make that share of the tokens. Only one rank should build (the caller
    synchronises); others call with build=False after.
    """
    tokenizer = build_tokenizer(data_cfg.tokenizer)
    root, files = list_corpus_files(data_cfg.source, data_cfg.glob, data_cfg.max_bytes)
    tag = "stdlib" if data_cfg.source == "stdlib" else Path(data_cfg.source).name
    share = getattr(data_cfg, "retrieval_share", 0.0)
    if share > 0 and not seq_length:
        raise ValueError("data.retrieval_share needs the sequence length of the documents")
    # the mixture is part of the key only when there is one, so plain corpora keep their caches
    extra = f"retrieval={share},{seq_length},{data_cfg.seed}" if share > 0 else ""
    out_dir = Path(data_cfg.cache_dir) / f"{tag}-{_cache_key(tokenizer.name, root, files, extra)}"
    prefix = str(out_dir / "tokens")
    if out_dir.exists() or not build:
        return prefix
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared by every user of the checkout
    builder = IndexedDatasetBuilder(str(tmp / "tokens.bin"), dtype=np.int32)
    n_tokens = 0
    for path in files:
        ids = np.append(tokenizer.tokenize(path.read_bytes()), tokenizer.eod).astype(np.int32)
        builder.add_document(ids, [ids.size])
        n_tokens += ids.size
    n_synthetic = 0
    if share > 0:
        # GPTDataset shuffles documents, so appending them after the corpus mixes them in
        haystack = Haystack(files, pool_bytes=64 * seq_length + 4_000_000, seed=data_cfg.seed)
        target = int(n_tokens * share / (1.0 - share))
        for doc in training_documents(haystack, target, seq_length, seed=data_cfg.seed + 1):
            ids = np.append(tokenizer.tokenize(doc), tokenizer.eod).astype(np.int32)
            builder.add_document(ids, [ids.size])
            n_synthetic += ids.size
    builder.finalize(str(tmp / "tokens.idx"))
    try:
        os.rename(tmp, out_dir)
    except OSError:
        # another process finished the same build first; its result is identical
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("tokenized %d files (%.1f MB) from %s into %s: %d tokens%s", len(files),
             sum(p.stat().st_size for p in files) / 1e6, root, out_dir, n_tokens + n_synthetic,
             f" ({n_synthetic} in synthetic retrieval documents)" if n_synthetic else "")
    return prefix


def build_train_dataset(data_cfg, seq_length: int, num_samples: int) -> GPTDataset:
    """GPTDataset of `num_samples` samples of `seq_length` tokens (+1 for the shifted labels).

    Every rank calls this; megatron builds the sample indices on rank 0 first, then the others
    read them from the cache. Each item: tokens/labels int64 [seq_length], loss_mask float
    [seq_length], position_ids int64 [seq_length].
    """
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    prefix = prepare_tokens(data_cfg, build=rank == 0, seq_length=seq_length)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    config = GPTDatasetConfig(
        random_seed=data_cfg.seed,
        sequence_length=seq_length,
        blend=([prefix], None),
        split="100,0,0",
        path_to_cache=str(Path(prefix).parent / "index"),
        tokenizer=build_tokenizer(data_cfg.tokenizer),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        # attention is causal by construction in our layers; no mask tensor is needed
        create_attention_mask=False,
    )
    train, _, _ = BlendedMegatronDatasetBuilder(
        GPTDataset, [num_samples, None, None], lambda: True, config
    ).build()
    return train


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


def build_train_iterator(dataset, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int):
    """An iterator of micro-batch dicts (tokens, labels, loss_mask, position_ids), [b, s] each."""
    sampler = MicroBatchSampler(len(dataset), consumed_samples, micro_batch_size, dp_rank, dp_size)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=0)
    return iter(loader)
