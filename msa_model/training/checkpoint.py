"""Atomic megatron dist_checkpointing saves, `resume=auto` and `init_from`.

Layout of a checkpoint root (default <run_dir>/checkpoints):
    step_00000050/        a complete dist_checkpointing directory (model, optimizer, rng, trainer)
    step_00000100/
    latest                text file naming the newest complete step directory
    .tmp-step_00000150/   a save in progress (or one that died): never read, removed on resume
    damaged-step_00000200/  a checkpoint that failed verification, set aside by resume=fallback

A save writes into the .tmp directory, every rank finishes, the ranks hash the files into
`manifest.json` (size and SHA-256 per file, msa_model/training/manifest.py), then rank 0 renames it
into place and replaces `latest` with os.replace, so `latest` only ever names a complete checkpoint.
Every load (resume and init_from) first checks the files against the manifest and refuses a
damaged checkpoint naming the file; `resume=fallback` goes back to the newest older one that
verifies instead.

Saving runs megatron's writer in this process (no helper process): SLURM signals every process of
a job step, and a helper that dies of the stop signal would break the very save the signal asks for.
A step directory already in the way (left behind when `latest` was pointed back at an earlier
step) is replaced: moved aside as .old-step_*, the new one renamed in, then removed.

Content: "model" and "optimizer" are sharded (the distributed optimizer in its fully_reshardable
format, model-shaped optimizer state, so a checkpoint loads at another TP/PP/EP/DP layout); "rng" is one object per rank; "trainer" (counters), "scheduler" (lr schedule) and
"callbacks" (e.g. the indexer warmup) are common state written by rank 0, and so is "model_config"
(the architecture, checked on resume and init_from: checkpoint_checks.py).
"""

from __future__ import annotations

import logging
import os
import queue
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.validation import StrictHandling
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

from msa_model.platform.compat import load_optimizer_state
from msa_model.training.callbacks import Callback, TrainState
from msa_model.training.manifest import (DamagedCheckpointError, check_manifest, describe, verify_checkpoint,
                                         warn_unverified, write_manifest)
from msa_model.training.checkpoint_checks import (CHECKPOINT_FAILURES, CheckpointError, align_lr_groups,
                                                  check_init_architecture, check_resume_architecture, describe_error,
                                                  load_matching_weights, quiet_load, unreadable)

log = logging.getLogger(__name__)

LATEST = "latest"
# model-space optimizer state: dp_reshardable (flat buffers) would only reshard over DP
_OPTIM_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def _writer_in_this_process() -> None:
    """Make megatron's checkpoint writer report its results through an in-process queue.

    The writer's results queue is, by default, a multiprocessing Manager: a separate process,
    started at the first save, that lives as long as the trainer. SLURM delivers stop signals to
    every process of a step, so that helper died of the very USR1/TERM that asked for a stop save,
    and the save crashed (BrokenPipeError); after a kill -9 of the trainer it lived on. Our saves
    are synchronous (the writer runs in the trainer's own thread), so a plain queue serves."""
    if not hasattr(filesystem_async, "_results_queue"):
        raise RuntimeError("megatron.core.dist_checkpointing changed: filesystem_async._results_queue is gone; "
                           "see _writer_in_this_process in msa_model/training/checkpoint.py")
    if not isinstance(filesystem_async._results_queue, queue.Queue):
        filesystem_async._results_queue = queue.Queue()


class _DropAsyncDeprecation(logging.Filter):
    # megatron's synchronous save goes through its (deprecated) async machinery and says so on
    # every run; the notice is about an API we do not call
    def filter(self, record: logging.LogRecord) -> bool:
        return "async save is deprecated" not in record.getMessage()


logging.getLogger("megatron.core.dist_checkpointing.strategies.torch").addFilter(_DropAsyncDeprecation())


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def write_latest(root: Path, name: str) -> None:
    """Point `latest` at the complete save `name`: written aside, synced, then renamed over."""
    pointer_tmp = root / f".{LATEST}.tmp"
    with open(pointer_tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer_tmp, root / LATEST)


def publish_save(root: Path, tmp: Path, name: str) -> Path:
    """Rank 0, once every rank has written the save `tmp` and its manifest: move it into place as
    root/name and point `latest` at it. A directory already named so is set aside first and
    removed only after `latest` names the new save, so a crash at any point leaves `latest`
    naming a complete checkpoint."""
    final, aside = root / name, root / f".old-{name}"
    if final.exists():
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(final, aside)
    os.rename(tmp, final)
    write_latest(root, name)
    shutil.rmtree(aside, ignore_errors=True)
    return final


def latest_checkpoint(root: str | Path) -> Path | None:
    """The complete checkpoint `latest` points at, or None."""
    pointer = Path(root) / LATEST
    if not pointer.is_file():
        return None
    path = Path(root) / pointer.read_text().strip()
    if not path.is_dir():
        # resuming from scratch here would silently throw a run away
        raise CheckpointError(f"{pointer} names {path.name}, which does not exist; point it at a complete "
                                "step_* directory or remove it")
    return path


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _unwrap(chunk):
    return chunk.module if hasattr(chunk, "module") else chunk


def _model_sharded_state_dict(model_chunks) -> dict:
    # one chunk without virtual pipelining; chunk prefixes only matter with several
    assert len(model_chunks) == 1, "virtual pipeline chunks are not supported yet"
    return _unwrap(model_chunks[0]).sharded_state_dict()


def _sharded_state(trainer, is_loading: bool) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model_sd = _model_sharded_state_dict(trainer.model_chunks)
    return {
        "model": model_sd,
        "optimizer": trainer.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=_OPTIM_METADATA),
        "rng": ShardedObject("rng_state", _rng_state(), (world,), (rank,), replica_id=0),
        "world_size": world,
        "trainer": trainer.state.state_dict(),
        "scheduler": trainer.scheduler.state_dict(),
        "callbacks": {cb.name: cb.state_dict() for cb in trainer.callbacks if cb.state_dict() is not None},
    }


def _latest_name(root: Path) -> str | None:
    pointer = root / LATEST
    return pointer.read_text().strip() if pointer.is_file() else None


def save_checkpoint(trainer, root: str | Path, keep: int = 0, model_config: dict | None = None,
                    tokenizer=None) -> Path:
    """Save atomically as <root>/step_<step>; update `latest`; keep the newest `keep` (0 = all).
    `model_config` (the model section of the run's config) is stored for the architecture check;
    `tokenizer` (data/tokenizer.py) is recorded in the step's tokenizer/ folder (data_setup.py)."""
    root = Path(root)
    name = step_dir_name(trainer.state.step)
    tmp, final = root / f".tmp-{name}", root / name
    # rank 0 decides for everyone: ranks that saw the file system differently would split the save
    box = [final.is_dir() and _latest_name(root) == name]
    dist.broadcast_object_list(box, src=0)
    if box[0]:
        # `latest` names a complete save of this very step (a relaunch that ran no step):
        # replacing it would open a window in which `latest` names nothing
        return final
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    state = _sharded_state(trainer, is_loading=False)
    if model_config is not None:
        state["model_config"] = model_config
    _writer_in_this_process()
    try:
        dist_checkpointing.save(state, str(tmp))
    except CHECKPOINT_FAILURES as e:
        if dist.get_rank() == 0:
            # a full disk is the usual cause: free what the failed save took
            shutil.rmtree(tmp, ignore_errors=True)
        free = shutil.disk_usage(root).free
        cause = describe_error(e)
        raise CheckpointError(
            f"could not save checkpoint {final} ({cause}); {free / 2**30:.2f} GiB free on its file system"
            f"{' (full)' if free < 2**26 else ''}; `latest` still names {_latest_name(root)}") from e
    if tokenizer is not None and dist.get_rank() == 0:
        from msa_model.training.data_setup import write_checkpoint_tokenizer

        write_checkpoint_tokenizer(tmp, tokenizer)
    dist.barrier()
    write_manifest(tmp)
    if dist.get_rank() == 0:
        if final.exists():
            # not what `latest` names (checked above): a save left behind by a run whose `latest`
            # was pointed back, possibly damaged; it must not stand in for this one
            log.warning("replacing %s, which `latest` does not name (left by a rolled-back run)", final)
        publish_save(root, tmp, name)
        if keep > 0:
            # only saves older than this one: a newer directory (left by a rollback of `latest`)
            # is not ours to judge, and the one just saved is never pruned
            older = sorted(p for p in root.glob("step_*") if p.name < name)
            for old in older[: max(0, len(older) - (keep - 1))]:
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def _allocate_adam_state(optimizer) -> None:
    """Give every parameter an (empty) Adam state so a fresh optimizer can describe, and then
    receive, the checkpoint's state: megatron's optimizer state_dict needs the step counters."""
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = chained.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                if not inner.state[p]:
                    inner.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                      "exp_avg_sq": torch.zeros_like(p)}


def _restore_adam_steps(optimizer) -> None:
    """Set torch Adam's per-parameter `step` from the step megatron's distributed optimizer keeps
    in each param group. Its own restore leaves the pre-allocated counters in place (and, when
    it does set them, shares one tensor that torch then increments once per parameter), which
    would skew the bias correction of the first update after a resume."""
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = chained.optimizer
        for group in inner.param_groups:
            if "step" not in group:
                continue
            for p in group["params"]:
                if "step" in inner.state[p]:
                    inner.state[p]["step"] = torch.tensor(float(group["step"]), dtype=torch.float32)


DAMAGED_PREFIX = "damaged-"


def resume_checkpoint(root: str | Path, fallback: bool = False) -> Path | None:
    """The checkpoint a resume starts from: `latest`, checked against its manifest; None if
    there is none. Collective across ranks.

    A damaged `latest` is refused (DamagedCheckpointError naming the files) unless `fallback`:
    then the newest older step directory that verifies is used, `latest` is pointed at it and the
    damaged ones are kept aside as damaged-step_* (not loaded, not overwritten by later saves)."""
    root = Path(root)
    latest = latest_checkpoint(root)
    if latest is None:
        return None
    has_manifest, problems = check_manifest(latest)
    if not problems:
        if not has_manifest:
            warn_unverified(latest, "resume:")
        return latest
    if not fallback:
        raise DamagedCheckpointError(
            f"resume: {describe(latest, problems)}. Restore the file, or relaunch with resume=fallback to "
            "resume from the newest older checkpoint that verifies (the damaged one is set aside)")
    damaged, chosen = [(latest, problems)], None
    for candidate in sorted((p for p in root.glob("step_*") if p.is_dir() and p.name < latest.name), reverse=True):
        has_manifest, problems = check_manifest(candidate)
        if not problems:
            chosen = candidate
            break
        damaged.append((candidate, problems))
    if chosen is None:
        raise DamagedCheckpointError(f"resume=fallback: no checkpoint in {root} verifies: "
                                     + " | ".join(describe(d, p) for d, p in damaged))
    if dist.get_rank() == 0:
        for directory, problems in damaged:
            log.warning("resume=fallback: %s; set aside as %s%s", describe(directory, problems),
                        DAMAGED_PREFIX, directory.name)
            aside = root / f"{DAMAGED_PREFIX}{directory.name}"
            shutil.rmtree(aside, ignore_errors=True)
            os.rename(directory, aside)
        write_latest(root, chosen.name)
    dist.barrier()
    if not has_manifest:
        warn_unverified(chosen, "resume:")
    return chosen


def load_checkpoint(trainer, path: str | Path, verify: bool = True, model_config: dict | None = None) -> None:
    """Restore model, optimizer, lr schedule, counters, callbacks and (same world size) RNG.

    With `verify` (skip it only for a directory resume_checkpoint just checked), a file that
    differs from the manifest raises DamagedCheckpointError before anything is loaded. A
    checkpoint of another architecture than `model_config`'s is refused (CheckpointError)."""
    if verify:
        verify_checkpoint(path, "resume:")
    try:
        with quiet_load():
            common = dist_checkpointing.load_common_state_dict(str(path))
    except CHECKPOINT_FAILURES as e:
        raise unreadable("resume:", path, e) from e
    try:
        check_resume_architecture(_unwrap(trainer.model_chunks[0]), Path(path), common.get("model_config"),
                                  model_config)
    except CheckpointError:
        raise
    except CHECKPOINT_FAILURES as e:
        raise unreadable("resume:", path, e) from e
    _allocate_adam_state(trainer.optimizer)
    state = _sharded_state(trainer, is_loading=True)
    same_world = common.get("world_size") == dist.get_world_size()
    if not same_world:
        # per-rank RNG streams cannot be mapped onto a different number of ranks
        log.warning("checkpoint was written by %s ranks, now %s: RNG states are re-seeded, not restored",
                    common.get("world_size"), dist.get_world_size())
        state.pop("rng")
    try:
        with quiet_load():
            loaded = dist_checkpointing.load(state, str(path))
    except CHECKPOINT_FAILURES as e:
        raise unreadable("resume:", path, e) from e
    _unwrap(trainer.model_chunks[0]).load_state_dict(loaded["model"])
    # the config's learning rates win over the saved ones (a relaunch may change optim.lr)
    align_lr_groups(loaded["optimizer"], trainer.optimizer)
    load_optimizer_state(trainer.optimizer, loaded["optimizer"])
    _restore_adam_steps(trainer.optimizer)
    trainer.scheduler.load_state_dict(loaded["scheduler"])
    trainer.state.load_state_dict(loaded["trainer"])
    for cb in trainer.callbacks:
        if cb.name in loaded["callbacks"]:
            cb.load_state_dict(loaded["callbacks"][cb.name])
    if same_world:
        _set_rng_state(loaded["rng"])
    log.info("resumed from %s at step %d (%s tokens, %d samples)", path, trainer.state.step,
             f"{trainer.state.tokens:,}", trainer.state.consumed_samples)


# new in an MSA model converted from a dense one: allowed to be absent from an init_from checkpoint
_NEW_IN_MSA = ("index_q_proj", "index_k_proj", "index_q_layernorm", "index_k_layernorm")


def is_index_branch_key(key: str) -> bool:
    """Whether a checkpoint key belongs to the index branch (absent from dense checkpoints)."""
    return any(n in key for n in _NEW_IN_MSA)


def load_weights(module, step_dir: str | Path, allow_missing_index: bool, what: str = "init_from",
                 error: type[Exception] = KeyError, verify: bool = True) -> int:
    """Load `module`'s parameters (not optimizer or counters) from a checkpoint step directory.

    With `allow_missing_index`, index-branch tensors absent from the checkpoint keep their current
    values; any other absent tensor raises `error` naming it. Returns the number of absent
    index-branch tensors. The trainer's `init_from` and the conversion tools share this rule.
    `verify`: check the manifest first (skip it only for a directory checked just before)."""
    if verify:
        verify_checkpoint(step_dir, what)
    sharded = module.sharded_state_dict()
    # compare keys before loading: a tensor factory (e.g. fused expert weights) without stored
    # values fails deep inside dist_checkpointing with a message that names no parameter
    with quiet_load():
        stored = set(dist_checkpointing.load_tensors_metadata(str(step_dir)))
    wanted = {v.key for v in nested_values(sharded) if isinstance(v, (ShardedTensor, ShardedTensorFactory))}
    bad = sorted(k for k in wanted - stored if not (allow_missing_index and is_index_branch_key(k)))
    if bad:
        raise error(f"{what} {step_dir}: the checkpoint lacks model parameters {bad[:8]}"
                    f"{f' and {len(bad) - 8} more' if len(bad) > 8 else ''} (is it a checkpoint of this model?)")
    with quiet_load():
        loaded, _, absent = dist_checkpointing.load({"model": sharded}, str(step_dir),
                                                    strict=StrictHandling.RETURN_ALL)
    absent = sorted(absent)
    bad = [k for k in absent if not k.endswith("_extra_state") and not (allow_missing_index and is_index_branch_key(k))]
    if bad:
        raise error(f"{what} {step_dir}: the checkpoint lacks model parameters {bad[:8]}")
    module.load_state_dict(loaded["model"], strict=not absent)
    return sum(is_index_branch_key(k) for k in absent)


def load_model_weights(model_chunks, path: str | Path, model_config: dict | None = None,
                       partial: bool = False, verify: bool = True) -> None:
    """Load only the model weights (no optimizer/counters), e.g. a dense GQA checkpoint into MSA.

    `path` is a checkpoint root (its `latest` is used) or a step directory. Index-branch
    parameters missing from the checkpoint keep their fresh initialisation; a checkpoint of
    another shape (fields of `model_config`, or tensor names and shapes) is refused, unless
    `partial`: then the tensors whose name and shape match are loaded and the rest stay fresh.
    `verify`: check the manifest first (the trainer checks it before writing the run's records).
    """
    path = Path(path)
    if (path / LATEST).is_file():
        path = latest_checkpoint(path)
    if path is None or not path.is_dir():
        raise CheckpointError(f"init_from: no checkpoint at {path}")
    assert len(model_chunks) == 1, "virtual pipeline chunks are not supported yet"
    module = _unwrap(model_chunks[0])
    try:
        if partial:
            # (load_weights below checks the manifest itself)
            if verify:
                verify_checkpoint(path, "init_from")
            n, unused, fresh = load_matching_weights(module, path)
            log.info("initialised %d model tensors from %s (init_from_partial); %d checkpoint tensors unused%s, "
                     "%d kept fresh%s", n, path, len(unused), f" ({', '.join(unused[:3])}, ...)" if unused else "",
                     len(fresh), f" ({', '.join(fresh[:3])}, ...)" if fresh else "")
            return
        saved = dist_checkpointing.load_common_state_dict(str(path)).get("model_config")
        check_init_architecture(module, path, saved, model_config, is_index_branch_key)
        fresh = load_weights(module, path, allow_missing_index=True, verify=verify)
    except CheckpointError:
        raise
    except CHECKPOINT_FAILURES as e:
        raise unreadable("init_from", path, e) from e
    log.info("initialised model weights from %s%s", path,
             f" ({fresh} index-branch tensors absent, kept fresh)" if fresh else "")


def saved_progress(step_dir: str | Path, step_tokens: int) -> tuple[TrainState, int | None]:
    """(the counters a training checkpoint saved, its run's model.seq_length), read before
    anything is built: a resume at other tokens a step sets its max_steps and lr schedule from
    them (resume_tokens.py). `step_tokens` (this run's) stands in where an older checkpoint at
    step 0 records none."""
    try:
        with quiet_load():
            common = dist_checkpointing.load_common_state_dict(str(step_dir))
    except CHECKPOINT_FAILURES as e:
        raise unreadable("resume:", step_dir, e) from e
    state = TrainState(step_tokens=step_tokens, schedule_step_tokens=step_tokens)
    state.load_state_dict(common["trainer"])
    return state, (common.get("model_config") or {}).get("seq_length")


def recorded_data_position(step_dir: str | Path) -> dict | None:
    """Where the run behind a checkpoint step directory stopped reading data: {"consumed_samples",
    "seq_length", "step"} from a training checkpoint's counters, or the one a dense-to-msa
    conversion copied from its source; None when the checkpoint records none (a conversion from
    Hugging Face or DeepSpeed)."""
    with quiet_load():
        common = dist_checkpointing.load_common_state_dict(str(step_dir))
    if "trainer" in common:
        return {"consumed_samples": int(common["trainer"]["consumed_samples"]),
                "seq_length": (common.get("model_config") or {}).get("seq_length"),
                "step": int(common["trainer"]["step"])}
    return (common.get("conversion") or {}).get("data_position")


def init_data_position(path: str | Path) -> tuple[dict, Path]:
    """init_from_data_position: (the init_from checkpoint's recorded_data_position, its step
    directory). Raises CheckpointError when it records none."""
    path = Path(path)
    step_dir = latest_checkpoint(path) if (path / LATEST).is_file() else path
    try:
        position = recorded_data_position(step_dir)
    except CHECKPOINT_FAILURES as e:
        raise unreadable("init_from", step_dir, e) from e
    if position is None:
        raise CheckpointError(
            f"init_from_data_position: {step_dir} records no data position (it is neither a training checkpoint "
            "nor a dense-to-msa conversion of one); leave init_from_data_position off to start the data stream "
            "at its beginning")
    return position, step_dir


def cleanup_partial_saves(root: str | Path) -> None:
    """Remove .tmp-* directories of saves that never completed, and .old-* ones a replacing save
    left behind (rank 0 only)."""
    for tmp in [*Path(root).glob(".tmp-step_*"), *Path(root).glob(".old-step_*")]:
        log.warning("removing incomplete checkpoint %s", tmp)
        shutil.rmtree(tmp, ignore_errors=True)


class Checkpointer(Callback):
    """Saves every `interval` steps, on a requested stop, and at the end of training."""

    name = "checkpointer"

    def __init__(self, root: str | Path, interval: int, keep: int, save_at_end: bool, model_config: dict | None = None,
                 tokenizer=None):
        self.root, self.interval, self.keep, self.save_at_end = Path(root), interval, keep, save_at_end
        self.model_config, self.tokenizer = model_config, tokenizer
        self.last_saved_step: int | None = None
        self.last_saved: Path | None = None

    def _save(self, trainer) -> None:
        if self.last_saved_step == trainer.state.step:
            return
        path = save_checkpoint(trainer, self.root, self.keep, self.model_config, self.tokenizer)
        self.last_saved_step, self.last_saved = trainer.state.step, path
        # a stop on a signal reports its checkpoint in its one closing line (run.py)
        if getattr(trainer, "stop_reason", None) is None:
            log.info("saved checkpoint %s", path)

    def on_step_end(self, trainer, metrics: dict) -> None:
        periodic = self.interval > 0 and trainer.state.step % self.interval == 0
        if periodic or trainer.state.stop_requested:
            self._save(trainer)

    def on_train_end(self, trainer) -> None:
        if self.save_at_end:
            self._save(trainer)
