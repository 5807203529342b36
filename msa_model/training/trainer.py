"""The training loop. It knows about micro-batches, the optimizer and callbacks; of the model it
only knows that the forward returns per-token losses and that layers record extra losses
(MoE aux, indexer KL) in megatron's metrics tracker for logging."""

from __future__ import annotations

import logging
import signal
from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from msa_model.model.attention import record_evaluation_metrics
from msa_model.parallel.context_parallel import slice_batch_for_cp
from msa_model.ops.dense_attention import attach_host_copy
from msa_model.training.callbacks import Callback, TrainState
from msa_model.training.metrics import reduce_step_metrics

log = logging.getLogger(__name__)


class OutOfMemory(RuntimeError):
    """The GPU ran out of memory; the message names the stage, the peak and the remedies."""


def is_out_of_memory(error: BaseException) -> bool:
    """torch's OutOfMemoryError, or an allocation failure surfacing through NCCL or cuBLAS
    (e.g. DistBackendError "Failed to CUDA calloc async" inside the gradient reduction)."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(
        s in text for s in ("out of memory", "cuda calloc", "cuda malloc", "cublas_status_alloc_failed"))


def out_of_memory_message(device: torch.device, stage: str, step: int, seq_length: int, micro_batch_size: int,
                          cuda_graph: bool = False) -> str:
    """`cuda_graph`: the run graphs its MSA layers (model.msa.cuda_graph), whose memory pools come
    first among the remedies, and which the recompute and CP remedies need off."""
    peak = total = float("nan")
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**30
        total = torch.cuda.get_device_properties(device).total_memory / 2**30
    graphs = ("model.msa.cuda_graph=false (each MSA layer's graphs keep a memory pool of their own, held "
              "between steps; with it off, also:) " if cuda_graph else "")
    return (f"out of memory on {device} during the {stage} of step {step} (sequence {seq_length:,} tokens, "
            f"micro-batch {micro_batch_size}): peak {peak:.1f} GiB allocated of {total:.1f} GiB. Remedies: {graphs}"
            "model.recompute=selective (rerun the attention core in backward) or model.recompute=full (rerun "
            "whole layers); parallel.cp=2 or more (context parallelism splits the sequence over GPUs); "
            "a smaller parallel.micro_batch_size or a shorter model.seq_length")


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Per-token losses [B, S] -> (sum, token count, logging payload [sum, count])."""
    losses = output_tensor.float()
    mask = loss_mask.float()
    loss_sum = (losses * mask).sum()
    num_tokens = mask.sum().to(torch.int)
    # the schedule divides the returned loss in place: log a detached copy
    return loss_sum, num_tokens, {"lm_loss": torch.stack([loss_sum.detach().clone(), mask.sum()])}


def _forward_step(data_iterator, model, device: torch.device):
    """One micro-batch through the model: (per-token loss [B, S], loss function)."""
    batch = next(data_iterator) if data_iterator is not None else None
    if batch is not None:
        # context parallel: every rank of a CP group reads the same samples and keeps its chunks
        batch = slice_batch_for_cp(batch, parallel_state.get_context_parallel_rank(),
                                   parallel_state.get_context_parallel_world_size())
    tokens = batch["tokens"].to(device) if batch is not None else None
    labels = batch["labels"].to(device) if batch is not None else None
    position_ids = batch["position_ids"].to(device) if batch is not None else None
    loss_mask = batch["loss_mask"].to(device) if batch is not None else None
    # packed documents (data.document_mask): their starts travel in megatron's attention_mask slot,
    # with their host copy, from which the layers plan their dense attention without reading back
    doc_start = None
    if batch is not None and "doc_start" in batch:
        doc_start = attach_host_copy(batch["doc_start"].to(device), batch["doc_start"])
    output = model(tokens, position_ids, doc_start, labels=labels)
    return output, partial(_loss_func, loss_mask)


class Trainer:
    """The loop over optimizer steps. Built whole from the run's config sections: `trainer_cfg`
    (max_steps, stop_at_step), `parallel_cfg` (micro and global batch size) and `model_cfg`
    (seq_length, num_layers); `data` gives this rank's micro-batches from a sample position
    (data.datasets.TrainData). The position is `state.consumed_samples`, which a checkpoint
    restores with the other counters before the first step reads a batch."""

    def __init__(self, trainer_cfg, parallel_cfg, model_cfg, *, model_chunks, optimizer, scheduler, data,
                 callbacks: list[Callback], device: torch.device, stop_signal=None, valid_data=None, probe=None):
        self.model_chunks, self.optimizer, self.scheduler = model_chunks, optimizer, scheduler
        self.data, self.valid_data, self.callbacks = data, valid_data, callbacks
        # msa_model.training.retrieval_probe.RetrievalProbe, scored at every evaluation, or None
        self.probe = probe
        self.max_steps, self.stop_at_step = trainer_cfg.max_steps, trainer_cfg.stop_at_step
        self.eval_interval, self.eval_iters = trainer_cfg.eval_interval, trainer_cfg.eval_iters
        self.micro_batch_size, self.global_batch_size = parallel_cfg.micro_batch_size, parallel_cfg.global_batch_size
        self.seq_length, self.num_layers = model_cfg.seq_length, model_cfg.num_layers
        self.cuda_graph = bool(model_cfg.msa.cuda_graph)
        self.device, self.stop_signal = device, stop_signal
        step_tokens = self.global_batch_size * self.seq_length
        # a checkpoint's counters replace these (resume_tokens.py: a resume at another batch)
        self.state = TrainState(step_tokens=step_tokens, schedule_step_tokens=step_tokens)
        self.stage = "start"  # what the step is doing, for error messages
        # the stop signal every rank agreed on, once one arrived (e.g. "SIGUSR1")
        self.stop_reason: str | None = None
        dp = parallel_state.get_data_parallel_world_size()
        self.num_microbatches = self.global_batch_size // (self.micro_batch_size * dp)
        self._data_iterator = None

    def batches(self):
        """This rank's micro-batches, opened at the first call from the state's data position."""
        if self._data_iterator is None:
            self._data_iterator = self.data.iterator(self.state.consumed_samples)
        return self._data_iterator

    def _call(self, hook: str, *args) -> None:
        for cb in self.callbacks:
            getattr(cb, hook)(self, *args)

    def train_step(self) -> dict:
        """One optimizer step over `global_batch_size` samples. Returns the step's metrics."""
        for chunk in self.model_chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.stage = "forward and backward"
        losses_reduced = get_forward_backward_func()(
            forward_step_func=partial(_forward_step, device=self.device),
            data_iterator=self.batches(),
            model=self.model_chunks,
            num_microbatches=self.num_microbatches,
            seq_length=self.seq_length,
            micro_batch_size=self.micro_batch_size,
            forward_only=False,
        )
        self.stage = "gradient reduction and optimizer step"
        _, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(increment=self._schedule_increment())
        metrics = reduce_step_metrics(losses_reduced, self.num_microbatches, self.num_layers,
                                      parallel_state.get_pipeline_model_parallel_world_size(), self.device)
        metrics["lr"] = self.optimizer.param_groups[0]["lr"]
        metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        # norms of separately tracked parameter groups (e.g. msa_index), before clipping
        for group, norm in (getattr(self.optimizer, "grad_norms_by_group", None) or {}).items():
            metrics[f"grad_norm_{group}"] = float(norm)
        return metrics

    def _schedule_increment(self) -> int | float:
        """The lr schedule's steps a step makes: its tokens over those of a schedule step (1 unless
        a resume changed the tokens a step, msa_model/training/resume_tokens.py)."""
        step_tokens = self.global_batch_size * self.seq_length
        return 1 if step_tokens == self.state.schedule_step_tokens else step_tokens / self.state.schedule_step_tokens

    def evaluate(self) -> dict:
        """The held-out losses of the next `eval_iters` global batches of the validation stream, in
        the current attention phase, without gradients: {"valid/lm_loss", "valid/kl_loss" (MSA),
        ...}; with a retrieval probe also its scores (valid/probe/<task>/...). Every rank must call
        this; every rank gets the same result."""
        self._call("on_evaluation_start")
        metrics = self._validation_losses() if self.valid_data is not None else {}
        if self.probe is not None:
            self.stage = "retrieval probe"
            for chunk in self.model_chunks:
                chunk.eval()
            metrics.update(self.probe.run(self.model_chunks, self.device))
            for chunk in self.model_chunks:
                chunk.train()
        return metrics

    def _validation_losses(self) -> dict:
        for chunk in self.model_chunks:
            chunk.eval()
        record_evaluation_metrics(self.model_chunks, True)
        self.stage = "evaluation"
        num_microbatches = self.num_microbatches * self.eval_iters
        with torch.no_grad():
            losses_reduced = get_forward_backward_func()(
                forward_step_func=partial(_forward_step, device=self.device),
                data_iterator=self.valid_data.iterator(self.state.consumed_valid_samples),
                model=self.model_chunks,
                num_microbatches=num_microbatches,
                seq_length=self.seq_length,
                micro_batch_size=self.micro_batch_size,
                forward_only=True,
            )
        self.state.consumed_valid_samples += self.eval_iters * self.global_batch_size
        for chunk in self.model_chunks:
            chunk.train()
        record_evaluation_metrics(self.model_chunks, False)
        metrics = reduce_step_metrics(losses_reduced, num_microbatches, self.num_layers,
                                      parallel_state.get_pipeline_model_parallel_world_size(), self.device)
        return {f"valid/{key}": value for key, value in metrics.items()}

    def _evaluation_due(self) -> bool:
        if (self.valid_data is None and self.probe is None) or not self.eval_interval:
            return False
        return self.state.step % self.eval_interval == 0 or self.state.step == self.max_steps

    def _should_stop(self) -> bool:
        if self.stop_at_step is not None and self.state.step >= self.stop_at_step:
            return True
        # every rank must agree, or a signal seen by one rank would split the job, and name the
        # same signal (the highest number any rank received) for the requeue decision
        mine = self.stop_signal.received if self.stop_signal is not None else None
        t = torch.tensor([float(signal.Signals[mine]) if mine else 0.0], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if t.item() > 0:
            self.stop_reason = signal.Signals(int(t.item())).name
            return True
        return False

    def train(self) -> TrainState:
        for chunk in self.model_chunks:
            chunk.train()
        # the dataset is built here, before the callbacks start their clocks
        self.batches()
        self._call("on_train_start")
        # after on_train_start: until here a resumed state's step_tokens are its checkpoint's steps'
        # (the indexer warmup reads them)
        step_tokens = self.state.step_tokens = self.global_batch_size * self.seq_length
        # a relaunch of a job that stopped at stop_at_step must not run one step more; a stop
        # signal that came during start-up ends the job before its first step
        self.state.stop_requested = self._should_stop()
        while self.state.step < self.max_steps and not self.state.stop_requested:
            self._call("on_step_start")
            try:
                metrics = self.train_step()
            except Exception as e:
                if not is_out_of_memory(e):
                    raise
                raise OutOfMemory(out_of_memory_message(self.device, self.stage, self.state.step + 1, self.seq_length,
                                                        self.micro_batch_size, self.cuda_graph)) from e
            self.state.step += 1
            self.state.consumed_samples += self.global_batch_size
            self.state.tokens += step_tokens
            if self._evaluation_due():
                metrics.update(self.evaluate())
            self.state.stop_requested = self._should_stop()
            metrics["step_tokens"] = step_tokens
            self._call("on_step_end", metrics)
        self._call("on_train_end")
        return self.state
