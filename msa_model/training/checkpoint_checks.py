"""What is checked before a checkpoint is trusted, and how its failures are reported.

- The architecture: every trainer checkpoint stores the model config it was written with
  (`model_config` in its common state). `resume=auto` refuses a checkpoint whose architecture
  differs from the run's, and `init_from` one whose parameter shapes differ (unless the run asks
  for a partial load), naming the fields. Checkpoints without it (older ones, conversions) are
  compared tensor by tensor: names and shapes.
- Learning rates: megatron matches saved optimizer param groups to the current ones by a key that
  includes `max_lr`/`min_lr`; a relaunch that changes `optim.lr` gets the saved groups renamed to
  the config's values (the config's schedule wins on resume).
- Errors: a checkpoint that cannot be read is reported in one line naming the checkpoint, the file
  at fault when it can be found (missing, truncated, not a checkpoint), and the cause.
"""

from __future__ import annotations

import contextlib
import json
import logging
import pickle
import re
import warnings
from pathlib import Path
from types import SimpleNamespace

from torch.distributed.checkpoint.api import CheckpointException

log = logging.getLogger(__name__)

# what a failed dist_checkpointing load or save raises (torch's CheckpointException, which
# collects the ranks' errors, is not an Exception)
CHECKPOINT_FAILURES = (Exception, CheckpointException)


class _DcpLoadNoise(logging.Filter):
    """torch.distributed.checkpoint logs a failed metadata read with its traceback on the root
    logger, before raising; the error that follows names the file and the cause once."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "torch/distributed/checkpoint/" not in record.pathname.replace("\\", "/")


@contextlib.contextmanager
def quiet_load():
    """Around a dist_checkpointing load: without what torch.distributed.checkpoint says on every load
    about how megatron calls it (single-process metadata reads, argument order, ShardedTensor) and
    without its tracebacks of a damaged checkpoint, which the caller reports; none of it concerns
    the user."""
    noise = _DcpLoadNoise()
    root = logging.getLogger()
    root.addFilter(noise)
    try:
        with warnings.catch_warnings():
            for message in ("torch.distributed is disabled, unavailable or uninitialized",
                            "The argument order of load has been changed",
                            "Please use DTensor instead and we are deprecating ShardedTensor"):
                warnings.filterwarnings("ignore", message=message)
            yield
    finally:
        root.removeFilter(noise)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used as asked; the message names it and the cause."""


# fields that decide the parameters' names and shapes (the padded vocabulary also depends on the
# tensor-parallel size: the embedding's shape is compared tensor by tensor instead)
SHAPE_FIELDS = ("attention", "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                "num_query_groups", "head_dim", "qk_layernorm", "qkv_bias", "num_experts", "moe_ffn_hidden_size",
                "moe_shared_expert_size", "first_dense_layers", "tie_embeddings", "msa.index_head_dim")
# fields that change what the same weights compute; a resumed run must keep them, a run started
# from another's weights (init_from) may change them on purpose (e.g. RoPE for longer context)
FUNCTION_FIELDS = ("norm_eps", "moe_router_topk", "moe_router_pre_softmax", "rotary_base", "rope_scaling.type",
                   "rope_scaling.factor", "rope_scaling.low_freq_factor", "rope_scaling.high_freq_factor",
                   "rope_scaling.original_max_position_embeddings", "msa.block_size", "msa.topk", "msa.force_sink")
_MSA_ONLY = ("msa.",)


def _get(cfg: dict, dotted: str):
    for part in dotted.split("."):
        if not isinstance(cfg, dict) or part not in cfg:
            return None
        cfg = cfg[part]
    return cfg


def architecture_diff(saved: dict, current: dict, fields: tuple[str, ...]) -> list[str]:
    """`model.<field>: <saved> in the checkpoint, <current> now` for each field that differs.
    Index-branch (msa.*) fields count only when both models are MSA."""
    both_msa = saved.get("attention") == current.get("attention") == "msa"
    out = []
    for name in fields:
        if name.startswith(_MSA_ONLY) and not both_msa:
            continue
        a, b = _get(saved, name), _get(current, name)
        if a != b:
            out.append(f"model.{name}: {_shown(name, a)} in the checkpoint, {_shown(name, b)} now")
    return out


def _shown(name: str, value):
    return "0 (no MoE)" if name == "num_experts" and value == 0 else value


def _sharded_tensors(value) -> list:
    """The ShardedTensors a sharded-state-dict entry stands for (factories built: e.g. the fused
    gate/up projection becomes two tensors under one key)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    if isinstance(value, ShardedTensorFactory):
        value = value.build()
    if isinstance(value, ShardedTensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _sharded_tensors(v)]
    return []


def _model_tensor_shapes(module) -> dict[str, tuple[int, ...]]:
    """Checkpoint key -> global shape of every tensor the whole model would load (factories
    expanded). A pipeline stage holds only its own layers: the stages' sets are gathered, so every
    rank must call this."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    shapes = {t.key: tuple(t.global_shape) for t in _sharded_tensors(module.sharded_state_dict())}
    if dist.is_initialized() and parallel_state.get_pipeline_model_parallel_world_size() > 1:
        group = parallel_state.get_pipeline_model_parallel_group()
        stages = [None] * dist.get_world_size(group)
        dist.all_gather_object(stages, shapes, group=group)
        shapes = {k: v for stage in stages for k, v in stage.items()}
    return shapes


def is_optimizer_key(key: str) -> bool:
    """A checkpoint key of optimizer state: `optimizer.*`, or `chained_<i>.optimizer.*` when the
    optimizer is a chain (expert parallelism gives the experts an optimizer of their own)."""
    return re.match(r"(chained_\d+\.)?optimizer\.", key) is not None


def stored_model_shapes(step_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """Checkpoint key -> global shape of the model tensors (optimizer state left out)."""
    from megatron.core import dist_checkpointing

    meta = dist_checkpointing.load_tensors_metadata(str(step_dir))
    return {k: tuple(v.global_shape) for k, v in meta.items() if not is_optimizer_key(k)}


def tensor_diff(module, step_dir: str | Path, ignore_missing=lambda key: False) -> list[str]:
    """Differences between the tensors `module` has and those the checkpoint holds: unexpected
    ones (the checkpoint's model is larger), missing ones, and shape mismatches."""
    mine, stored = _model_tensor_shapes(module), stored_model_shapes(step_dir)
    extra = sorted(set(stored) - set(mine))
    missing = sorted(k for k in set(mine) - set(stored) if not ignore_missing(k))
    shapes = sorted(f"{k} {list(stored[k])} in the checkpoint, {list(mine[k])} now"
                    for k in set(mine) & set(stored) if mine[k] != stored[k])
    out = []
    for what, keys in (("tensors this model does not have", extra), ("no tensors for", missing),
                       ("other shapes", shapes)):
        if keys:
            out.append(f"{what}: {', '.join(keys[:4])}{f' and {len(keys) - 4} more' if len(keys) > 4 else ''}")
    return out


# the tensors whose rows are the padded vocabulary (megatron's names)
VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")


def vocab_rows_problem(where: str, step_dir: Path, model_cfg, tokenizer_vocab: int, tp: int) -> str | None:
    """Why the checkpoint's embedding rows differ from those this run builds, or None.

    The vocabulary is padded to a multiple of `model.make_vocab_size_divisible_by` times TP, so a
    resume (or init_from) on another tensor-parallel size than the checkpoint's builds an embedding
    of another shape although the model is the same; the line names the divisor that keeps the
    checkpoint's rows on this layout."""
    from msa_model.model.gpt import model_vocab_size, padded_vocab_size

    try:
        stored = stored_model_shapes(step_dir)
    except CHECKPOINT_FAILURES:
        return None  # a damaged checkpoint is reported where it is loaded
    shapes = [stored[k] for k in VOCAB_KEYS if k in stored]
    try:
        rows = model_vocab_size(model_cfg, tokenizer_vocab)
    except ValueError:
        return None  # a model.vocab_size below the tokenizer's is the tokenizer checks' to report
    mine = padded_vocab_size(rows, model_cfg, tp)
    if not shapes or shapes[0][1:] != (model_cfg.hidden_size,) or shapes[0][0] == mine:
        return None  # another hidden size is the architecture checks' to report
    theirs = shapes[0][0]
    divisor = model_cfg.make_vocab_size_divisible_by
    head = (f"{where}: the checkpoint's embedding has {theirs} rows, this run's would have {mine} (the vocabulary, "
            f"{rows}, padded to a multiple of model.make_vocab_size_divisible_by x parallel.tp = {divisor} x {tp}: "
            "the padding follows the tensor-parallel size)")
    fits = [2**i for i in range(theirs.bit_length(), -1, -1)
            if padded_vocab_size(rows, SimpleNamespace(make_vocab_size_divisible_by=2**i), tp) == theirs]
    if fits:
        return f"{head}; model.make_vocab_size_divisible_by={fits[0]} keeps its {theirs} rows at parallel.tp={tp}"
    return f"{head}; no model.make_vocab_size_divisible_by gives {theirs} rows at parallel.tp={tp}: use the checkpoint's layout"


def check_resume_architecture(module, step_dir: Path, saved: dict | None, current: dict | None) -> None:
    """Refuse to resume a run whose model is not the checkpoint's."""
    problems = (architecture_diff(saved, current, SHAPE_FIELDS + FUNCTION_FIELDS)
                if saved is not None and current is not None else [])
    problems += tensor_diff(module, step_dir)
    if problems:
        raise CheckpointError(
            f"resume: {step_dir} was written by a different model ({'; '.join(problems)}). Resume with the "
            "checkpoint's model settings, or start a new run (another run_dir=) from its weights with init_from=")


def check_init_architecture(module, step_dir: Path, saved: dict | None, current: dict | None,
                            is_index_key) -> None:
    """Refuse init_from weights of another shape; note changed non-shape settings."""
    problems = architecture_diff(saved, current, SHAPE_FIELDS) if saved is not None and current is not None else []
    # a dense checkpoint may start an MSA model: its index branch starts fresh
    problems = [p for p in problems if not (p.startswith("model.attention:") and saved.get("attention") == "dense"
                                            and current.get("attention") == "msa")]
    problems += tensor_diff(module, step_dir, ignore_missing=is_index_key)
    if problems:
        raise CheckpointError(
            f"init_from {step_dir}: the checkpoint's model differs from this one ({'; '.join(problems)}). "
            "Leave model= and those model.* overrides off the command line to train the checkpoint's model, or "
            "init_from_partial=true to load only the tensors whose name and shape match")
    if saved is not None and current is not None:
        changed = architecture_diff(saved, current, FUNCTION_FIELDS)
        if changed:
            log.info("init_from: model settings changed from the checkpoint's: %s", "; ".join(changed))


def load_matching_weights(module, step_dir: Path) -> tuple[int, list[str], list[str]]:
    """Load the tensors whose name and shape the checkpoint shares with `module` (init_from with
    init_from_partial=true). Returns (number loaded, checkpoint keys left unused, module keys left
    at their initialisation)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    stored = stored_model_shapes(step_dir)
    sharded = module.sharded_state_dict()
    keep, fresh, used = {}, [], set()
    for name, value in sharded.items():
        leaves = _sharded_tensors(value)
        if not leaves:
            keep[name] = value  # non-tensor state (e.g. _extra_state): loaded if present
        elif all(stored.get(t.key) == tuple(t.global_shape) for t in leaves):
            keep[name] = value
            used.update(t.key for t in leaves)
        else:
            fresh.extend(sorted({t.key for t in leaves}))
    loaded, _, _ = dist_checkpointing.load({"model": keep}, str(step_dir), strict=StrictHandling.RETURN_ALL)
    module.load_state_dict(loaded["model"], strict=False)
    return len(used), sorted(set(stored) - used), fresh


def align_lr_groups(loaded_optimizer_state, optimizer) -> int:
    """Give the saved param groups the current groups' `max_lr`/`min_lr`.

    megatron pairs saved and current param groups by a tuple that includes max_lr and min_lr, so
    a relaunch with another optim.lr finds no partner (KeyError) and, were it found, would run on
    the saved rates. The other parts of the key (weight-decay multiplier, expert flag, ...) still
    decide the pairing. Returns the number of groups changed."""
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

    lr_keys = ("max_lr", "min_lr")
    rest = [k for k in param_group_identifier_keys if k not in lr_keys]
    current = {}
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in opt.param_groups:
            ident = tuple(group.get(k) for k in rest)
            current.setdefault(ident, set()).add(tuple(group.get(k) for k in lr_keys))

    changed = 0

    def visit(node):
        nonlocal changed
        if isinstance(node, dict):
            groups = node.get("param_groups")
            if isinstance(groups, list):
                for group in groups:
                    if not isinstance(group, dict) or "max_lr" not in group:
                        continue
                    targets = current.get(tuple(group.get(k) for k in rest), set())
                    if len(targets) == 1:
                        target = dict(zip(lr_keys, next(iter(targets))))
                        if any(group.get(k) != target[k] for k in lr_keys):
                            group.update(target)
                            changed += 1
            for value in node.values():
                visit(value)
        elif isinstance(node, (list, tuple)):
            for value in node:
                visit(value)

    visit(loaded_optimizer_state)
    return changed


def diagnose(step_dir: str | Path) -> str | None:
    """What is wrong with a dist_checkpointing directory, naming the file; None if nothing found.

    Cheap: reads the two small metadata files and compares every data file's size with the
    extent its index expects (a truncated or missing file); the data itself is not read."""
    step_dir = Path(step_dir)
    if not step_dir.is_dir():
        return f"{step_dir} is not a directory"
    meta_json = step_dir / "metadata.json"
    if not meta_json.is_file():
        return f"{meta_json.name} is missing (not a dist_checkpointing checkpoint)"
    try:
        json.loads(meta_json.read_text())
    except (ValueError, UnicodeDecodeError):
        return f"{meta_json.name} is not a dist_checkpointing metadata file (not JSON)"
    index = step_dir / ".metadata"
    if not index.is_file():
        return f"{index.name} is missing"
    try:
        with open(index, "rb") as f:
            metadata = pickle.load(f)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means the same thing here
        return f"{index.name} is damaged ({type(e).__name__})"
    extents: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        name = getattr(info, "relative_path", None)
        if name is not None:
            extents[name] = max(extents.get(name, 0), int(info.offset) + int(info.length))
    for name, needed in sorted(extents.items()):
        path = step_dir / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size < needed:
            return f"{name} is truncated ({size:,} bytes; its index needs {needed:,})"
    common = step_dir / "common.pt"
    if common.exists():
        import torch

        try:
            torch.load(common, map_location="cpu", weights_only=False)
        except Exception as e:  # noqa: BLE001
            return f"{common.name} is damaged ({type(e).__name__})"
    return None


def describe_error(error: BaseException) -> str:
    """`Type: message` in one line; for torch's CheckpointException, that of the first failed rank."""
    rank = None
    failures = getattr(error, "failures", None)
    if isinstance(error, CheckpointException) and failures:
        rank, failure = next(iter(sorted(failures.items())))
        error = failure[0] if isinstance(failure, tuple) else failure
    text = " ".join(f"{type(error).__name__}: {error}".split())[:300]
    return f"{text} (rank {rank})" if rank is not None else text


def unreadable(what: str, step_dir: str | Path, error: BaseException) -> CheckpointError:
    """One-line CheckpointError for a checkpoint whose loading raised `error`."""
    cause = diagnose(step_dir) or describe_error(error)
    return CheckpointError(f"{what} {step_dir}: cannot read the checkpoint: {cause}")
