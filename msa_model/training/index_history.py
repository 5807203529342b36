"""The index branch's history travels with the checkpoint: whether it was trained.

Each checkpoint records it: a training checkpoint in its indexer warmup state
(`callbacks.indexer_warmup.index_trained`: the run finished its warmup, or started from a trained
index branch), a conversion in its record (`conversion.index_trained`, also in conversion.json:
true when the source checkpoint carried index weights, e.g. MiniMax-M3; false when the branch was
derived or drawn for a dense source). A model without MSA layers has no index branch to train.

What it is for: continuing a model whose indexer already knows what to select (MiniMax-M3, or
one of our MSA runs) needs no dense warmup. A recipe with `trainer.indexer_warmup_from_init`
(`cpt`, `msa_109b_cpt`) starts sparse (warmup 0) from such an `init_from`, and says so, unless
`trainer.indexer_warmup_tokens` is given on the command line.
"""

from __future__ import annotations

from pathlib import Path

WARMUP_KEY = "trainer.indexer_warmup_tokens"


def _step_dir(path: str | Path) -> Path | None:
    from msa_model.training.checkpoint import LATEST, latest_checkpoint
    from msa_model.training.checkpoint_checks import CheckpointError

    path = Path(path)
    try:
        if (path / LATEST).is_file():
            path = latest_checkpoint(path)
    except CheckpointError:
        return None
    return path if path is not None and path.is_dir() else None


def index_branch_trained(path: str | Path) -> bool | None:
    """Whether the checkpoint at `path` (a checkpoint root with `latest`, or a step directory)
    records a trained index branch; None when it records nothing (an older checkpoint) or cannot
    be read (the load that follows names the problem)."""
    return index_branch_history(path)[0]


def _common_state(step: Path) -> dict | None:
    """The common state of the step directory `step`, or None when it cannot be read here (the
    load that follows reports it with its cause)."""
    from msa_model.training.checkpoint_checks import CHECKPOINT_FAILURES, quiet_load

    try:
        from megatron.core import dist_checkpointing

        with quiet_load():
            return dist_checkpointing.load_common_state_dict(str(step))
    except CHECKPOINT_FAILURES:
        return None


def index_branch_history(path: str | Path) -> tuple[bool | None, str]:
    """(`index_branch_trained`, what the checkpoint says of its index branch, for the log)."""
    step = _step_dir(path)
    common = _common_state(step) if step is not None else None
    if common is None:
        return None, "of unknown history"
    model = common.get("model_config") or {}
    if model and model.get("attention") == "dense":
        return False, "absent (a dense checkpoint: it starts fresh)"
    conversion = common.get("conversion")
    if conversion is not None:
        # conversions before the field: the index came from the source, or was made up
        trained = bool(conversion.get("index_trained", conversion.get("index_init") == "from checkpoint"))
        return trained, "trained" if trained else "untrained (derived from a dense model)"
    warmup = (common.get("callbacks") or {}).get("indexer_warmup")
    if warmup is None:
        return None, "of unknown history"
    if "index_trained" in warmup:
        trained = bool(warmup["index_trained"])
        return trained, "trained" if trained else "untrained (its run had not finished the indexer warmup)"
    # checkpoints before the field: a run that switched to top-k had trained it
    if warmup.get("switched_at_step") is not None:
        return True, "trained"
    return None, "of unknown history"


def given_on_command_line(key: str) -> bool:
    """Whether `key` was set on the command line (a Hydra override, `+`/`++` included)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        if not HydraConfig.initialized():
            return False
        overrides = HydraConfig.get().overrides.task
    except (ImportError, ValueError):
        return False
    return any(o.lstrip("+").split("=", 1)[0] == key for o in overrides)


def plan_indexer_warmup(cfg, warmup_given: bool) -> str | None:
    """Apply the index branch's history to the run's indexer warmup (`cfg.trainer.
    indexer_warmup_tokens`, set in place) and return the line that says what was decided, or
    None when the history does not apply (no `trainer.indexer_warmup_from_init`, no
    `init_from`, a model without MSA layers). A relaunch decides again from the same
    `init_from` and command line, so a resumed run keeps the same warmup. `warmup_given`: the
    warmup was set on the command line, which wins."""
    t = cfg.trainer
    if not t.indexer_warmup_from_init or not cfg.init_from or cfg.model.attention != "msa":
        return None
    trained, state = index_branch_history(cfg.init_from)
    if not trained:
        return f"indexer warmup: {t.indexer_warmup_tokens:,} tokens: init_from's index branch is {state}"
    if warmup_given:
        return (f"indexer warmup: {t.indexer_warmup_tokens:,} tokens, as {WARMUP_KEY} says on the command line, "
                "though init_from's index branch is trained")
    recipe_tokens = t.indexer_warmup_tokens
    t.indexer_warmup_tokens = 0
    return (f"indexer warmup: none, sparse attention from the first step: init_from's index branch is trained "
            f"(the recipe's {recipe_tokens:,} warmup tokens skipped; set {WARMUP_KEY} to warm up anyway)")


def resumed_warmup_note(note: str | None, step_dir: Path | None, warmup_tokens: int) -> str | None:
    """`plan_indexer_warmup`'s line for a run that resumes from the step directory `step_dir`
    (None: a new run, the line as it is). Once that checkpoint is past the warmup, init_from's
    history no longer describes the index branch: the line says where the warmup ended instead."""
    if note is None or step_dir is None or warmup_tokens <= 0:
        return note
    common = _common_state(step_dir) or {}
    trainer = common.get("trainer") or {}
    if trainer.get("tokens", -1) < warmup_tokens:
        return note
    switched = ((common.get("callbacks") or {}).get("indexer_warmup") or {}).get("switched_at_step")
    after = f" after step {switched}" if switched is not None else ""
    return (f"indexer warmup: {warmup_tokens:,} tokens, done{after}: the run resumes past it at step "
            f"{trainer['step']} ({trainer['tokens']:,} tokens)")
