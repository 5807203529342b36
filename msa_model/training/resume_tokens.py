"""A resume whose tokens a step (parallel.global_batch_size x model.seq_length) differ from its
checkpoint's, e.g. a 109B run moved from the 8K layout (4M tokens a step) to the 128K one (8M),
continues by tokens:

- `trainer.max_steps: ${steps_for_tokens:X}` counts from the tokens already trained:
  step + (X - tokens) // tokens a step, rounded down as the resolver rounds (with the checkpoint's
  tokens a step this is the resolver's own number), set before the config is checked
  (trainer.stop_at_step must be below it) by train.py and launch.slurm alike; an integer
  trainer.max_steps is kept as given;
- the lr schedule counts steps of its run's first tokens a step (TrainState.schedule_step_tokens,
  saved in every checkpoint): a step advances it by its tokens over those (Trainer), so
  optim.warmup_steps, decay_steps and schedule_start_step keep their length in tokens, the lr of
  the first resumed step is the one the old run had next, and decay_steps=None ends the decay at
  the run's last step;
- optim.warmup_steps, decay_steps and schedule_start_step written as `${steps_for_tokens:X}` are
  steps of the schedule, so they are resolved at its tokens a step (X // schedule_step_tokens),
  not at the resumed run's, and keep their X tokens;
- the data positions, counted in samples, are converted by tokens when model.seq_length changed,
  and so is the position init_from_data_position continues from a run of another seq_length;
- an integer trainer.max_steps whose decay (optim.decay_steps=None) would then end within the
  warmup is refused before anything starts (megatron's scheduler would stop at it).
One line at the start says what changed; the dry run prints it with the max_steps the run goes to."""

from __future__ import annotations

from pathlib import Path

from msa_model.training.callbacks import TrainState


def resumed_max_steps(saved: TrainState, step_tokens: int, budget: int) -> int:
    """trainer.max_steps of `${steps_for_tokens:budget}` for a run resumed from `saved`'s counters
    at `step_tokens` tokens a step: the steps done and those that train the tokens left."""
    return saved.step + max(0, budget - saved.tokens) // step_tokens


def checkpoint_counters(cfg) -> tuple[TrainState, int | None] | None:
    """(the counters, its run's model.seq_length) of the checkpoint `latest` names in `cfg`'s
    checkpoint directory, read before the config is checked and written. None where nothing is
    resumed or the checkpoint's counters cannot be read (the resume names that checkpoint, or falls
    back to an older one and counts from its counters)."""
    step_tokens = cfg.parallel.global_batch_size * cfg.model.seq_length
    # a batch of no tokens is the config's error (validate names it)
    if cfg.resume == "never" or step_tokens <= 0:
        return None
    from msa_model.training.checkpoint import saved_progress
    from msa_model.training.checkpoint_checks import CheckpointError
    from msa_model.training.data_setup import step_dir_of

    step_dir = step_dir_of(cfg.checkpoint.dir or Path(cfg.run_dir) / "checkpoints")
    if step_dir is None:
        return None
    try:
        return saved_progress(step_dir, step_tokens)
    except CheckpointError:
        return None


def planned_max_steps(cfg, budget: int | None) -> int | None:
    """resumed_max_steps for the checkpoint_counters of `cfg`: trainer.stop_at_step is checked
    against the steps this run goes to, `python -m launch.slurm` writes the config.yaml the job
    writes, and the dry run shows them. None where max_steps is a number (`budget` None) or
    nothing is resumed."""
    counters = checkpoint_counters(cfg) if budget is not None else None
    if counters is None:
        return None
    return resumed_max_steps(counters[0], cfg.parallel.global_batch_size * cfg.model.seq_length, budget)


SCHEDULE_KEYS = ("warmup_steps", "decay_steps", "schedule_start_step")


def schedule_steps_by_tokens(cfg, saved: TrainState | None = None, into=None) -> list[str]:
    """Before `cfg` is resolved: optim.warmup_steps, decay_steps and schedule_start_step that use
    `${steps_for_tokens:X}`, resolved in the steps of the lr schedule that a resumed checkpoint's
    counters name (its run's first tokens a step) where they differ from this run's; the line for
    each key changed (none for a fresh run or a resume at the same tokens a step).

    `saved`: the counters of the checkpoint the resume loads (default: those of the one `latest`
    names, read here). `into`: the config the values go to (default `cfg`): the resolved config of
    a run whose resume=fallback loaded an older checkpoint, `cfg` then an unresolved copy; every
    such key is set there, at this run's tokens a step where the schedule's are the same."""
    from msa_model.config import resolve_with_steps_for_tokens

    if saved is None:
        counters = checkpoint_counters(cfg)
        if counters is None:
            return []
        saved = counters[0]
    schedule_tokens = saved.schedule_step_tokens
    step_tokens = cfg.parallel.global_batch_size * cfg.model.seq_length
    if schedule_tokens in (0, step_tokens):
        if into is None:
            return []
        schedule_tokens = step_tokens
    lines = []
    for key in SCHEDULE_KEYS:
        calls, value = resolve_with_steps_for_tokens(cfg, f"optim.{key}", lambda x: int(x // schedule_tokens))
        if calls:
            setattr((cfg if into is None else into).optim, key, value)
            if schedule_tokens != step_tokens:
                lines.append(f"resume: optim.{key}={value:,} steps of the lr schedule ({schedule_tokens:,} tokens "
                             f"each) from its ${{steps_for_tokens:...}}, not at this run's {step_tokens:,} tokens a step")
    return lines


def schedule_decay_steps(max_steps: int, step_tokens: int, saved: TrainState | None) -> int | float:
    """optim.decay_steps=None: the lr schedule's position after the run's last step, in its steps
    (of `saved.schedule_step_tokens`): trainer.max_steps itself for a fresh run and for a run
    that kept its tokens a step. A fraction where the tokens do not divide."""
    if saved is None:
        return max_steps
    tokens = saved.tokens + (max_steps - saved.step) * step_tokens
    whole, rest = divmod(tokens, saved.schedule_step_tokens)
    return whole if rest == 0 else tokens / saved.schedule_step_tokens


def convert_positions(state: TrainState, seq_from: int, seq_to: int) -> None:
    """Data positions in samples of `seq_from` tokens -> the same tokens in samples of `seq_to`
    (rounded down): the stream of another sample length is another order of the same documents,
    so the position keeps the share of it read, not the samples."""
    for name in ("consumed_samples", "consumed_valid_samples", "start_samples"):
        setattr(state, name, getattr(state, name) * seq_from // seq_to)


def continue_data_position(state: TrainState, position: dict, step_dir: Path, seq_length: int) -> str:
    """init_from_data_position: start `state`'s data stream at `position` (the recorded_data_position
    of the init_from checkpoint at `step_dir`), converted by tokens as a resume's (convert_positions)
    where its run read samples of another length; the line the run logs about it."""
    state.start_samples = state.consumed_samples = position["consumed_samples"]
    line = "init_from_data_position: the data stream continues at sample {}, where the run of {} stopped (its step {})"
    seq_from = position.get("seq_length") or seq_length
    if seq_from == seq_length:
        return line.format(f"{state.consumed_samples:,}", step_dir, position.get("step"))
    convert_positions(state, seq_from, seq_length)
    return (line.format(f"{state.consumed_samples:,} of {seq_length:,} tokens", step_dir, position.get("step"))
            + f" at sample {position['consumed_samples']:,} of {seq_from:,}: as many tokens into the stream (samples "
            "of another model.seq_length are another order of the same documents)")


def schedule_problem(cfg, saved: TrainState | None) -> str | None:
    """An lr decay that would end within the warmup (megatron's scheduler refuses it at start-up):
    an integer trainer.max_steps resumed at fewer tokens a step than the schedule's ends the decay
    (optim.decay_steps=None) after fewer schedule steps than max_steps. None where it does not."""
    o, max_steps = cfg.optim, cfg.trainer.max_steps
    step_tokens = cfg.parallel.global_batch_size * cfg.model.seq_length
    if saved is None or o.decay_steps or step_tokens <= 0:
        return None
    decay = schedule_decay_steps(max_steps, step_tokens, saved)
    if decay > o.warmup_steps:
        return None
    # the fewest steps whose decay ends after the warmup
    least = saved.step + (o.warmup_steps * saved.schedule_step_tokens - saved.tokens) // step_tokens + 1
    return (f"the lr decay would end within the warmup: trainer.max_steps={max_steps:,} at {step_tokens:,} tokens a "
            f"step, resumed from step {saved.step:,} ({saved.tokens:,} tokens), ends the lr schedule at its step "
            f"{decay:g} (its steps are of {saved.schedule_step_tokens:,} tokens), within optim.warmup_steps="
            f"{o.warmup_steps:,}; set trainer.max_steps=${{steps_for_tokens:X}} to train X tokens in all "
            f"(${{steps_for_tokens:{max_steps * saved.schedule_step_tokens}}} keeps {max_steps:,} steps of "
            f"{saved.schedule_step_tokens:,} tokens), raise trainer.max_steps to at least {least:,}, or set "
            f"optim.decay_steps (above {o.warmup_steps:,}, in the schedule's steps)")


def change_line(saved: TrainState, saved_seq: int | None, global_batch_size: int, seq_length: int,
                max_steps: int, budget: int | None) -> str | None:
    """The line a resume at other tokens a step than its checkpoint's logs (None: the same)."""
    step_tokens = global_batch_size * seq_length
    if saved.step_tokens == step_tokens:
        return None
    before = f"{saved.step_tokens:,}"
    if saved_seq and saved.step_tokens % saved_seq == 0:
        before += f" ({saved.step_tokens // saved_seq} x {saved_seq:,})"
    steps = (f"trainer.max_steps={max_steps:,} from ${{steps_for_tokens:{budget:g}}} counted from the trained tokens"
             if budget is not None else f"trainer.max_steps={max_steps:,} as given")
    left = max(0, max_steps - saved.step)
    line = (f"resume: {step_tokens:,} tokens a step ({global_batch_size} x {seq_length:,}), the checkpoint's "
            f"{before}; {saved.tokens:,} tokens trained in {saved.step:,} steps; {steps}: {left:,} steps, "
            f"{left * step_tokens:,} tokens left; the lr schedule goes on by tokens (its steps are of "
            f"{saved.schedule_step_tokens:,} tokens)")
    if saved_seq and saved_seq != seq_length:
        line += (f"; data position {saved.consumed_samples:,} samples of {saved_seq:,} tokens = "
                 f"{saved.consumed_samples * saved_seq // seq_length:,} of {seq_length:,}")
    return line


def resume_preview(cfg, budget: int | None) -> list[str]:
    """The dry run's lines on the resume a run of `cfg` (its max_steps planned) would make: the
    line it logs at the start, and a schedule it would refuse, as a warning."""
    counters = checkpoint_counters(cfg)
    if counters is None:
        return []
    saved, saved_seq = counters
    line = change_line(saved, saved_seq, cfg.parallel.global_batch_size, cfg.model.seq_length,
                       cfg.trainer.max_steps, budget)
    problem = schedule_problem(cfg, saved)
    return [text for text in (line, problem and f"warning: {problem}") if text]
