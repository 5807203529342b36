"""The metrics logger's records and its sinks: interval means handed to every sink in the order
given, at each log interval, the last step and a requested stop; metrics.jsonl resumed cleanly."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from msa_model.training.callbacks import TrainState
from msa_model.training.metrics import JsonlFile, MetricsLogger, MetricsSink


class _Sink(MetricsSink):
    def __init__(self, name: str, seen: list):
        self.name, self.seen = name, seen

    def open(self, step: int) -> None:
        self.seen.append((self.name, "open", step))

    def write(self, record: dict) -> None:
        self.seen.append((self.name, record["step"], record["lm_loss"]))

    def close(self) -> None:
        self.seen.append((self.name, "close"))


def _run(logger: MetricsLogger, losses: list[float], start: int = 0, stop_after: int | None = None) -> None:
    trainer = SimpleNamespace(state=TrainState(step=start), device=torch.device("cpu"))
    logger.on_train_start(trainer)
    for loss in losses:
        trainer.state.step += 1
        trainer.state.tokens += 8
        trainer.state.stop_requested = trainer.state.step == stop_after
        logger.on_step_end(trainer, {"lm_loss": loss, "step_tokens": 8})
    logger.on_train_end(trainer)


def test_records_are_interval_means_given_to_each_sink_in_order():
    seen = []
    logger = MetricsLogger([_Sink("a", seen), _Sink("b", seen)], log_interval=3, max_steps=7)
    _run(logger, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])
    assert seen == [("a", "open", 0), ("b", "open", 0),
                    ("a", 3, 2.0), ("b", 3, 2.0), ("a", 6, 5.0), ("b", 6, 5.0), ("a", 7, 7.0), ("b", 7, 7.0),
                    ("a", "close"), ("b", "close")]
    assert logger.last_record["step"] == 7 and logger.last_record["tokens"] == 56


def test_a_requested_stop_writes_the_interval_so_far():
    seen = []
    _run(MetricsLogger([_Sink("a", seen)], log_interval=10, max_steps=100), [1.0, 3.0], start=20, stop_after=22)
    assert seen == [("a", "open", 20), ("a", 22, 2.0), ("a", "close")]


def test_jsonl_of_a_resumed_run_continues_after_its_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _run(MetricsLogger([JsonlFile(path)], log_interval=1, max_steps=6), [1.0, 2.0, 3.0, 4.0])
    # resumed from the checkpoint of step 2: steps 3 and 4 are written again
    _run(MetricsLogger([JsonlFile(path)], log_interval=1, max_steps=6), [30.0, 40.0, 50.0], start=2)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["step"], r["lm_loss"]) for r in records] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0), (5, 50.0)]


def test_each_record_carries_the_phase_it_is_given():
    dense = MetricsLogger([], log_interval=1, max_steps=1)
    _run(dense, [1.0])
    assert dense.last_record["phase"] == "dense"
    records = []
    sink = MetricsSink()
    sink.write = records.append
    # the indexer warmup switches after two steps: the record of the third is the first sparse one
    logger = MetricsLogger([sink], log_interval=1, max_steps=3,
                           phase=lambda: "sparse" if len(records) >= 2 else "warmup")
    _run(logger, [1.0, 2.0, 3.0])
    assert [r["phase"] for r in records] == ["warmup", "warmup", "sparse"]


def test_every_record_has_its_time_and_mean_step_time(monkeypatch):
    """`time` (UNIX seconds) and `step_ms`, the interval's mean step on the host clock (no device
    synchronisation); a measured per-step value (logging.time_modules) is kept as it is."""
    import msa_model.training.metrics as metrics

    clock = {"t": 100.0}
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: clock["t"])
    monkeypatch.setattr(metrics.time, "time", lambda: 1.7e9 + clock["t"])
    records = []
    sink = MetricsSink()
    sink.write = records.append
    logger = MetricsLogger([sink], log_interval=2, max_steps=4)
    trainer = SimpleNamespace(state=TrainState(), device=torch.device("cpu"))
    logger.on_train_start(trainer)
    for step_s in (0.25, 0.75, 2.0, 2.0):
        clock["t"] += step_s
        trainer.state.step += 1
        logger.on_step_end(trainer, {"lm_loss": 1.0, "step_tokens": 8})
    assert [(r["step"], r["step_ms"], r["time"]) for r in records] == [(2, 500.0, 1.7e9 + 101.0),
                                                                       (4, 2000.0, 1.7e9 + 105.0)]
    assert metrics._numeric(records[0])["train/step_ms"] == 500.0  # TensorBoard and wandb get it too

    timed = MetricsLogger([], log_interval=1, max_steps=1)
    trainer = SimpleNamespace(state=TrainState(), device=torch.device("cpu"))
    timed.on_train_start(trainer)
    trainer.state.step = 1
    timed.on_step_end(trainer, {"lm_loss": 1.0, "step_tokens": 8, "step_ms": 12.5})
    assert timed.last_record["step_ms"] == 12.5


def test_flop_rate_in_a_unit_that_shows_it():
    from msa_model.training.metrics import flop_rate

    assert flop_rate(412.34) == "412.3 TFLOP/s"
    assert flop_rate(0.0015) == "1.5 GFLOP/s"
    assert flop_rate(2e-6) == "2.0 MFLOP/s"
    assert flop_rate(None) == "- FLOP/s"


def test_without_a_terminal_short_lines_stand_in_for_the_progress_bar(monkeypatch, caplog):
    """logging.progress_bar=true (the default) with the output redirected: tqdm disables its bar,
    and a short line still follows PROGRESS_S seconds without output."""
    import logging
    import sys

    import msa_model.training.metrics as metrics

    clock = {"t": 0.0}
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: clock["t"])
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    console = metrics.ConsoleLine(max_steps=100, log_interval=50, progress_bar=True)
    console.open(0)
    with caplog.at_level(logging.INFO, logger=metrics.log.name):
        for step in range(1, 4):
            clock["t"] += 20.0
            console.step(step, {"lm_loss": 2.0}, None)
    console.close()
    lines = [r.getMessage() for r in caplog.records if "next full line" in r.getMessage()]
    # the first step's line, then one at step 3 (40 s after it), none at step 2 (20 s)
    assert [line.split("/")[0].split()[-1] for line in lines] == ["1", "3"], lines


def test_an_interval_spanning_the_switch_reports_the_sparse_steps_keys():
    """Two warmup steps (every causal key) then two top-k steps in one interval: the record is
    sparse, so its keys per query are the sparse steps' only (within the top-k budget), it says
    how many steps ran in each phase, and its FLOP rate counts each phase at its own cost."""
    phases = ["warmup", "warmup", "sparse", "sparse"]
    keys = [256.5, 256.5, 120.0, 124.0]
    costs = []

    def flops_per_token(keys_per_query, sparse):
        costs.append((keys_per_query, sparse))
        return 1e12 * (keys_per_query if sparse else 1000.0)

    trainer = SimpleNamespace(state=TrainState(), device=torch.device("cpu"))
    logger = MetricsLogger([], log_interval=4, max_steps=8, flops_per_token=flops_per_token,
                           phase=lambda: phases[min(trainer.state.step, 4) - 1])
    logger.on_train_start(trainer)
    for k in keys:
        trainer.state.step += 1
        logger.on_step_end(trainer, {"lm_loss": 1.0, "step_tokens": 8, "keys_per_query": k})
    r = logger.last_record
    assert (r["phase"], r["keys_per_query"], r.get("phase_steps")) == ("sparse", 122.0, {"warmup": 2, "sparse": 2})
    from msa_model.training.metrics import _phase_text

    assert _phase_text(r) == "sparse (2 of 4 steps; 2 warmup)"
    assert sorted(costs, key=str) == [(122.0, True), (256.5, False)]
    assert r["tflops_per_gpu"] == pytest.approx((1000.0 + 122.0) / 2 * r["tokens_per_s"])
    # a next interval of one phase is as before: no phase_steps, the phase alone
    for k in (118.0, 126.0, 122.0, 122.0):
        trainer.state.step += 1
        logger.on_step_end(trainer, {"lm_loss": 1.0, "step_tokens": 8, "keys_per_query": k})
    r = logger.last_record
    assert (r["keys_per_query"], "phase_steps" in r, _phase_text(r)) == (122.0, False, "sparse")


def test_a_dense_step_after_the_warmup_is_costed_as_the_warmup_costs_a_step():
    """trainer.indexer_dense_interval runs one step in N as a warmup step (dense attention and the
    dense KL, no block selection): its FLOPs are the warmup's, not a sparse step's at the dense
    step's keys per query (which adds a selection it does not run)."""
    phases = ["dense-step", "sparse", "sparse", "sparse"]
    costs = []

    def flops_per_token(keys_per_query, sparse):
        costs.append((keys_per_query, sparse))
        return 1e12

    trainer = SimpleNamespace(state=TrainState(), device=torch.device("cpu"))
    logger = MetricsLogger([], log_interval=4, max_steps=8, flops_per_token=flops_per_token,
                           phase=lambda: phases[trainer.state.step - 1])
    logger.on_train_start(trainer)
    for k in (256.5, 120.0, 124.0, 122.0):
        trainer.state.step += 1
        logger.on_step_end(trainer, {"lm_loss": 1.0, "step_tokens": 8, "keys_per_query": k})
    assert sorted(costs, key=str) == [(122.0, True), (256.5, False)]
    assert logger.last_record["phase_steps"] == {"dense-step": 1, "sparse": 3}
