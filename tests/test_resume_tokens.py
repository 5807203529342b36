"""A resume at other tokens a step than its checkpoint's goes on by tokens: trainer.max_steps of
${steps_for_tokens:X} counts from the tokens trained, the lr schedule keeps its position in tokens
(msa_model/training/resume_tokens.py)."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from skeleton_helpers import TINY_TEST, metrics, run_train

# 8 x 256 tokens a step, the budget 4 such steps; no checkpoint but the ones asked for
BUDGET = 4 * 8 * 256
COMMON = (f"trainer.max_steps=${{steps_for_tokens:{BUDGET}}}", "checkpoint.interval=0", "optim.warmup_steps=1",
          "trainer.indexer_warmup_tokens=0")


def _state(**counters):
    from msa_model.training.callbacks import TrainState

    return TrainState(**counters)


def test_max_steps_counts_the_tokens_left_at_the_new_batch():
    from msa_model.training.resume_tokens import resumed_max_steps

    # the 109B recipe: 200,000 steps of 4M tokens, resumed at 8M
    saved = _state(step=200_000, tokens=200_000 * 2**22, step_tokens=2**22, schedule_step_tokens=2**22)
    max_steps = resumed_max_steps(saved, 2**23, int(3e12))
    assert max_steps == 200_000 + (int(3e12) - 200_000 * 2**22) // 2**23
    assert int(3e12) - 2**23 < saved.tokens + (max_steps - saved.step) * 2**23 <= int(3e12)
    # at the checkpoint's batch: the resolver's own number; a budget already spent: nothing left
    assert resumed_max_steps(saved, 2**22, int(3e12)) == int(3e12) // 2**22
    assert resumed_max_steps(saved, 2**23, 10**9) == 200_000


def test_decay_ends_at_the_last_step_in_the_schedules_own_steps():
    from msa_model.training.resume_tokens import schedule_decay_steps

    # fresh, or resumed at the batch its schedule counts: max_steps as before
    assert schedule_decay_steps(80, 1024, None) == 80
    assert schedule_decay_steps(80, 1024, _state(step=30, tokens=30 * 1024, step_tokens=1024,
                                                 schedule_step_tokens=1024)) == 80
    # 10 steps of 2048 then 12 of 1024: 32,768 tokens, 16 schedule steps of 2048
    assert schedule_decay_steps(22, 1024, _state(step=10, tokens=10 * 2048, step_tokens=2048,
                                                 schedule_step_tokens=2048)) == 16
    # tokens that do not divide: a fraction, not a rounded end
    assert schedule_decay_steps(21, 1024, _state(step=10, tokens=10 * 2048, step_tokens=2048,
                                                 schedule_step_tokens=2048)) == 15.5


def test_older_checkpoints_give_their_tokens_a_step_from_their_counters():
    state = _state(step_tokens=512, schedule_step_tokens=512)
    state.load_state_dict({"step": 5, "consumed_samples": 40, "tokens": 5 * 2048})
    assert (state.step_tokens, state.schedule_step_tokens) == (2048, 2048)
    # saved at step 0: this run's
    state = _state(step_tokens=512, schedule_step_tokens=512)
    state.load_state_dict({"step": 0, "consumed_samples": 0, "tokens": 0})
    assert (state.step_tokens, state.schedule_step_tokens) == (512, 512)


def test_the_warmup_switch_at_the_checkpoint_is_recorded_after_a_smaller_batch():
    """The checkpoint of the last warmup step (its 3rd of 400 tokens began at 800 < 1,000), resumed at
    100 tokens a step: the switch is due at the resumed job's start and recorded there (it was judged
    by the new step's tokens, 1,200 - 100 >= 1,000, and never recorded)."""
    from types import SimpleNamespace

    from msa_model.config import MSAConfig
    from msa_model.training.indexer_warmup import IndexerWarmup

    state = _state(step=3, tokens=1200, step_tokens=400, schedule_step_tokens=400)
    trainer = SimpleNamespace(state=state, model_chunks=[], global_batch_size=1, seq_length=100)
    warmup = IndexerWarmup(1000, MSAConfig())
    warmup.on_step_start(trainer)
    assert warmup.phase == "sparse"
    assert (warmup.switched_at_step, warmup.switched_at_tokens) == (3, 1200)


def test_a_resume_back_in_a_longer_warmup_announces_and_records_the_new_switch(caplog):
    """A run that switched to top-k at step 10 (warmup 40,960 tokens), resumed at step 20 with a
    warmup of 163,840: dense again from step 21, and the switch after step 40 is announced and
    recorded (not the old step 10's record kept, which silenced it)."""
    import logging
    from types import SimpleNamespace

    from msa_model.config import MSAConfig
    from msa_model.training.indexer_warmup import IndexerWarmup

    state = _state(step=20, tokens=81920, step_tokens=4096, schedule_step_tokens=4096)
    trainer = SimpleNamespace(state=state, model_chunks=[], global_batch_size=1, seq_length=4096)
    warmup = IndexerWarmup(163840, MSAConfig())
    warmup.load_state_dict({"warmup_tokens": 40960, "switched_at_step": 10, "switched_at_tokens": 40960,
                            "index_trained": True})
    phases = []
    with caplog.at_level(logging.INFO, logger="msa_model.training.indexer_warmup"):
        for _ in range(30):
            warmup.on_step_start(trainer)
            phases.append(warmup.phase)
            state.step, state.tokens = state.step + 1, state.tokens + 4096
    assert phases == ["warmup"] * 20 + ["sparse"] * 10
    assert (warmup.switched_at_step, warmup.switched_at_tokens) == (40, 163840)
    assert [r.getMessage().split(":")[0] for r in caplog.records if "warmup done" in r.getMessage()] == [
        "indexer warmup done after step 40 (163,840 tokens >= 163,840)"]
    # the branch stays trained (it was, before the longer warmup)
    assert warmup.state_dict()["index_trained"] is True


def test_data_positions_follow_the_tokens_across_sequence_lengths():
    from msa_model.training.resume_tokens import convert_positions

    state = _state(consumed_samples=512 * 3, consumed_valid_samples=64, start_samples=512)
    convert_positions(state, 8192, 131072)
    assert (state.consumed_samples, state.consumed_valid_samples, state.start_samples) == (96, 4, 32)


@pytest.mark.parametrize("raw, budget", [
    ("${steps_for_tokens:3e12}", 3 * 10**12), ("${steps_for_tokens: 8192}", 8192), (80, None),
    # through another key, the tokens an interpolation, or another key holding the resolver
    ("${optim.decay_steps}", 4096), ("${steps_for_tokens:${data.tokens}}", 4 * 10**11),
    ("${oc.select:optim.decay_steps}", 4096), ("${optim.warmup_steps}", None)])
def test_token_budget_is_read_before_resolving(raw, budget):
    from msa_model.config import token_budget

    cfg = OmegaConf.create({"trainer": {"max_steps": raw}, "data": {"tokens": 4e11},
                            "optim": {"decay_steps": "${steps_for_tokens:4096}", "warmup_steps": 8}})
    assert token_budget(cfg) == budget


@pytest.mark.parametrize("raw", ["${steps_for_tokens:4096}0", "${steps_for_tokens:${steps_for_tokens:4096}}",
                                 "${steps_for_tokens:'4096'}", "${optim.decay_steps}"])
def test_a_budget_whose_tokens_cannot_be_read_is_refused(raw):
    """A value made from the resolver's but not equal to it would be counted at the new batch alone."""
    from msa_model.config import ConfigError, token_budget

    cfg = OmegaConf.create({"trainer": {"max_steps": raw}, "optim": {"decay_steps": "${steps_for_tokens:4096}1"}})
    with pytest.raises(ConfigError, match=r"trainer\.max_steps=.* uses \$\{steps_for_tokens:\.\.\.\}"):
        token_budget(cfg)


def test_the_line_names_both_batches_and_what_is_left():
    from msa_model.training.resume_tokens import change_line

    saved = _state(step=3, tokens=3 * 2048, consumed_samples=24, step_tokens=2048, schedule_step_tokens=2048)
    assert change_line(saved, 256, 8, 256, 99, None) is None
    line = change_line(saved, 256, 2, 512, 8, 8192)
    assert "1,024 tokens a step (2 x 512), the checkpoint's 2,048 (8 x 256)" in line
    assert "trainer.max_steps=8 from ${steps_for_tokens:8192}" in line and "5 steps, 5,120 tokens left" in line
    assert "data position 24 samples of 256 tokens = 12 of 512" in line


@pytest.fixture(scope="module")
def half_batch(tmp_path_factory, data_cache):
    """4 steps of 8 x 256 straight; the same run stopped after its first step, a dry run of its
    resume at 4 x 256 a step, then that resume in two jobs (to step 4, then to the end). The run
    directories, the dry run's output and the first resume's process."""
    root = tmp_path_factory.mktemp("half-batch")
    straight, split = root / "straight", root / "split"
    run_train(straight, *COMMON, "parallel.global_batch_size=8", data_cache=data_cache)
    run_train(split, *COMMON, "parallel.global_batch_size=8", "trainer.stop_at_step=1", data_cache=data_cache)
    dry = run_train(split, *COMMON, "parallel.global_batch_size=4", "dry_run=true", data_cache=data_cache).stdout
    proc = run_train(split, *COMMON, "parallel.global_batch_size=4", "trainer.stop_at_step=4", data_cache=data_cache)
    # a second resume at the same batch keeps the first's schedule and max_steps
    run_train(split, *COMMON, "parallel.global_batch_size=4", data_cache=data_cache)
    return straight, split, dry, proc


def test_a_resume_at_half_the_batch_trains_the_budget_on_the_old_runs_schedule(half_batch):
    """4 steps of 8 x 256 straight; the same run stopped after its first step and resumed at 4 x 256
    a step in two jobs: 7 steps, the same tokens, and at every whole schedule position the
    uninterrupted run's lr."""
    straight, split, _, proc = half_batch
    a, b = metrics(straight), metrics(split)
    assert sorted(a) == [1, 2, 3, 4] and sorted(b) == list(range(1, 8))
    assert a[4]["tokens"] == b[7]["tokens"] == BUDGET
    # a step of 4 x 256 is half a schedule step: split step n ends at schedule position (n + 1) / 2
    for n in (1, 3, 5, 7):
        assert b[n]["lr"] == pytest.approx(a[(n + 1) // 2]["lr"], rel=1e-12), n
    assert a[1]["lr"] > b[2]["lr"] > a[2]["lr"] > b[4]["lr"] > a[3]["lr"]
    assert OmegaConf.load(split / "config.yaml").trainer.max_steps == 7
    # the first resume said what changed
    out = proc.stdout + proc.stderr
    assert "1,024 tokens a step (4 x 256), the checkpoint's 2,048 (8 x 256)" in out, out[-3000:]


def test_a_warmup_given_in_tokens_keeps_its_tokens_at_another_batch(tmp_path, data_cache):
    """optim.warmup_steps=${steps_for_tokens:X} is 2 steps of 8 x 256; resumed at 4 x 256 a step
    it stays 2 steps of the schedule (whose steps are the first run's), not 4, so the split run's
    lr is the straight run's at every whole schedule position, and the run says so."""
    warmup = "optim.warmup_steps=${steps_for_tokens:4096}"
    straight = tmp_path / "straight"
    run_train(straight, *COMMON, warmup, "parallel.global_batch_size=8", data_cache=data_cache)
    split = tmp_path / "split"
    run_train(split, *COMMON, warmup, "parallel.global_batch_size=8", "trainer.stop_at_step=1", data_cache=data_cache)
    # launch.slurm and the dry run resolve it as the run will
    from launch.slurm import prepare

    resumed = (*COMMON, warmup, "parallel.global_batch_size=4")
    cfg = prepare([*TINY_TEST, f"run_dir={split}", f"data.cache_dir={data_cache}", *resumed])[2]
    assert (cfg.optim.warmup_steps, cfg.trainer.max_steps) == (2, 7)
    line = "resume: optim.warmup_steps=2 steps of the lr schedule (2,048 tokens each)"
    assert line in run_train(split, *resumed, "dry_run=true", data_cache=data_cache).stdout
    proc = run_train(split, *resumed, data_cache=data_cache)
    a, b = metrics(straight), metrics(split)
    assert sorted(b) == list(range(1, 8))
    for n in (1, 3, 5, 7):
        assert b[n]["lr"] == pytest.approx(a[(n + 1) // 2]["lr"], rel=1e-12), n
    assert OmegaConf.load(split / "config.yaml").optim.warmup_steps == 2
    out = proc.stdout + proc.stderr
    assert line in out, out[-3000:]


def test_a_fallback_past_unreadable_counters_keeps_the_warmups_tokens(tmp_path, data_cache):
    """Steps 1 and 2 of 8 x 256 saved, step 2's counters then cut short: resumed at 4 x 256 with
    resume=fallback, the counters read before the load are none, and the checkpoint loaded (step 1)
    names the schedule's steps: warmup_steps=${steps_for_tokens:4096} is 2 of them, not 4."""
    warmup = "optim.warmup_steps=${steps_for_tokens:4096}"
    run = tmp_path / "run"
    run_train(run, *COMMON, warmup, "parallel.global_batch_size=8", "checkpoint.interval=1",
              "trainer.stop_at_step=2", data_cache=data_cache)
    counters = run / "checkpoints" / "step_00000002" / ".metadata"  # (holds the common state)
    counters.write_bytes(counters.read_bytes()[:100])
    proc = run_train(run, *COMMON, warmup, "parallel.global_batch_size=4", "resume=fallback", "trainer.stop_at_step=2",
                     data_cache=data_cache)
    out = proc.stdout + proc.stderr
    # torch's own report of the unreadable file (a traceback) stays out of it: ours names the file once
    assert "set aside as damaged-step_00000002" in out and "Traceback" not in out, out[-3000:]
    assert "resume: optim.warmup_steps=2 steps of the lr schedule (2,048 tokens each)" in out, out[-3000:]
    saved = OmegaConf.load(run / "config.yaml")
    assert (saved.optim.warmup_steps, saved.trainer.max_steps) == (2, 7)


def test_stop_at_step_is_checked_against_the_steps_the_resume_goes_to(tmp_path, data_cache):
    """4 steps of 4 x 256, resumed at 8 x 256 a step: ${steps_for_tokens} of the new batch alone
    is 4 steps, the run goes to 6. trainer.stop_at_step=5 was refused against the 4, by train.py
    and by launch.slurm (whose config.yaml the job then rewrote)."""
    from launch.slurm import prepare

    run = tmp_path / "run"
    run_train(run, *COMMON, "parallel.global_batch_size=4", "trainer.stop_at_step=4", data_cache=data_cache)
    larger = (*COMMON, "parallel.global_batch_size=8", "trainer.stop_at_step=5")
    cfg = prepare([*TINY_TEST, f"run_dir={run}", f"data.cache_dir={data_cache}", *larger])[2]
    assert (cfg.trainer.max_steps, cfg.trainer.stop_at_step) == (6, 5)
    proc = run_train(run, *larger, data_cache=data_cache, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert sorted(metrics(run)) == [1, 2, 3, 4, 5]
    assert OmegaConf.load(run / "config.yaml").trainer.max_steps == 6


def test_the_dry_run_of_a_resume_at_another_batch_shows_the_steps_it_goes_to(half_batch):
    """1 step of 8 x 256, then a dry run at 4 x 256: it prints the max_steps the run then writes
    (the tokens left counted from the checkpoint's, not ${steps_for_tokens} of the new batch alone)
    and the line the run starts with."""
    from msa_model.training.resume_tokens import resumed_max_steps

    _, run, dry, _ = half_batch
    planned = resumed_max_steps(_state(step=1, tokens=8 * 256), 4 * 256, BUDGET)
    assert planned != BUDGET // (4 * 256)
    assert f"(x {planned} steps = {planned * 4 * 256:,} tokens)" in dry, dry[-3000:]
    assert "1,024 tokens a step (4 x 256), the checkpoint's 2,048 (8 x 256)" in dry
    assert OmegaConf.load(run / "config.yaml").trainer.max_steps == planned == max(metrics(run))


def test_the_fewest_steps_the_schedule_problem_names_end_the_decay_after_the_warmup():
    from msa_model.training.resume_tokens import schedule_decay_steps, schedule_problem

    # 10 steps of 2,048 tokens, resumed at 128 a step: 20 steps end the schedule at its 10.25th
    saved = _state(step=10, tokens=10 * 2048, step_tokens=2048, schedule_step_tokens=2048)
    cfg = OmegaConf.create({"optim": {"decay_steps": None, "warmup_steps": 12}, "trainer": {"max_steps": 20},
                            "parallel": {"global_batch_size": 1}, "model": {"seq_length": 128}})
    problem = schedule_problem(cfg, saved)
    least = int(problem.split("raise trainer.max_steps to at least ")[1].split(",")[0])
    assert schedule_decay_steps(least, 128, saved) > 12 >= schedule_decay_steps(least - 1, 128, saved)
    assert "${steps_for_tokens:40960}" in problem
    cfg.trainer.max_steps = least
    assert schedule_problem(cfg, saved) is None
    # an explicit decay length is the config's (validate checks it against the warmup); a fresh run's
    # decay is max_steps itself
    cfg.trainer.max_steps, cfg.optim.decay_steps = 20, 30
    assert schedule_problem(cfg, saved) is None
    cfg.optim.decay_steps = None
    assert schedule_problem(cfg, None) is None


def test_an_integer_max_steps_resumed_at_a_quarter_of_the_batch_is_refused_before_it_starts(tmp_path, data_cache):
    """4 steps of 8 x 256 with a warmup of 3, stopped at 2 and resumed at 2 x 256: max_steps=4 ends
    the decay at schedule step 2.5, within the warmup. Refused naming the values, by the run (not
    megatron's assertion in the optimizer's set-up), by launch.slurm, and shown by the dry run."""
    from launch.slurm import prepare
    from msa_model.config import ConfigError

    run = tmp_path / "run"
    fixed = ("trainer.max_steps=4", "optim.warmup_steps=3", "checkpoint.interval=0", "trainer.indexer_warmup_tokens=0")
    run_train(run, *fixed, "parallel.global_batch_size=8", "trainer.stop_at_step=2", data_cache=data_cache)
    smaller = (*fixed, "parallel.global_batch_size=2", "parallel.micro_batch_size=1")
    proc = run_train(run, *smaller, data_cache=data_cache, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "AssertionError" not in out, out[-3000:]
    assert ("the lr decay would end within the warmup: trainer.max_steps=4 at 512 tokens a step, resumed from "
            "step 2 (4,096 tokens), ends the lr schedule at its step 2.5") in out, out[-3000:]
    assert sorted(metrics(run)) == [1, 2]
    dry = run_train(run, *smaller, "dry_run=true", data_cache=data_cache).stdout
    assert "warning: the lr decay would end within the warmup" in dry, dry[-3000:]
    with pytest.raises(ConfigError, match="the lr decay would end within the warmup"):
        prepare([*TINY_TEST, f"run_dir={run}", f"data.cache_dir={data_cache}", *smaller])


def test_init_from_data_position_continues_a_run_of_another_seq_length_at_its_tokens(tmp_path, data_cache):
    """2 steps of 4 x 256 read 8 samples; a run of 128-token samples from that checkpoint with
    init_from_data_position starts as many tokens in: at sample 16, and says so."""
    from msa_model.training.checkpoint import saved_progress

    first, second = tmp_path / "first", tmp_path / "second"
    run_train(first, "trainer.max_steps=2", "trainer.indexer_warmup_tokens=0", data_cache=data_cache)
    proc = run_train(second, f"init_from={first / 'checkpoints'}", "init_from_data_position=true",
                     "model.seq_length=128", "trainer.max_steps=1", "trainer.indexer_warmup_tokens=0",
                     "optim.warmup_steps=0", data_cache=data_cache)
    start = 2 * 4 * 256 // 128
    out = proc.stdout + proc.stderr
    assert f"the data stream continues at sample {start} of 128 tokens" in out, out[-3000:]
    assert "at sample 8 of 256" in out
    saved, seq = saved_progress(second / "checkpoints" / "step_00000001", 4 * 128)
    assert (seq, saved.start_samples, saved.consumed_samples) == (128, start, start + 4)
