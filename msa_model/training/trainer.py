"""The training loop. It knows about micro-batches, the optimizer and callbacks; of the model it
only knows that the forward returns per-token losses and that layers record extra losses
(MoE aux, indexer KL) in megatron's metrics tracker for logging."""

from __future__ import annotations

import logging
from functools import partial

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from msa_model.context_parallel import slice_batch_for_cp
from msa_model.training.callbacks import Callback, TrainState
from msa_model.training.distributed import all_reduce_max
from msa_model.training.metrics import reduce_step_metrics

log = logging.getLogger(__name__)


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
    output = model(tokens, position_ids, None, labels=labels)
    return output, partial(_loss_func, loss_mask)


class Trainer:
    def __init__(self, *, model_chunks, optimizer, scheduler, data_iterator, callbacks: list[Callback],
                 max_steps: int, stop_at_step: int | None, seq_length: int, micro_batch_size: int,
                 global_batch_size: int, num_layers: int, device: torch.device, stop_signal=None):
        self.model_chunks, self.optimizer, self.scheduler = model_chunks, optimizer, scheduler
        self.data_iterator, self.callbacks = data_iterator, callbacks
        self.max_steps, self.stop_at_step = max_steps, stop_at_step
        self.seq_length, self.micro_batch_size, self.global_batch_size = seq_length, micro_batch_size, global_batch_size
        self.num_layers, self.device, self.stop_signal = num_layers, device, stop_signal
        self.state = TrainState()
        dp = parallel_state.get_data_parallel_world_size()
        self.num_microbatches = global_batch_size // (micro_batch_size * dp)

    def _call(self, hook: str, *args) -> None:
        for cb in self.callbacks:
            getattr(cb, hook)(self, *args)

    def train_step(self) -> dict:
        """One optimizer step over `global_batch_size` samples. Returns the step's metrics."""
        for chunk in self.model_chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        losses_reduced = get_forward_backward_func()(
            forward_step_func=partial(_forward_step, device=self.device),
            data_iterator=self.data_iterator,
            model=self.model_chunks,
            num_microbatches=self.num_microbatches,
            seq_length=self.seq_length,
            micro_batch_size=self.micro_batch_size,
            forward_only=False,
        )
        _, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(increment=1)
        metrics = reduce_step_metrics(losses_reduced, self.num_microbatches, self.num_layers,
                                      parallel_state.get_pipeline_model_parallel_world_size(), self.device)
        metrics["lr"] = self.optimizer.param_groups[0]["lr"]
        metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        # norms of separately tracked parameter groups (e.g. msa_index), before clipping
        for group, norm in (getattr(self.optimizer, "grad_norms_by_group", None) or {}).items():
            metrics[f"grad_norm_{group}"] = float(norm)
        return metrics

    def _should_stop(self) -> bool:
        if self.stop_at_step is not None and self.state.step >= self.stop_at_step:
            return True
        # every rank must agree, or a signal seen by one rank would split the job
        return all_reduce_max(self.stop_signal is not None and self.stop_signal.requested, self.device)

    def train(self) -> TrainState:
        for chunk in self.model_chunks:
            chunk.train()
        self._call("on_train_start")
        step_tokens = self.global_batch_size * self.seq_length
        # a relaunch of a job that stopped at stop_at_step must not run one step more
        if self.stop_at_step is not None and self.state.step >= self.stop_at_step:
            self.state.stop_requested = True
        while self.state.step < self.max_steps and not self.state.stop_requested:
            self._call("on_step_start")
            metrics = self.train_step()
            self.state.step += 1
            self.state.consumed_samples += self.global_batch_size
            self.state.tokens += step_tokens
            self.state.stop_requested = self._should_stop()
            if self.state.stop_requested and self.stop_signal is not None and self.stop_signal.requested:
                log.info("stop requested by %s: saving and exiting after step %d", self.stop_signal.received,
                         self.state.step)
            metrics["step_tokens"] = step_tokens
            self._call("on_step_end", metrics)
        self._call("on_train_end")
        return self.state
