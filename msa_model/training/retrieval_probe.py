"""The retrieval probe: while a run trains, how well it answers the synthetic retrieval tasks
(data/retrieval.py) at its full context, so a long-context run shows when it starts to retrieve
and an MSA run can be compared with its dense twin on a curve, not only at the end.

Every evaluation (trainer.eval_interval) scores `trainer.probe_samples` examples of each task of
`trainer.probe_tasks`, each `model.seq_length` tokens long (haystack cut from the run's corpus,
needle depths spread evenly over [0, 1]), teacher-forced on the answer's tokens:

    valid/probe/<task>/exact        share of examples whose every answer token is the argmax
                                    (what greedy decoding answers: the offline eval's accuracy)
    valid/probe/<task>/answer_loss  mean cross-entropy of an answer token, nats (a random digit:
                                    ln 10 = 2.30)
    valid/probe/<task>/answer_rank  mean rank of the answer token among the vocabulary (0: argmax)

The examples are the same for every run of a length, tokenizer and corpus (a fixed seed), so two
runs' curves compare the same questions. Each example is tokenized as training tokenizes a
document (prompt and answer as one text, after the beginning-of-sequence token the run's
documents start with, data.add_bos), as `python -m msa_model.eval` does; an example is one
sequence, padded after its answer.

B = micro-batch, S = sequence, V = vocabulary (this rank's shard under tensor parallelism).
"""

from __future__ import annotations

import logging
import os
import time
from functools import partial

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from msa_model.parallel.context_parallel import slice_batch_for_cp
from msa_model.training.metrics_file import PROBE_PREFIX

log = logging.getLogger(__name__)

# the probe's examples are named by this seed, whatever the run's seeds
PROBE_SEED = 20261205


def probe_key(task: str, metric: str) -> str:
    return f"{PROBE_PREFIX}{task}/{metric}"


def probe_rows(examples, tokenizer, seq_length: int, rows: int | None = None,
               bos: int | None = None) -> dict[str, torch.Tensor]:
    """Examples -> tokens, labels, loss_mask, position_ids [rows, seq_length]: each example's
    tokens (msa_model.eval.runner.example_ids: `bos` when not None, prompt and answer tokenized
    as one text, as training tokenizes a document) from position 0,
    the answer's tokens the only labels that count, end-of-document padding after the example.
    `rows` (default: one per example): the rows past the examples are padding alone, with nothing
    to score."""
    from msa_model.eval.runner import example_ids

    n = len(examples) if rows is None else rows
    tokens = torch.full((n, seq_length), tokenizer.eod, dtype=torch.int64)
    labels = torch.full((n, seq_length), tokenizer.eod, dtype=torch.int64)
    mask = torch.zeros((n, seq_length), dtype=torch.float32)
    for i, ex in enumerate(examples):
        ids, answer = example_ids(ex, tokenizer, bos)
        ids = torch.from_numpy(ids)
        if len(ids) > seq_length + 1 or answer == 0:
            raise ValueError(f"probe example {i} ({ex.task}) has {len(ids)} tokens and {answer} answer tokens "
                             f"for a sequence of {seq_length}")
        L = len(ids) - 1
        tokens[i, :L], labels[i, :L] = ids[:-1], ids[1:]
        mask[i, L - answer:L] = 1.0
    position_ids = torch.arange(seq_length)[None].expand(n, seq_length).contiguous()
    return {"tokens": tokens, "labels": labels, "loss_mask": mask, "position_ids": position_ids}


def _answer_scores(logits_NV: torch.Tensor, target_N: torch.Tensor, vocab: int):
    """(cross-entropy [N], rank [N]) of the targets among the first `vocab` ids (the tokenizer's;
    the padded rows past it are not words), with the vocabulary split over the tensor-parallel
    group as the output layer leaves it."""
    group = parallel_state.get_tensor_model_parallel_group()
    shard = logits_NV.shape[-1]
    lo = parallel_state.get_tensor_model_parallel_rank() * shard
    ids = lo + torch.arange(shard, device=logits_NV.device)
    logits = logits_NV.float().masked_fill(ids[None] >= vocab, float("-inf"))
    local = target_N - lo
    inside = (local >= 0) & (local < shard)
    target = torch.where(inside, logits.gather(-1, local.clamp(0, shard - 1)[:, None])[:, 0], 0.0)
    dist.all_reduce(target, group=group)
    top = logits.max(-1).values
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    sums = torch.exp(logits - top[:, None]).sum(-1)
    dist.all_reduce(sums, group=group)
    rank = (logits > target[:, None]).sum(-1).float()
    dist.all_reduce(rank, group=group)
    return top + torch.log(sums) - target, rank


def _probe_loss(labels_BS: torch.Tensor, mask_BS: torch.Tensor, vocab: int, logits_BSV: torch.Tensor):
    """The last stage's scores of one micro-batch: payload [loss sum, answer tokens, rank sum,
    exact examples, examples]; a row without answer tokens (padding to whole micro-batches) is no
    example. Under context parallelism an answer may span ranks: each row's wrong and answer
    tokens are summed over the group before it counts (every rank then counts the same examples,
    which the ratio does not mind)."""
    answer = mask_BS > 0
    rows = answer.nonzero()
    loss, rank = _answer_scores(logits_BSV[answer], labels_BS[answer], vocab)
    B = labels_BS.shape[0]
    # per row: [wrong answer tokens, answer tokens]
    counts = torch.zeros(2, B, dtype=torch.float32, device=labels_BS.device)
    counts[0].index_add_(0, rows[:, 0], (rank > 0).float())
    counts[1] = answer.sum(-1).float()
    if parallel_state.get_context_parallel_world_size() > 1:
        dist.all_reduce(counts, group=parallel_state.get_context_parallel_group())
    example = counts[1] > 0
    payload = torch.stack([loss.sum(), mask_BS.sum(), rank.sum(), (example & (counts[0] == 0)).sum().float(),
                           example.sum().float()]).double()
    # megatron divides the first by the second (a rank's chunk may hold no answer token under CP)
    return loss.sum(), answer.sum().clamp(min=1).to(torch.int), {"probe": payload}


def _probe_step(data_iterator, model, device: torch.device, vocab: int):
    # every stage reads the micro-batch: the first its tokens, the last its labels
    batch = slice_batch_for_cp(next(data_iterator), parallel_state.get_context_parallel_rank(),
                               parallel_state.get_context_parallel_world_size())
    tokens, labels = batch["tokens"].to(device), batch["labels"].to(device)
    logits = model(tokens, batch["position_ids"].to(device), None)
    return logits, partial(_probe_loss, labels, batch["loss_mask"].to(device), vocab)


def _common_root(files) -> str:
    return os.path.commonpath([str(f) for f in files]) if files else "-"


class RetrievalProbe:
    """The probe's examples (built at the first evaluation, the same on every rank) and its pass.
    `files`: the corpus files the haystacks are cut from; `tokenizer`: the run's; `bos`: the id
    the run's training documents start with (data_setup.document_bos), which starts every example."""

    def __init__(self, tasks, samples: int, files, tokenizer, seq_length: int, micro_batch_size: int,
                 bos: int | None = None):
        self.tasks, self.files, self.tokenizer, self.bos = list(tasks), files, tokenizer, bos
        self.seq_length, self.micro_batch_size = seq_length, micro_batch_size
        dp = parallel_state.get_data_parallel_world_size()
        # exactly `samples` examples at every layout; padding rows make whole micro-batches on
        # every data-parallel rank
        per_round = micro_batch_size * dp
        self.samples, self.padded = samples, -(-samples // per_round) * per_round
        self._rows: dict[str, dict[str, torch.Tensor]] = {}

    def _examples(self, task: str):
        from data.retrieval import Haystack
        from msa_model.eval.runner import _example_rng, example_of_tokens

        haystack = Haystack(self.files, pool_bytes=64 * self.seq_length + 4_000_000, seed=PROBE_SEED)
        out = []
        for i in range(self.samples):
            depth = (i + 0.5) / self.samples
            # one token more than the sequence (the inputs are all but the last), the BOS included
            length = self.seq_length + 1 - (self.bos is not None)
            out.append(example_of_tokens(task, length, depth, haystack, self.tokenizer,
                                         lambda: _example_rng(PROBE_SEED, task, self.seq_length, depth, i)))
        return out

    def rows(self, task: str) -> dict[str, torch.Tensor]:
        if task not in self._rows:
            first, t0 = not self._rows, time.perf_counter()
            self._rows[task] = probe_rows(self._examples(task), self.tokenizer, self.seq_length, self.padded, self.bos)
            if first:
                # once: where the haystacks come from (a blend run's data.source may be the default corpus)
                log.info("retrieval probe: %d examples a task of %d tokens, haystacks from %d files under %s (%s: "
                         "%.1f s)", self.samples, self.seq_length, len(self.files), _common_root(self.files), task,
                         time.perf_counter() - t0)
        return self._rows[task]

    def _batches(self, task: str):
        rows = self.rows(task)
        dp, r = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
        mine = torch.arange(r, self.padded, dp)
        for first in range(0, len(mine), self.micro_batch_size):
            pick = mine[first:first + self.micro_batch_size]
            yield {k: v[pick] for k, v in rows.items()}

    def run(self, model_chunks, device: torch.device) -> dict[str, float]:
        """Score every task (every rank calls this, the models in eval mode, no gradients); every
        rank gets the same metrics."""
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

        dp = parallel_state.get_data_parallel_world_size()
        num_microbatches = self.padded // (self.micro_batch_size * dp)
        out = {}
        for task in self.tasks:
            with torch.no_grad():
                reduced = get_forward_backward_func()(
                    forward_step_func=partial(_probe_step, device=device, vocab=self.tokenizer.vocab_size),
                    data_iterator=self._batches(task),
                    model=model_chunks,
                    num_microbatches=num_microbatches,
                    seq_length=self.seq_length,
                    micro_batch_size=self.micro_batch_size,
                    forward_only=True,
                )
            # the layers' own metrics (MoE aux loss, the indexer KL) of these passes are not the run's
            get_moe_metrics_tracker().clear()
            total = torch.zeros(5, dtype=torch.float64, device=device)
            for item in reduced:
                total += item["probe"].to(device=device, dtype=torch.float64)
            dist.all_reduce(total)
            loss, tokens, rank, exact, examples = total.tolist()
            out[probe_key(task, "exact")] = exact / max(examples, 1.0)
            out[probe_key(task, "answer_loss")] = loss / max(tokens, 1.0)
            out[probe_key(task, "answer_rank")] = rank / max(tokens, 1.0)
        return out
