"""Step metrics: reduction across ranks, and the logger callback (console line, progress bar,
TensorBoard, wandb, metrics.jsonl) that receives the same scalars everywhere."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

from msa_model.attention import KEYS_METRIC, KL_METRIC
from msa_model.training.callbacks import Callback

log = logging.getLogger(__name__)

# per-layer values megatron's MoE metrics tracker collects during forward; name -> our metric
LAYER_METRICS = {KL_METRIC: "kl_loss", "load_balancing_loss": "moe_aux_loss", KEYS_METRIC: "keys_per_query"}


def reduce_step_metrics(losses_reduced: list, num_microbatches: int, num_layers: int, pp_size: int,
                        device: torch.device) -> dict[str, float]:
    """Global lm loss (token mean over all micro-batches and ranks) and layer-mean tracker metrics.

    Every rank must call this; every rank gets the same result. Each tracker entry says how its
    per-rank values combine (megatron's convention): summed over its `reduce_group`, averaged
    over its `avg_group`, then over data-parallel replicas. Those groups lie within a pipeline
    stage, so they are reduced first, and a sum over the pipeline stages then collects every
    layer (a stage holds only its own layers; a metric a stage never records counts as zeros
    there). The result is the micro-batch mean, averaged over the layers that recorded it.
    `pp_size` is kept for callers; the stage count comes from megatron's groups.
    """
    lm = torch.zeros(2, dtype=torch.float64, device=device)
    for item in losses_reduced:
        lm += item["lm_loss"].to(device=device, dtype=torch.float64)
    tracker = get_moe_metrics_tracker()
    per_layer = torch.zeros(len(LAYER_METRICS), num_layers, dtype=torch.float64, device=device)
    for row, name in enumerate(LAYER_METRICS):
        entry = tracker.metrics.get(name)
        if entry is None:
            continue
        values = entry.values.to(device=device, dtype=torch.float64)
        if entry.reduce_group is not None:
            dist.all_reduce(values, group=entry.reduce_group)
        if entry.avg_group is not None:
            values = _group_mean(values, entry.avg_group)
        if entry.needs_dp_avg:
            values = _group_mean(values, parallel_state.get_data_parallel_group(with_context_parallel=False))
        per_layer[row] = values
    tracker.clear()
    dist.all_reduce(per_layer, group=parallel_state.get_pipeline_model_parallel_group())
    dist.all_reduce(lm)
    per_layer = per_layer / num_microbatches
    out = {"lm_loss": (lm[0] / lm[1].clamp(min=1)).item()}
    for row, key in enumerate(LAYER_METRICS.values()):
        recorded = per_layer[row] != 0
        if recorded.any():
            out[key] = per_layer[row][recorded].mean().item()
    return out


def _group_mean(t: torch.Tensor, group) -> torch.Tensor:
    # a sum and a division: gloo has no AVG reduction
    dist.all_reduce(t, group=group)
    return t / dist.get_world_size(group)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


class MetricsLogger(Callback):
    """Every `log_interval` steps: one console line and the same scalars to TensorBoard, wandb
    and <run_dir>/metrics.jsonl (interval means of per-step values). Only rank 0 writes.

    Between those lines the console is not left silent: the first step of a job gets a short line
    (it includes start-up costs), and without a terminal (no progress bar) a short line follows
    any PROGRESS_S seconds without output."""

    name = "metrics"
    SCALARS = ("lm_loss", "kl_loss", "moe_aux_loss", "lr", "grad_norm", "grad_norm_msa_index", "tokens_per_s",
               "keys_per_query", "tflops_per_gpu", "peak_mem_gib", "step_ms", "attention_ms", "moe_ms")
    PROGRESS_S = 30.0

    def __init__(self, logging_cfg, run_dir: str | Path, enabled: bool, max_steps: int, hparams: dict,
                 flops_per_token=None, world_size: int = 1):
        """flops_per_token(keys_per_query, sparse) -> model FLOPs per token (msa_model.flops), for
        the TFLOP/s per GPU of each line; None leaves it out."""
        self.cfg, self.run_dir, self.enabled = logging_cfg, Path(run_dir), enabled
        self.max_steps, self.hparams = max_steps, hparams
        self.flops_per_token, self.world_size = flops_per_token, world_size
        self.bar = self.tb = self.wandb_run = self.jsonl = None
        self._sums: dict[str, float] = {}
        self._counts: dict[str, int] = {}
        self._interval_tokens = 0
        self._t0 = self._last_line = time.perf_counter()
        self._first_step = 0
        self.last_record: dict | None = None

    def on_train_start(self, trainer) -> None:
        self._t0 = self._last_line = time.perf_counter()
        self._first_step = trainer.state.step + 1
        if not self.enabled:
            return
        if self.cfg.jsonl:
            path = self.run_dir / "metrics.jsonl"
            trim_metrics_after(path, trainer.state.step)
            self.jsonl = open(path, "a")
        if self.cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.run_dir / "tensorboard"))
        if self.cfg.wandb_mode != "disabled":
            import wandb

            # quiet: its run summary at the end would bury the run's own last lines
            self.wandb_run = wandb.init(project=self.cfg.wandb_project, entity=self.cfg.wandb_entity,
                                        mode=self.cfg.wandb_mode, dir=str(self.run_dir), config=self.hparams,
                                        name=self.run_dir.name, resume="allow", settings=wandb.Settings(quiet=True))
        if self.cfg.progress_bar:
            from tqdm import tqdm

            # disable=None: no bar when the output is not a terminal (CI logs, redirected runs)
            self.bar = tqdm(total=self.max_steps, initial=trainer.state.step, desc="train", unit="step",
                            dynamic_ncols=True, leave=False, disable=None)

    def on_step_end(self, trainer, metrics: dict) -> None:
        self._interval_tokens += metrics.pop("step_tokens")
        for key, value in metrics.items():
            self._sums[key] = self._sums.get(key, 0.0) + value
            self._counts[key] = self._counts.get(key, 0) + 1
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{metrics['lm_loss']:.3f}", refresh=False)
        step = trainer.state.step
        if step % self.cfg.log_interval == 0 or step == self.max_steps or trainer.state.stop_requested:
            self._emit(trainer)
        elif self.enabled and (step == self._first_step or (
                self.bar is None and time.perf_counter() - self._last_line > self.PROGRESS_S)):
            self._progress(trainer, metrics)

    def _progress(self, trainer, metrics: dict) -> None:
        """A short console line between the full ones (not a record: the interval means stay whole)."""
        steps = self._counts.get("lm_loss", 1)
        per_step = (time.perf_counter() - self._t0) / steps
        nxt = min(self.max_steps, (trainer.state.step // self.cfg.log_interval + 1) * self.cfg.log_interval)
        log.info("step %*d/%d | lm %.4f | %.1f s/step | next full line at step %d", len(str(self.max_steps)),
                 trainer.state.step, self.max_steps, metrics["lm_loss"], per_step, nxt)
        self._last_line = time.perf_counter()

    def _emit(self, trainer) -> None:
        elapsed = time.perf_counter() - self._t0
        scalars = {k: self._sums[k] / self._counts[k] for k in self._sums}
        scalars["tokens_per_s"] = self._interval_tokens / max(elapsed, 1e-9)
        self._sums, self._counts, self._interval_tokens, self._t0 = {}, {}, 0, time.perf_counter()
        s, phase = trainer.state, _phase(trainer)
        if self.flops_per_token is not None:
            flops = self.flops_per_token(scalars.get("keys_per_query"), phase != "warmup")
            scalars["tflops_per_gpu"] = flops * scalars["tokens_per_s"] / self.world_size / 1e12
        if torch.cuda.is_available() and trainer.device.type == "cuda":
            # peak of this interval, this rank (the same on every rank of a balanced layout)
            scalars["peak_mem_gib"] = torch.cuda.max_memory_allocated(trainer.device) / 2**30
            torch.cuda.reset_peak_memory_stats(trainer.device)
        self._last_line = self._t0
        if not self.enabled:
            return
        log.info("step %*d/%d | tokens %s | lm %s | kl %s | aux %s | lr %s | gnorm %s | %s tok/s | %s TFLOP/s%s | "
                 "%s | keys/q %s", len(str(self.max_steps)), s.step, self.max_steps, f"{s.tokens:,}",
                 _fmt(scalars.get("lm_loss"), ".4f"), _fmt(scalars.get("kl_loss"), ".4f"),
                 _fmt(scalars.get("moe_aux_loss"), ".4f"), _fmt(scalars.get("lr"), ".2e"),
                 _fmt(scalars.get("grad_norm"), ".3f"), f"{scalars['tokens_per_s']:,.0f}",
                 _fmt(scalars.get("tflops_per_gpu"), ".1f"),
                 f" | mem {scalars['peak_mem_gib']:.1f} GiB" if "peak_mem_gib" in scalars else "", phase,
                 _fmt(scalars.get("keys_per_query"), ".1f"))
        # namespaced scalars ("msa/...", from the diagnostics) pass through as they are
        record = {"step": s.step, "tokens": s.tokens, "phase": phase,
                  **{k: scalars[k] for k in self.SCALARS if k in scalars},
                  **{k: v for k, v in scalars.items() if "/" in k}}
        self.last_record = record
        if self.jsonl is not None:
            self.jsonl.write(json.dumps(record) + "\n")
            self.jsonl.flush()
        numeric = {k: v for k, v in record.items() if k in self.SCALARS or "/" in k}
        numeric["sparse"] = float(phase == "sparse")
        if self.tb is not None:
            for key, value in numeric.items():
                self.tb.add_scalar(f"train/{key}", value, s.step)
            self.tb.flush()
        if self.wandb_run is not None:
            self.wandb_run.log({f"train/{k}": v for k, v in numeric.items()} | {"tokens": s.tokens}, step=s.step)

    def on_train_end(self, trainer) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb_run is not None:
            import wandb

            self.wandb_run.finish()
            # offline mode leaves a wandb-core helper process behind otherwise
            wandb.teardown()


def trim_metrics_after(path: Path, step: int) -> int:
    """Drop the records of steps after `step` from a metrics.jsonl (those a crashed run wrote after
    the checkpoint a relaunch resumes from; the relaunch writes them again). The file is replaced
    atomically; a torn last line is dropped too. Returns the number of lines removed."""
    if not path.exists():
        return 0
    keep, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            dropped += 1
            continue
        if record.get("step", 0) <= step:
            keep.append(line)
        else:
            dropped += 1
    if dropped:
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(f"{line}\n" for line in keep))
        os.replace(tmp, path)
        log.info("metrics.jsonl: removed %d record(s) after step %d (written after the checkpoint this run "
                 "resumes from)", dropped, step)
    return dropped


def _phase(trainer) -> str:
    return trainer.state.extra.get("phase", "dense")
