"""Load a checkpoint into one process and score it: retrieval accuracy by task x length x depth, and
the held-out loss by token position.

Scoring one example takes one teacher-forced forward over prompt + answer: the greedy answer is
exactly right iff the argmax at every answer position is the answer token (each greedy step sees
the right tokens before it), and the rank of each answer token among the vocabulary (0 = the
argmax) says how close a wrong answer was.
"""

from __future__ import annotations

import json
import logging
import random
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from msa_model.ops.common import keys_per_query
from msa_model.training.model_source import CONVERSION_FILE

log = logging.getLogger("msa_model.eval")


class EvalError(ValueError):
    """A checkpoint, config or option the evaluation cannot use; the message names it."""


def resolve_checkpoint(path: str | Path) -> tuple[Path, Path | None]:
    """(step directory, config.yaml) of a run dir, a checkpoint root or a step_* directory; the
    config is None for a conversion's output (`python -m msa_model.convert`), which has none."""
    from msa_model.training.checkpoint import LATEST, latest_checkpoint

    path = Path(path)
    if not path.exists():
        raise EvalError(f"{path} does not exist")
    if (path / "config.yaml").is_file() and not (path / "checkpoints" / LATEST).is_file():
        elsewhere = OmegaConf.load(path / "config.yaml").get("checkpoint", {}).get("dir")
        if elsewhere:
            raise EvalError(f"{path}: the run keeps its checkpoints in checkpoint.dir {elsewhere}: give that directory")
        raise EvalError(f"{path}: the run has saved no checkpoint (yet): it saves every checkpoint.interval steps, "
                        "at its end unless checkpoint.save_at_end=false, and when stopped by a signal")
    if (path / "checkpoints").is_dir() and not (path / LATEST).exists():
        path = path / "checkpoints"
    if (path / LATEST).is_file():
        step_dir = latest_checkpoint(path)
    elif (path / "metadata.json").is_file():
        step_dir = path
    else:
        from msa_model.training.inputs import not_a_checkpoint_hint

        raise EvalError(f"{path} is not a checkpoint: no `latest`, no metadata.json, no checkpoints/ inside"
                        f"{not_a_checkpoint_hint(path, 'evaluate OUT')}")
    for candidate in (step_dir.parent.parent / "config.yaml", step_dir.parent / "config.yaml"):
        if candidate.is_file():
            return step_dir, candidate
    if (step_dir.parent / CONVERSION_FILE).is_file():
        return step_dir, None
    raise EvalError(f"no config.yaml next to {step_dir.parent} (the run directory's resolved config is needed "
                    "to rebuild the model)")


def load_config(config_path: Path | None, step_dir: Path):
    """The run config of the checkpoint `step_dir`: its run's config.yaml, or for a conversion
    (`config_path` None) the model it records with the defaults for the rest (the embedded
    corpus for the haystacks unless --corpus) and the tokenizer it records."""
    from msa_model.config import TrainConfig

    schema = OmegaConf.structured(TrainConfig)
    if config_path is None:
        return _conversion_config(schema, step_dir)
    try:
        cfg = OmegaConf.merge(schema, OmegaConf.load(config_path))
    except Exception as e:  # noqa: BLE001 - omegaconf raises several types; name the file
        raise EvalError(f"{config_path}: not a training config ({e})") from e
    _read_paths_as_the_run_did(cfg, config_path.parent)
    return cfg


def _read_paths_as_the_run_did(cfg, run_dir: Path) -> None:
    """data.source and data.tokenizer made absolute: relative ones name paths under the directory
    the run was launched in, which need not be this command's."""
    from msa_model.training.run_dir import run_path

    for key, named in (("source", "stdlib"), ("tokenizer", "byte")):
        value = cfg.data[key]
        if value is not None and value != named:
            cfg.data[key] = str(run_path(run_dir, value))


def _conversion_config(schema, step_dir: Path):
    from msa_model.training.data_setup import checkpoint_tokenizer
    from msa_model.training.model_source import known_model_fields, recorded_model_config

    recorded = recorded_model_config(step_dir)
    if recorded is None:
        raise EvalError(f"{step_dir}: the conversion records no model configuration to rebuild the model from")
    if checkpoint_tokenizer(step_dir) == (None, None):
        # the byte tokenizer would read its ids into another vocabulary's embedding
        raise EvalError(f"{step_dir} records no tokenizer (converted without its tokenizer files?): convert it "
                        "again with --tokenizer DIR")
    return OmegaConf.merge(schema, {"model": known_model_fields(recorded)[0]})


def build_model(cfg, step_dir: Path, device_pref: str, verify: bool = True):
    """The model of `cfg` on one process (TP = PP = 1) with the checkpoint's weights, eval mode.
    `verify`: check the checkpoint's manifest first (skip it only for one checked just before)."""
    from msa_model.config import ParallelConfig
    from msa_model.model.gpt import build_model as build
    from msa_model.training.checkpoint import load_weights
    from msa_model.training.data_setup import checkpoint_run_tokenizer
    from msa_model.training.distributed import init_distributed

    parallel = OmegaConf.structured(ParallelConfig)
    env = init_distributed(parallel, device_pref, cfg.trainer.seed)
    model = build(cfg.model, parallel, checkpoint_run_tokenizer(cfg, step_dir).vocab_size, on_cpu=env.device.type == "cpu")
    model.to(env.device)
    load_weights(model, step_dir, allow_missing_index=False, what="eval", error=EvalError, verify=verify)
    model.eval()
    return model, env.device


@torch.no_grad()
def _logits(model, tokens_BS: torch.Tensor) -> torch.Tensor:
    B, S = tokens_BS.shape
    pos = torch.arange(S, device=tokens_BS.device)[None].expand(B, S)
    return model(tokens_BS, pos, None)


def needle_token(ex, tokenizer) -> int | None:
    """The index, in the prompt's tokens, of the token holding the asked value's first digit in
    its needle line (`NAME = "<digits>"`, vartrack's `VAR_x = <digits>`); None if absent."""
    for pattern in (b'= "' + ex.answer + b'"', b"= " + ex.answer + b"\n"):
        at = ex.prompt.find(pattern)
        if at >= 0:
            return tokenizer.token_index(ex.prompt, at + pattern.index(ex.answer))
    return None


def needle_chance(query: int, needle: int, block_size: int, topk: int, local_blocks: int = 1,
                  force_sink: bool = False) -> float:
    """The share a selection of random blocks would reach: 1 for a needle in a block always
    selected (the query's local blocks, block 0 with force_sink), else the free slots over the
    other visible blocks, (topk - forced) / (visible - forced)."""
    visible, block = query // block_size + 1, needle // block_size
    local = min(local_blocks, visible)
    sink = force_sink and visible - local > 0  # block 0 forced and not already a local block
    if visible <= topk or block >= visible - local or (sink and block == 0):
        return 1.0
    forced = local + int(sink)
    return (topk - forced) / (visible - forced)


class QuerySelection:
    """A layer's diagnostics capture (MSASelfAttention.diagnostics_capture) that keeps only the
    selection of one query, `blocks` [G, K] (None until a chunk holding it passes): holding every
    layer's q and k, as the training diagnostics' capture does, would keep them all alive until
    the forward ends."""

    def __init__(self, query: int):
        self.query, self.blocks = query, None

    def add(self, block_idx=None, q_offset: int = 0, **_) -> None:
        if block_idx is not None and q_offset <= self.query < q_offset + block_idx.shape[1]:
            self.blocks = block_idx[0, self.query - q_offset].clone()

    def seal(self) -> None:
        pass


def _needle_selection(captures: list[QuerySelection], needle: int, block_size: int) -> float | None:
    """The share of (MSA layer, GQA group) pairs whose selection for the captured query holds the
    block of token `needle` (one unpacked sequence; None: no layer selected anything, as in the
    indexer warmup)."""
    hits, pairs = 0, 0
    for capture in captures:
        if capture.blocks is not None:
            hits += int((capture.blocks == needle // block_size).any(-1).sum())
            pairs += capture.blocks.shape[0]
    return hits / pairs if pairs else None


@torch.no_grad()
def score_example(model, device, ex, tokenizer, msa=None, bos: int | None = None) -> dict:
    """{"correct": bool, "rank": mean rank of the answer tokens, "logprob": their summed log-prob,
    "needle": share of (MSA layer, group) pairs whose blocks for the question's last token hold
    the needle's value, or None; "needle_chance": that share for random blocks}. The example is
    tokenized as training tokenizes a document (`example_ids`: one text, after `bos` when not
    None, the run's documents having started with it: training.data_setup.document_bos). `msa`:
    the MSA layers' options (model.msa; the needle measured when given)."""
    from msa_model.model.attention import msa_layers

    ids, A = example_ids(ex, tokenizer, bos)
    tokens = torch.from_numpy(ids[:-1])[None].to(device)
    targets = torch.from_numpy(ids[1:]).to(device)
    vocab = tokenizer.vocab_size
    head = int(bos is not None)
    # positions in the sequence: the BOS before the prompt moves them by one
    needle = needle_token(ex, tokenizer) if msa is not None else None
    needle = None if needle is None else needle + head
    # the question's last token, which predicts the answer's first
    query = len(ids) - A - 1
    block_size = msa.block_size if msa is not None else None
    layers = [m for m in msa_layers(model) if m.sparse] if needle is not None else []
    for layer in layers:
        layer.diagnostics_capture = QuerySelection(query)
    try:
        logits = _logits(model, tokens)[0, -A:, :vocab].float()
        selected = _needle_selection([m.diagnostics_capture for m in layers], needle, block_size) if layers else None
        chance = needle_chance(query, needle, block_size, msa.topk, msa.local_blocks, msa.force_sink) \
            if selected is not None else None
    finally:
        for layer in layers:
            layer.diagnostics_capture = None
    want = targets[-A:]
    target_logit = logits.gather(-1, want[:, None])
    ranks = (logits > target_logit).sum(-1).float()
    logprob = torch.log_softmax(logits, -1).gather(-1, want[:, None]).sum()
    return {"correct": bool((logits.argmax(-1) == want).all()), "rank": ranks.mean().item(), "logprob": logprob.item(),
            "needle": selected, "needle_chance": chance}


def default_lengths(context: int) -> list[int]:
    lengths, n = [], 1024
    while n <= context:
        lengths.append(n)
        n *= 2
    if not lengths or lengths[-1] != context:
        lengths.append(context)
    return lengths


# how examples are made from their settings (data/retrieval.py's haystacks, needles and fitting,
# example_ids' tokenization, the corpus files' reading): raised with a change that makes other
# examples of the same settings, so that partial.json's cells scored on the earlier ones are not
# reused (a partial.json recording none is from before version 1)
EXAMPLE_VERSION = 1


def _example_rng(seed: int, task: str, length: int, depth: float, index: int) -> random.Random:
    # random seeds a str by its sha512, every character counting and the same in every process
    # (not Python's salted str hash)
    return random.Random(f"{seed}|{task}|{length}|{depth:.6f}|{index}")


def example_ids(ex, tokenizer, bos: int | None = None) -> tuple[np.ndarray, int]:
    """(int64 ids of the example as training tokenizes a document: `bos` when not None, then
    prompt and answer as one text; how many ids at the end are the answer's). The answer's start
    at the token holding its first byte: where the tokenizer merges the first digit with the
    prompt's last characters (a BPE's " 5" after vartrack's `== `), that token is the answer's
    first, as training showed it (the prompt tokenized alone would end in a lone space, a token
    training never puts before a number). With the byte tokenizer: one id a byte."""
    text = ex.prompt + ex.answer
    ids = np.asarray(tokenizer.tokenize(text), dtype=np.int64)
    first = tokenizer.token_index(text, len(ex.prompt))
    if first is None or first >= len(ids):
        raise EvalError(f"{ex.task}: the tokenizer gives no token for the answer's first byte")
    head = np.array([] if bos is None else [bos], dtype=np.int64)
    return np.concatenate([head, ids]), len(ids) - first


def _tokens(ex, tokenizer) -> int:
    return sum(len(ids) for ids in tokenizer.tokenize_batch([ex.prompt, ex.answer]))


def example_of_tokens(task, length, depth, haystack, tokenizer, rng, tries: int = 8):
    """A retrieval example of `length` tokens as `score_example` tokenizes it: with the byte
    tokenizer the example of `length` bytes; with another, the longest example of at most `length`
    tokens within 2% of it (`data.retrieval.fit_example`; each try from a fresh `rng()`, so the
    example depends on (seed, task, length, depth, index) alone)."""
    from data.retrieval import fit_example, make_example
    from data.tokenizer import ByteTokenizer

    if isinstance(tokenizer, ByteTokenizer):
        return make_example(task, length, depth, haystack, rng())
    found = fit_example(task, length, depth, haystack, rng, lambda e: _tokens(e, tokenizer), tries=tries)
    if found is None:
        raise EvalError(f"{task}: no example of at most {length} tokens (its needles and question alone take more)")
    return found[0]


class Progress:
    """The retrieval cells (task x length) an evaluation has scored, in OUT/partial.json after each
    one: a Ctrl-C or a kill (a quality study's budget ending) loses the cell in progress only, and
    the same command on the same checkpoint with the same options goes on from the others
    (`settings`, with EXAMPLE_VERSION, differing: it starts afresh, and says so). The file goes
    once results.json is written."""

    FILE = "partial.json"

    def __init__(self, out: Path, settings: dict):
        self.path, self.cells = Path(out) / self.FILE, {}
        self.settings = {**settings, "example_version": EXAMPLE_VERSION}
        if self.path.is_file():
            try:
                saved = json.loads(self.path.read_text())
            except json.JSONDecodeError:
                saved = {}
            old = saved.get("settings") if isinstance(saved, dict) else None
            if old == self.settings:
                self.cells = saved["cells"]
            else:
                old = old if isinstance(old, dict) else {}
                differ = sorted(k for k in {**old, **self.settings} if old.get(k) != self.settings.get(k))
                log.info("%s holds cells scored with other settings (differing: %s); they are not reused",
                         self.path, ", ".join(differ))

    def get(self, task: str, length: int) -> dict | None:
        return self.cells.get(f"{task}/{length}")

    def put(self, task: str, length: int, cell: dict) -> None:
        from msa_model.eval.report import write_text_atomic

        self.cells[f"{task}/{length}"] = cell
        write_text_atomic(self.path, json.dumps({"settings": self.settings, "cells": self.cells}) + "\n")

    def finish(self) -> None:
        self.path.unlink(missing_ok=True)


def retrieval_results(model, device, haystack, tasks, lengths, depths, samples, seed, tokenizer,
                      msa=None, progress: Progress | None = None, bos: int | None = None) -> dict:
    """Per task and length: accuracy (by depth), mean answer rank and log-prob; with the sparse
    phase's `msa` options (model.msa), at lengths above the key budget (where a query cannot read
    every block) also `needle_selected`: the mean share of (layer, group) pairs whose selection
    for the question's last token held the block of the asked value (`score_example`), and
    `needle_chance`, the same for random blocks. `progress`: cells scored before (taken as they
    are) and where each new one is kept. `bos`: every example starts with it (score_example), its
    `length` tokens included."""
    out = {}
    for task in tasks:
        per_length = {}
        for length in lengths:
            kept = progress.get(task, length) if progress is not None else None
            if kept is not None:
                per_length[str(length)] = kept
                log.info("%-8s length %6d: accuracy %.3f (kept from an interrupted evaluation, %s)", task, length,
                         kept["accuracy"], progress.path)
                continue
            t0 = time.perf_counter()
            grid, ranks, logprobs, needles, chances = {}, [], [], [], []
            probe = msa if msa is not None and length > keys_per_query(msa.block_size, msa.topk) else None
            for depth in depths:
                hits = 0
                for i in range(samples):
                    ex = example_of_tokens(task, length - (bos is not None), depth, haystack, tokenizer,
                                           lambda: _example_rng(seed, task, length, depth, i))
                    r = score_example(model, device, ex, tokenizer, msa=probe, bos=bos)
                    hits += r["correct"]
                    ranks.append(r["rank"])
                    logprobs.append(r["logprob"])
                    if r["needle"] is not None:
                        needles.append(r["needle"])
                        chances.append(r["needle_chance"])
                grid[f"{depth:g}"] = hits / samples
            acc = sum(grid.values()) / len(grid)
            per_length[str(length)] = {"accuracy": acc, "mean_rank": sum(ranks) / len(ranks),
                                       "answer_logprob": sum(logprobs) / len(logprobs), "by_depth": grid,
                                       "needle_selected": sum(needles) / len(needles) if needles else None,
                                       "needle_chance": sum(chances) / len(chances) if chances else None}
            if progress is not None:
                progress.put(task, length, per_length[str(length)])
            needle = (f"  needle block selected {sum(needles) / len(needles):.2f} (random blocks "
                      f"{sum(chances) / len(chances):.2f})" if needles else "")
            log.info("%-8s length %6d: accuracy %.3f  mean answer rank %.2f%s  (%d examples, %.1f s)", task, length,
                     acc, per_length[str(length)]["mean_rank"], needle, samples * len(depths),
                     time.perf_counter() - t0)
        out[task] = per_length
    return out


def position_buckets(length: int) -> list[tuple[int, int]]:
    edges, e = [0], 64
    while e < length:
        edges.append(e)
        e *= 2
    edges.append(length)
    return list(zip(edges[:-1], edges[1:]))


OFFSET_PARTS = 8  # offset buckets of a key block in the loss by block offset


def loss_by_block_offset(per_pos: torch.Tensor, block_size: int, first: int, end: int) -> dict | None:
    """The mean loss per offset inside a key block (OFFSET_PARTS buckets of block_size / OFFSET_PARTS
    offsets) over positions [first, end), and `start_excess`: the first bucket's loss minus the
    mean over the block's second half (`start_excess_se`: its standard error). A query at its block's start reads its own block only up
    to itself, so with one local block (model.msa.local_blocks=1) its nearest earlier text is
    there only if the indexer selected the block before: an MSA model that misses it loses at
    small offsets, and dense attention (no blocks) shows no excess. None when [first, end) holds
    fewer than two blocks or the block has fewer than OFFSET_PARTS offsets."""
    if block_size < OFFSET_PARTS or end - first < 2 * block_size:
        return None
    pos = torch.arange(first, end)
    off = pos % block_size
    vals = per_pos[first:end]
    width = block_size // OFFSET_PARTS
    buckets = []
    for i in range(OFFSET_PARTS):
        a, b = i * width, block_size if i == OFFSET_PARTS - 1 else (i + 1) * width
        buckets.append({"from": a, "to": b, "loss": vals[(off >= a) & (off < b)].mean().item()})
    head, half = vals[off < width], vals[off >= block_size // 2]
    # standard error of the difference, positions taken as independent samples
    se = (head.var() / len(head) + half.var() / len(half)).sqrt().item()
    return {"block_size": block_size, "positions": [first, end], "buckets": buckets,
            "start_excess": buckets[0]["loss"] - half.mean().item(), "start_excess_se": se}


def heldout_stream(docs: list[bytes], tokenizer, length: int, bos: int | None = None) -> np.ndarray:
    """The documents tokenized and joined with end-of-document tokens, each after `bos` when not
    None (as the run's training documents: training.data_setup.document_bos), int64; EvalError
    when they hold less than one `length`-token sequence (found before the model loads and the retrieval
    runs, not after)."""
    stream = []
    for ids in tokenizer.tokenize_batch(docs):
        if bos is not None:
            stream.append(np.array([bos], dtype=np.int64))
        stream.append(ids.astype(np.int64))
        stream.append(np.array([tokenizer.eod], dtype=np.int64))
    flat = np.concatenate(stream) if stream else np.zeros(0, dtype=np.int64)
    if len(flat) - 1 < length:
        raise EvalError(f"the held-out text ({len(flat):,} tokens) is shorter than one {length}-token sequence "
                        "(--loss-length)")
    return flat


@torch.no_grad()
def loss_by_position(model, device, flat: np.ndarray, length: int, sequences: int,
                     offsets: tuple[int, int, int] | None = None, document_eod: int | None = None) -> dict:
    """Mean next-token loss per position bucket over up to `sequences` windows of `length` tokens
    cut from the token stream `flat` (`heldout_stream`). `offsets` (block size, first and end
    position): also the loss by offset inside a key block over those positions. `document_eod`:
    the end-of-document id of a run that masked packed documents (data.document_mask): each
    window's documents then attend within themselves, as in training (a token after an
    end-of-document token otherwise reads the document before, which the model never did);
    positions stay the window's, as training keeps them (docs/msa.md, "Positions are not reset")."""
    from data.datasets import document_starts
    from msa_model.ops.common import attach_host_copy

    n = min(sequences, (len(flat) - 1) // length)
    sums = torch.zeros(length, dtype=torch.float64)
    for i in range(n):
        window = torch.from_numpy(flat[i * length:(i + 1) * length + 1])
        tokens, labels = window[None, :-1], window[None, 1:]
        pos, doc_start = torch.arange(length)[None], None
        if document_eod is not None:
            starts = document_starts(tokens, document_eod)
            doc_start = attach_host_copy(starts.to(device), starts)
        sums += model(tokens.to(device), pos.to(device), doc_start, labels=labels.to(device))[0].double().cpu()
    per_pos = sums / n
    buckets = [{"from": a, "to": b, "loss": per_pos[a:b].mean().item()} for a, b in position_buckets(length)]
    out = {"length": length, "sequences": n, "buckets": buckets, "documents_masked": document_eod is not None}
    if offsets is not None:
        block_size, first, end = offsets
        out["by_block_offset"] = loss_by_block_offset(per_pos, block_size, first, min(end, length))
    return out


def corpus_glob(cfg, corpus: str | None, from_run: bool, glob: str | None) -> str:
    """Which files of the evaluation's corpus are text: `glob` (--glob) when given; the run's
    data.glob for the run's own corpus (no --corpus) or a run that read a file-directory corpus
    (`from_run`: a run config without a blend); else every file: a blend run's or a conversion's
    data.glob is the schema's default (`**/*.py`), which says nothing of a --corpus directory."""
    if glob:
        return glob
    return cfg.data.glob if corpus is None or (from_run and not cfg.data.blend) else "**/*"


def check_corpus(source: str, glob: str, max_bytes: int, option: str) -> list[Path]:
    """The corpus files (data.corpus.list_corpus_files), or EvalError naming `option` (where the
    directory came from), the directory and the glob."""
    from data.corpus import list_corpus_files

    try:
        return list_corpus_files(source, glob, max_bytes)[1]
    except FileNotFoundError:
        if not Path(source).is_dir() and source != "stdlib":
            what = "a file, not a directory of text files" if Path(source).exists() else "no such directory"
            raise EvalError(f"{option} {source}: {what}") from None
        raise EvalError(f"{option} {source}: no files match {glob!r} (--glob chooses them)") from None


def _heldout_docs(cfg, corpus: str | None, glob: str, need_bytes: int) -> tuple[list[bytes], str]:
    """Documents the run did not train on: the corpus files past `data.max_bytes` (the corpus is
    taken in sorted order); the training files, said so, when there are none. A .jsonl file's
    documents are its records' (data.corpus.file_documents)."""
    from data.corpus import corpus_root, file_documents, list_corpus_files

    source = corpus or cfg.data.source
    _, train_files = list_corpus_files(source, glob, cfg.data.max_bytes)
    _, all_files = list_corpus_files(source, glob, 1 << 62)
    # the run's own files past data.max_bytes are held out only when read as the run read them
    same = glob == cfg.data.glob and (corpus is None or (
        not cfg.data.blend and cfg.data.source is not None
        and Path(corpus).resolve() == corpus_root(cfg.data.source).resolve()))
    if not same:
        files, kind = all_files, "given corpus"
    else:
        files, kind = all_files[len(train_files):], "held-out"
        if not files:
            files, kind = train_files, "training files (no held-out files in the corpus)"
    docs, total = [], 0
    for path in files:
        if total >= need_bytes:
            break
        for doc in file_documents(path):
            docs.append(doc)
            total += len(doc) + 1
    return docs, kind


def key_budget(msa_cfg, msa_layer_count: int, phase: str) -> int | None:
    """The keys a query reads (top-k blocks) in the sparse phase of a model with MSA layers; None
    where every query reads every key (dense attention, the dense phase), so that the report
    names no budget and measures no needle selection there."""
    if msa_layer_count == 0 or phase != "sparse":
        return None
    return keys_per_query(msa_cfg.block_size, msa_cfg.topk)


def untrained_index(step_dir: Path) -> str | None:
    """What the checkpoint says of its index branch when it records it untrained (a conversion of
    a dense model, a run stopped before its indexer warmup ended), else None: the sparse phase's
    numbers are then those of a selection nothing taught, which the report says."""
    from msa_model.training.index_history import index_branch_history

    trained, what = index_branch_history(step_dir)
    return what if trained is False else None


def run_eval(args) -> dict:
    from data.corpus import file_documents
    from data.retrieval import MIN_LENGTH, TASKS, Haystack
    from msa_model.model.attention import msa_layers, set_msa_phase
    from msa_model.eval.report import write_report
    from msa_model.training.data_setup import checkpoint_run_tokenizer, document_bos
    from msa_model.training.distributed import shutdown
    from msa_model.training.manifest import verify_checkpoint
    from msa_model.training.run_dir import setup_logging

    out = Path(args.out)
    setup_logging(None, True)
    if out.exists() and not out.is_dir():
        raise EvalError(f"--out {out}: a file is in the way (the results go into a directory)")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise EvalError("--device cuda: CUDA is not available here (--device auto or cpu)")
    step_dir, config_path = resolve_checkpoint(args.checkpoint)
    cfg = load_config(config_path, step_dir)
    tasks = [t for t in args.tasks.split(",") if t]
    bad = [t for t in tasks if t not in TASKS]
    if bad or not tasks:
        raise EvalError(f"--tasks: unknown {bad or 'none given'} (known: {', '.join(TASKS)})")
    if not args.depths or any(not 0.0 <= d <= 1.0 for d in args.depths):
        raise EvalError(f"--depths: one or more in [0, 1], got {args.depths}")
    context = cfg.model.seq_length
    lengths = args.lengths or default_lengths(context)
    if any(n < MIN_LENGTH for n in lengths):
        raise EvalError(f"--lengths: each must be >= {MIN_LENGTH} tokens, got {lengths}")
    # a run on prepared datasets never read data.source (a default it keeps): its corpus is not there
    source = args.corpus or (None if cfg.data.blend else cfg.data.source)
    if source is None:
        raise EvalError(f"{config_path}: the run trained on prepared datasets (data.blend); give --corpus DIR, "
                        "a directory of text files for the haystacks and the held-out loss")
    glob = corpus_glob(cfg, args.corpus, config_path is not None, args.glob)
    files = check_corpus(source, glob, cfg.data.max_bytes, "--corpus" if args.corpus else "data.source")
    tokenizer = checkpoint_run_tokenizer(cfg, step_dir)
    # examples and held-out documents start as the run's training documents did
    bos = document_bos(cfg.data, tokenizer)
    msa = cfg.model.attention == "msa"
    # a run is named by its directory; a conversion by its output directory
    label = args.label or (step_dir.parent.parent if config_path else step_dir.parent).name
    log.info("eval %s (%s, %s attention%s) from %s; lengths %s, depths %s, %d samples each", label, cfg.model.name,
             cfg.model.attention, f", {args.phase} phase" if msa else "", step_dir, lengths, args.depths, args.samples)
    if max(lengths) > context:
        log.info("lengths above the training context (%d) measure extrapolation through RoPE", context)
    untrained = untrained_index(step_dir) if msa and args.phase == "sparse" else None
    if untrained:
        log.warning("the index branch is %s: the sparse phase selects with it (--phase dense reads every key)",
                    untrained)

    # a damaged checkpoint is found before the output directory exists (read once: it is not
    # hashed again at the load)
    verify_checkpoint(step_dir, "checkpoint", error=EvalError)
    pool_bytes = max(4_000_000, 4 * max(lengths))
    loss_length = args.loss_length or max(lengths)
    try:
        # .jsonl files as `python -m data.prepare` reads them: the records' text, not their JSON
        haystack = Haystack(files, pool_bytes=pool_bytes, seed=args.seed,
                            read=lambda path: b"\n".join(file_documents(path)))
        docs, kind = _heldout_docs(cfg, args.corpus, glob, (args.loss_sequences + 1) * loss_length)
    except ValueError as e:
        raise EvalError(f"{'--corpus' if args.corpus else 'data.source'} {source}: {e}") from None
    heldout = heldout_stream(docs, tokenizer, loss_length, bos)

    # only now, with the inputs checked: a refused evaluation leaves no output directory behind
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise EvalError(f"--out {out}: cannot create it ({e.strerror})") from None
    # an earlier evaluation's results go: this one replaces them, and until it has finished OUT
    # holds no results.json (whose presence says an evaluation there is complete)
    (out / "results.json").unlink(missing_ok=True)
    model, device = build_model(cfg, step_dir, args.device, verify=False)
    try:
        if msa:
            set_msa_phase(model, args.phase == "sparse")
        t0 = time.perf_counter()
        budget = key_budget(cfg.model.msa, len(msa_layers(model)) if msa else 0, args.phase)
        # what the retrieval cells depend on: cells of another checkpoint or options are not reused
        progress = Progress(out, {"checkpoint": str(step_dir.resolve()), "phase": args.phase, "depths": args.depths,
                                  "samples": args.samples, "seed": args.seed, "corpus": source, "glob": glob,
                                  "pool_bytes": pool_bytes, "device": device.type,
                                  **({"bos": bos} if bos is not None else {})})
        retrieval = retrieval_results(model, device, haystack, tasks, lengths, args.depths, args.samples, args.seed,
                                      tokenizer, msa=cfg.model.msa if budget else None,
                                      progress=progress, bos=bos)
        # the loss by block offset where selection can miss (a query sees more than top-k blocks)
        # and inside the training context; a dense run is measured on its config's blocks alike
        bk = cfg.model.msa.block_size
        offsets = (bk, keys_per_query(bk, cfg.model.msa.topk), context)
        loss = loss_by_position(model, device, heldout, loss_length, args.loss_sequences, offsets,
                                tokenizer.eod if cfg.data.document_mask else None)
        loss["source"] = kind
        log.info("held-out loss by position (%s, %d x %d tokens%s): %s", kind, loss["sequences"], loss_length,
                 ", documents masked" if loss["documents_masked"] else "",
                 " ".join(f"[{b['from']},{b['to']}) {b['loss']:.3f}" for b in loss["buckets"]))
        by_offset = loss.get("by_block_offset")
        if by_offset:
            log.info("held-out loss by offset in a %d-token key block (positions %d-%d): %s; first %d offsets "
                     "minus the second half %+.3f ± %.3f", bk, *by_offset["positions"],
                     " ".join(f"[{b['from']},{b['to']}) {b['loss']:.3f}" for b in by_offset["buckets"]),
                     by_offset["buckets"][0]["to"], by_offset["start_excess"], by_offset["start_excess_se"])
        results = {
            "label": label, "checkpoint": str(step_dir), "model": cfg.model.name, "attention": cfg.model.attention,
            "phase": args.phase if msa else "dense", "context": context,
            "key_budget": budget, "index_untrained": untrained,
            "seed": args.seed, "samples": args.samples, "lengths": lengths, "depths": args.depths, "tasks": retrieval,
            "accuracy_by_length": {str(n): sum(retrieval[t][str(n)]["accuracy"] for t in tasks) / len(tasks)
                                   for n in lengths},
            "loss_by_position": loss, "seconds": round(time.perf_counter() - t0, 1),
        }
        write_report(results, out)
        progress.finish()
        log.info("wrote %s", out / "results.json")
        return results
    finally:
        shutdown()
