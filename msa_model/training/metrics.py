"""Step metrics: reduction across ranks, the logger callback that turns them into one record per
log interval, and the sinks it hands each record to (console line and progress bar,
metrics.jsonl, TensorBoard, wandb), in the order run.py lists them."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

from msa_model.model.attention import KEYS_METRIC, KL_METRIC
from msa_model.training.callbacks import Callback
from msa_model.training.metrics_file import probe_scores

log = logging.getLogger(__name__)

# the prefix of the validation's metrics (trainer.evaluate)
VALID = "valid/"
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


def flop_rate(tflops: float | None) -> str:
    """Achieved model FLOP/s per GPU in a unit that shows it (a CPU does GFLOP/s, not 0.0 TFLOP/s)."""
    if tflops is None:
        return "- FLOP/s"
    for unit, scale in (("TFLOP/s", 1.0), ("GFLOP/s", 1e-3)):
        if tflops >= scale:
            return f"{tflops / scale:.1f} {unit}"
    return f"{tflops * 1e6:.1f} MFLOP/s"


class MetricsSink:
    """Where the records go. `step` is called after every step with that step's own values, and
    with the interval's record at the steps that have one (None otherwise)."""

    def open(self, step: int) -> None:
        """The run starts after `step` (0, or the step it resumes from)."""

    def step(self, step: int, metrics: dict, record: dict | None) -> None:
        if record is not None:
            self.write(record)

    def write(self, record: dict) -> None:
        pass

    def close(self) -> None:
        pass


class MetricsLogger(Callback):
    """Every `log_interval` steps (and at the last step or a requested stop) one record of interval
    means of the per-step values, handed to each sink in the order given; every step also goes to
    the sinks (ConsoleLine uses it for its progress bar and its short lines in between). Every
    rank reduces the same scalars; only rank 0 is given sinks. `last_record` is the newest record.

    A record's `phase` is that of its last step, and its `keys_per_query` the mean over the steps of
    that phase only: an interval spanning the warmup's end would otherwise average dense steps'
    keys into a sparse record (more keys than top-k allows). Such an interval also carries
    `phase_steps`, the number of its steps in each phase, and its FLOP rate counts each phase's
    steps at their own cost.
    """

    name = "metrics"
    SCALARS = ("lm_loss", "kl_loss", "moe_aux_loss", "lr", "grad_norm", "grad_norm_msa_index", "tokens_per_s",
               "keys_per_query", "tflops_per_gpu", "peak_mem_gib", "step_ms", "attention_ms", "moe_ms")

    def __init__(self, sinks: list[MetricsSink], log_interval: int, max_steps: int, flops_per_token=None,
                 world_size: int = 1, phase: Callable[[], str] | None = None):
        """flops_per_token(keys_per_query, sparse) -> model FLOPs per token (msa_model.training.flops), for
        the TFLOP/s per GPU of each record; None leaves it out. phase() -> the attention phase of
        the step being recorded ("warmup", "sparse", or "dense-step" for a dense step after the warmup:
        the IndexerWarmup's, which sets it at the step's start); None: "dense", a model without an
        indexer warmup."""
        self.sinks, self.log_interval, self.max_steps = sinks, log_interval, max_steps
        self.flops_per_token, self.world_size = flops_per_token, world_size
        self.phase = phase or (lambda: "dense")
        self._sums: dict[str, float] = {}
        self._counts: dict[str, int] = {}
        self._interval_tokens = 0
        self._interval_steps = 0
        # phase -> [steps, sum of keys_per_query, steps that recorded it]
        self._phases: dict[str, list] = {}
        self._t0 = time.perf_counter()
        self.last_record: dict | None = None

    def on_train_start(self, trainer) -> None:
        self._t0 = time.perf_counter()
        for sink in self.sinks:
            sink.open(trainer.state.step)

    def on_step_end(self, trainer, metrics: dict) -> None:
        self._interval_tokens += metrics.pop("step_tokens")
        self._interval_steps += 1
        # the phase is set at the step's start and holds until the next one starts
        counts = self._phases.setdefault(self.phase(), [0, 0.0, 0])
        counts[0] += 1
        if "keys_per_query" in metrics:
            counts[1] += metrics["keys_per_query"]
            counts[2] += 1
        for key, value in metrics.items():
            self._sums[key] = self._sums.get(key, 0.0) + value
            self._counts[key] = self._counts.get(key, 0) + 1
        step = trainer.state.step
        record = None
        if step % self.log_interval == 0 or step == self.max_steps or trainer.state.stop_requested:
            record = self._record(trainer)
        for sink in self.sinks:
            sink.step(step, metrics, record)

    def _record(self, trainer) -> dict:
        elapsed = time.perf_counter() - self._t0
        scalars = {k: self._sums[k] / self._counts[k] for k in self._sums}
        scalars["tokens_per_s"] = self._interval_tokens / max(elapsed, 1e-9)
        # the interval's mean step time on the host clock, callbacks included: no device
        # synchronisation (the step's own losses already waited for the device). The module timer
        # (logging.time_modules) measures each step instead, synchronised
        scalars.setdefault("step_ms", elapsed * 1e3 / max(self._interval_steps, 1))
        s, phase, phases = trainer.state, self.phase(), self._phases
        keys = {p: c[1] / c[2] for p, c in phases.items() if c[2]}
        scalars.pop("keys_per_query", None)
        if phase in keys:
            scalars["keys_per_query"] = keys[phase]
        if self.flops_per_token is not None:
            # every step of a log interval has the same tokens: a step-weighted mean. A dense step
            # after the warmup runs as a warmup step does (dense attention and the dense KL, no
            # block selection), so only "sparse" steps are costed as sparse
            flops = sum(c[0] * self.flops_per_token(keys.get(p), p == "sparse") for p, c in phases.items())
            scalars["tflops_per_gpu"] = flops / self._interval_steps * scalars["tokens_per_s"] / self.world_size / 1e12
        self._sums, self._counts, self._interval_tokens, self._interval_steps = {}, {}, 0, 0
        self._phases = {}
        self._t0 = time.perf_counter()
        if torch.cuda.is_available() and trainer.device.type == "cuda":
            # peak of this interval, this rank (the same on every rank of a balanced layout)
            scalars["peak_mem_gib"] = torch.cuda.max_memory_allocated(trainer.device) / 2**30
            torch.cuda.reset_peak_memory_stats(trainer.device)
        # namespaced scalars ("msa/...", from the diagnostics) pass through as they are
        # time: when the record was made, UNIX seconds (UTC), to line a run up with other logs
        self.last_record = {"step": s.step, "tokens": s.tokens, "time": round(time.time(), 3), "phase": phase,
                            **{k: scalars[k] for k in self.SCALARS if k in scalars},
                            **{k: v for k, v in scalars.items() if "/" in k}}
        if len(phases) > 1:
            self.last_record["phase_steps"] = {p: c[0] for p, c in phases.items()}
        return self.last_record

    def on_train_end(self, trainer) -> None:
        for sink in self.sinks:
            sink.close()


def _numeric(record: dict) -> dict[str, float]:
    """The record's scalars for TensorBoard and wandb under their names there: train/<name>, the
    validation's as valid/<name>, with the attention phase as 0/1 `train/sparse`."""
    numeric = {k if k.startswith(VALID) else f"train/{k}": v for k, v in record.items()
               if k in MetricsLogger.SCALARS or "/" in k}
    numeric["train/sparse"] = float(record["phase"] == "sparse")
    return numeric


class ConsoleLine(MetricsSink):
    """One log line per record, and a progress bar on a terminal. Between those lines the console
    is not left silent: the first step of a job gets a short line (it includes start-up costs),
    and without a terminal (no progress bar) a short line follows any PROGRESS_S seconds without
    output."""

    PROGRESS_S = 30.0

    def __init__(self, max_steps: int, log_interval: int, progress_bar: bool):
        self.max_steps, self.log_interval, self.progress_bar = max_steps, log_interval, progress_bar
        self.bar = None
        self._t0 = self._last_line = time.perf_counter()
        self._first_step = 0
        self._steps = 0  # since the last full line

    def open(self, step: int) -> None:
        self._t0 = self._last_line = time.perf_counter()
        self._first_step = step + 1
        if self.progress_bar:
            from tqdm import tqdm

            # disable=None: no bar when the output is not a terminal (CI logs, redirected runs); the
            # short lines stand in for it then, so a disabled bar is no bar
            bar = tqdm(total=self.max_steps, initial=step, desc="train", unit="step",
                       dynamic_ncols=True, leave=False, disable=None)
            self.bar = None if bar.disable else bar

    def step(self, step: int, metrics: dict, record: dict | None) -> None:
        self._steps += 1
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{metrics['lm_loss']:.3f}", refresh=False)
        if record is not None:
            self.write(record)
        elif step == self._first_step or (self.bar is None and time.perf_counter() - self._last_line > self.PROGRESS_S):
            self._progress(step, metrics)

    def _progress(self, step: int, metrics: dict) -> None:
        """A short line between the full ones (not a record: the interval means stay whole)."""
        per_step = (time.perf_counter() - self._t0) / self._steps
        nxt = min(self.max_steps, (step // self.log_interval + 1) * self.log_interval)
        log.info("step %*d/%d | lm %.4f | %.1f s/step | next full line at step %d", len(str(self.max_steps)),
                 step, self.max_steps, metrics["lm_loss"], per_step, nxt)
        self._last_line = time.perf_counter()

    def write(self, r: dict) -> None:
        self._t0 = self._last_line = time.perf_counter()
        self._steps = 0
        log.info("step %*d/%d | tokens %s | lm %s | kl %s | aux %s | lr %s | gnorm %s | %s tok/s | %s%s | "
                 "%s | keys/q %s", len(str(self.max_steps)), r["step"], self.max_steps, f"{r['tokens']:,}",
                 _fmt(r.get("lm_loss"), ".4f"), _fmt(r.get("kl_loss"), ".4f"), _fmt(r.get("moe_aux_loss"), ".4f"),
                 _fmt(r.get("lr"), ".2e"), _fmt(r.get("grad_norm"), ".3f"), f"{r['tokens_per_s']:,.0f}",
                 flop_rate(r.get("tflops_per_gpu")),
                 f" | mem {r['peak_mem_gib']:.1f} GiB" if "peak_mem_gib" in r else "", _phase_text(r),
                 _fmt(r.get("keys_per_query"), ".1f"))
        if f"{VALID}lm_loss" in r:
            # validation runs in the run's phase: top-k after a dense step of trainer.indexer_dense_interval
            log.info("validation at step %d | lm %.4f | kl %s | %s", r["step"], r[f"{VALID}lm_loss"],
                     _fmt(r.get(f"{VALID}kl_loss"), ".4f"), "sparse" if r["phase"] == "dense-step" else r["phase"])
        probe = probe_scores(r)
        if probe:
            log.info("retrieval probe at step %d | %s", r["step"], " | ".join(
                f"{t} exact {v['exact']:.3f} answer loss {v['answer_loss']:.3f} rank {v['answer_rank']:.2f}"
                for t, v in probe.items()))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _phase_text(r: dict) -> str:
    """The record's phase; for an interval of several, how many of its steps it covers (its keys per
    query are theirs), e.g. "sparse (5 of 10 steps; 5 warmup)"."""
    counts = r.get("phase_steps")
    if not counts:
        return r["phase"]
    others = ", ".join(f"{n} {p}" for p, n in counts.items() if p != r["phase"])
    return f"{r['phase']} ({counts[r['phase']]} of {sum(counts.values())} steps; {others})"


class JsonlFile(MetricsSink):
    """One JSON line per record in <run_dir>/metrics.jsonl; a resumed run first drops the records
    written after the step it resumes from. metrics_file.read_metrics reads it back without torch."""

    def __init__(self, path: str | Path):
        self.path, self.file = Path(path), None

    def open(self, step: int) -> None:
        trim_metrics_after(self.path, step)
        self.file = open(self.path, "a")

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


class TensorBoard(MetricsSink):
    """The record's scalars as train/<name> in <run_dir>/tensorboard."""

    def __init__(self, log_dir: str | Path):
        self.log_dir, self.writer = Path(log_dir), None

    def open(self, step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(self.log_dir))

    def write(self, record: dict) -> None:
        for key, value in _numeric(record).items():
            self.writer.add_scalar(key, value, record["step"])
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class Wandb(MetricsSink):
    """The record's scalars as train/<name> in a wandb run named after the run dir (resumed when it
    exists), with the run's resolved config as its config."""

    def __init__(self, logging_cfg, run_dir: str | Path, hparams: dict):
        self.cfg, self.run_dir, self.hparams = logging_cfg, Path(run_dir), hparams
        self.run = None

    def open(self, step: int) -> None:
        import wandb

        # quiet: its run summary at the end would bury the run's own last lines
        self.run = wandb.init(project=self.cfg.wandb_project, entity=self.cfg.wandb_entity, mode=self.cfg.wandb_mode,
                              dir=str(self.run_dir), config=self.hparams, name=self.run_dir.name, resume="allow",
                              settings=wandb.Settings(quiet=True))

    def write(self, record: dict) -> None:
        self.run.log(_numeric(record) | {"tokens": record["tokens"]},
                     step=record["step"])

    def close(self) -> None:
        if self.run is not None:
            import wandb

            self.run.finish()
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
