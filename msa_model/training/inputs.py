"""What train.py checks before it writes anything: the inputs a configuration names, the keys the
command line adds, and Hydra's own composition errors, each reported as one line.

`check_inputs(cfg)` looks at the machine and the file system: a CPU run where a GPU is present
(trainer.device=cpu), the corpus directory (data.source, data.glob), the
checkpoint a run starts from (init_from) or resumes (<run_dir>/checkpoints), and whether the model
the run builds is the one such a checkpoint holds. run.py calls it next to
`msa_model.config.validate` and the tokenizer's checks (`msa_model.training.data_setup`:
data.tokenizer, prepared datasets) before the run directory, the data cache or the lock exist, and
reports every problem of them at once (exit code 2).

`output_problems(cfg)` checks that the directories the run writes can be made: no file in the way.

`unknown_keys` finds keys that `+key=value` / `++key=value` put beside the schema (Hydra lets `+`
add keys to any node): they would be silently ignored, so they are refused like a misspelled key.
`composition_error` turns Hydra's multi-line composition errors (unknown key, wrong type, unknown
config group option, unparsable override) into one line naming the override.
"""

from __future__ import annotations

import difflib
import os
import re
import shlex
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from msa_model.config import TrainConfig

LATEST = "latest"  # the pointer file of a checkpoint root (msa_model/training/checkpoint.py)


# -- the command line ------------------------------------------------------------------------------

def task_overrides() -> list[str]:
    """The overrides of the running Hydra job (its command line, or a multirun job's own), else []."""
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            # as given: iterating the config would resolve an interpolation inside an override
            # (`trainer.max_steps=${steps_for_tokens:X}` would come back as the first composition's number)
            return OmegaConf.to_container(HydraConfig.get().overrides.task, resolve=False)
    except (ImportError, ValueError):
        pass
    return []


def _override_key(override: str) -> str:
    """`optim.lr` of `optim.lr=1`, `+optim.lr=1`, `++optim.lr=1`, `~optim.lr`."""
    return override.lstrip("+~").split("=", 1)[0]


def override_for(key: str, overrides: list[str]) -> str | None:
    """The (last) command-line override that sets `key`."""
    found = [o for o in overrides if _override_key(o) == key]
    return found[-1] if found else None


def _schema_keys(path: str) -> list[str]:
    node = OmegaConf.select(OmegaConf.structured(TrainConfig), path) if path else OmegaConf.structured(TrainConfig)
    return [str(k) for k in node.keys()] if isinstance(node, DictConfig) else []


def _did_you_mean(key: str) -> str:
    parent, _, last = key.rpartition(".")
    known = _schema_keys(parent)
    close = difflib.get_close_matches(last, known, n=1)
    if close:
        return f"did you mean {f'{parent}.' if parent else ''}{close[0]}?"
    if known:
        shown = ", ".join(known[:12]) + (", ..." if len(known) > 12 else "")
        return f"{parent or 'the top level'} has: {shown}"
    return "not in the schema"


def unknown_keys(cfg, overrides: list[str] | None = None) -> list[str]:
    """One line per key of `cfg` that the schema (TrainConfig) does not have: what `+key=value`
    adds. The line names the override and the key the user probably meant."""
    overrides = task_overrides() if overrides is None else overrides
    schema = OmegaConf.structured(TrainConfig)
    found: list[str] = []

    def walk(node, ref, prefix: str) -> None:
        known = set(ref.keys())  # (`in` would call a MISSING value absent)
        for key in node.keys():
            path = f"{prefix}{key}"
            if key not in known:
                found.append(path)
                continue
            child, child_ref = node._get_node(key), ref._get_node(key)
            # into dataclass sections only (a dict-typed field takes any key)
            if isinstance(child, DictConfig) and isinstance(child_ref, DictConfig) and \
                    OmegaConf.get_type(child_ref) not in (None, dict):
                walk(child, child_ref, f"{path}.")

    walk(cfg, schema, "")
    lines = []
    for path in found:
        override = override_for(path, overrides) or f"{path}=..."
        lines.append(f"{override}: unknown key {path} ({_did_you_mean(path)}); `+` cannot add keys the "
                     "schema (msa_model/config.py) does not have, they would be ignored")
    return lines


def composition_error(error: BaseException, overrides: list[str]) -> str:
    """Hydra's composition error as one line naming the override: an unknown key, a value of the
    wrong type, a config group option that does not exist, an override that does not parse."""
    from hydra.errors import MissingConfigException, OverrideParseException

    text = str(error)
    cause = error.__cause__
    full_key = getattr(cause, "full_key", None)
    if isinstance(error, MissingConfigException):
        match = re.search(r"Could not find '([^']+)'", text)
        from msa_model.training.model_source import CHECKPOINT_OPTION

        # (a checkpoint's recorded model, stored in-process by model_source, is no preset to offer)
        options = [o for o in re.findall(r"^\t(\S+)$", text, re.M) if o != CHECKPOINT_OPTION]
        if match and "/" in match.group(1):
            group, option = match.group(1).rsplit("/", 1)
            given = override_for(group, overrides) or f"{group}={option}"
            return f"{given}: no {group} named {option!r} (available: {', '.join(options) or 'none'})"
    if isinstance(error, OverrideParseException):
        match = re.search(r"Error parsing override '(.*)'", text)
        detail = [line for line in text.splitlines()[1:] if line.strip() and not line.startswith("See ")]
        what = match.group(1) if match else "an override"
        if match and "=" not in what and not what.startswith("~"):
            return f"{what}: an override needs a value, {what}=VALUE"
        return f"cannot parse {what!r}{': ' + detail[0] if detail else ''} (quote values with special characters)"
    if full_key:
        given = override_for(full_key, overrides) or full_key
        reason = str(cause).splitlines()[0] if cause is not None else ""
        if type(cause).__name__ == "ConfigKeyError" or reason.startswith("Key '"):
            return f"{given}: unknown key {full_key} ({_did_you_mean(full_key)})"
        return f"{given}: {reason}"
    lines = [line.strip() for line in [*text.splitlines(), *(str(cause).splitlines() if cause else [])]]
    keep = [line for line in lines if line and not line.startswith(("full_key:", "reference_type", "object_type",
                                                                     "Set the environment variable"))]
    return "; ".join(keep) or type(error).__name__


# -- the file system --------------------------------------------------------------------------------

def _corpus_problems(data, probing: bool = False) -> list[str]:
    """`probing`: the retrieval probe (trainer.probe_tasks) cuts its haystacks from data.source,
    a run on data.blend too."""
    # prepared datasets (data.blend) are checked with the tokenizer (data_setup.tokenizer_problems)
    if (data.blend and not probing) or data.source is None or data.source == "stdlib":
        return []
    root = Path(data.source)
    what = f"data.source={data.source}"
    if not root.exists():
        return [f"{what}: no such directory (a directory whose files matching data.glob form the corpus, or stdlib)"]
    if not root.is_dir():
        return [f"{what}: a file, not a directory (data.source names the directory, data.glob picks its files: "
                f"data.source={root.parent} data.glob={root.name!r} reads this one; or prepare it, `python -m "
                "data.prepare`, and train on data.blend)"]
    from data.corpus import _EXCLUDED_DIRS

    for path in root.glob(data.glob):
        if path.is_file() and not _EXCLUDED_DIRS.intersection(path.relative_to(root).parts):
            return []
    return [f"data.glob={data.glob!r}: no file under data.source={data.source} matches it "
            "(e.g. data.glob='**/*.txt', or '**/*.jsonl' for the records of .jsonl files)"]


def _directory_problem(key: str, path: str | Path) -> str | None:
    """Why the directory `path` (of config key `key`) cannot be used or made, or None: it, or the
    nearest of its parents that exists, must be a directory this process can write into."""
    p = Path(path).absolute()
    existing = next(q for q in (p, *p.parents) if q.exists())
    if not existing.is_dir():
        return (f"{key}={path}: {existing} is a file, not a directory" if existing == p else
                f"{key}={path}: cannot be made, {existing} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{key}={path}: {existing} is not writable"
    return None


def output_problems(cfg) -> list[str]:
    """The directories a run writes (run_dir, checkpoint.dir, data.cache_dir), checked before any
    of them is made (by the run only: a dry run or a submission may be made on another machine)."""
    dirs = [("run_dir", cfg.run_dir), ("checkpoint.dir", cfg.checkpoint.dir), ("data.cache_dir", cfg.data.cache_dir)]
    return [problem for key, path in dirs if path is not None and (problem := _directory_problem(key, path))]


def checkpoint_step(key: str, path: str | Path) -> tuple[Path | None, str | None]:
    """(the step directory a checkpoint path means, None), or (None, one line saying why there is
    none): a checkpoint root with `latest`, or a step directory itself."""
    p = Path(path)
    where = f"{key}={path}"
    if not p.exists():
        return None, f"{where}: no such directory"
    if not p.is_dir():
        return None, f"{where}: a file, not a checkpoint directory"
    if (p / LATEST).is_file():
        name = (p / LATEST).read_text().strip()
        if not (p / name).is_dir():
            return None, f"{where}: its `latest` names {name}, which does not exist (point it at a step_* directory)"
        return p / name, None
    if (p / "metadata.json").is_file():
        return p, None
    hint = not_a_checkpoint_hint(p, f"{key or 'init_from'}=OUT")
    return None, f"{where}: not a checkpoint (no `latest` file, no metadata.json){hint}"


def not_a_checkpoint_hint(path: str | Path, then: str) -> str:
    """What a directory that is not a checkpoint holds instead, as "; ..." to end a message ("" when
    nothing is recognised): a run directory, step directories without `latest`, a Hugging Face
    model (convert it, then `then`, e.g. "init_from=OUT")."""
    p = Path(path)
    if (p / "checkpoints" / LATEST).is_file():
        return f"; a run directory: its checkpoints are {p / 'checkpoints'}"
    if sorted(p.glob("step_*")):
        return "; it holds step_* directories but no `latest`: name one of them"
    if (p / "config.json").is_file():
        return (f"; a Hugging Face model (config.json): convert it first, `python -m msa_model.convert hf-to-msa "
                f"{path} OUT`, then {then}")
    return ""


def _command(overrides: list[str]) -> str:
    return "python train.py " + " ".join(shlex.quote(o) for o in overrides)


def _model_problems(cfg, key: str, where: str, step: Path, fields, overrides: list[str]) -> list[str]:
    """The run's model against the one a checkpoint records: one line naming the differing fields
    and the command that would take the checkpoint's."""
    from msa_model.training.checkpoint_checks import architecture_diff
    from msa_model.training.model_source import recorded_model_config

    saved = recorded_model_config(step)
    if saved is None:
        return []  # older checkpoints: compared tensor by tensor when loaded
    current = OmegaConf.to_container(cfg.model, resolve=True)
    diff = architecture_diff(saved, current, fields)
    if key == "init_from":
        # a dense checkpoint may start an MSA model: its index branch starts fresh
        diff = [d for d in diff if not (d.startswith("model.attention:") and saved.get("attention") == "dense")]
    if not diff:
        return []
    names = [d.split(":", 1)[0] for d in diff]
    culprits = [o for o in overrides if _override_key(o) == "model"]
    for name in names:
        setting = [o for o in overrides if _override_key(o) == name]
        # the one in effect, and any earlier one that would not give the checkpoint's value either
        culprits += setting[-1:] + [o for o in setting[:-1]
                                    if o.split("=", 1)[-1] != str(_get(saved, name.removeprefix("model.")))]
    culprits = [o for o in overrides if o in culprits]  # in command-line order
    keep = [o for o in overrides if o not in culprits]
    if culprits:
        fix = f"drop {' '.join(culprits)} to train the checkpoint's model: `{_command(keep)}`"
    else:
        restore = [f"{n}={_get(saved, n.removeprefix('model.'))}" for n in names]
        fix = f"set them back: `{_command(keep + restore)}`"
    if key == "init_from":
        fix += ", or init_from_partial=true to load only the tensors whose name and shape match"
    else:
        fix += ", or start a new run (another run_dir=) from its weights with init_from="
    return [f"{where}: the checkpoint holds another model ({'; '.join(diff)}); {fix}"]


def _get(d: dict, dotted: str):
    for part in dotted.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return d


def _checkpoint_problems(cfg, overrides: list[str]) -> list[str]:
    from msa_model.training.checkpoint_checks import FUNCTION_FIELDS, SHAPE_FIELDS

    problems = []
    root = Path(cfg.checkpoint.dir or Path(cfg.run_dir) / "checkpoints")
    resuming = False
    if (root / LATEST).is_file():
        if cfg.resume == "never":
            problems.append(f"resume=never: {root} already holds checkpoints; choose another run_dir "
                            "(or resume=auto to continue it)")
        else:
            step, problem = checkpoint_step("resume", root)
            if problem:
                problems.append(problem.replace(f"resume={root}", f"resume: {root}", 1))
            else:
                resuming = True
                problems += _model_problems(cfg, "resume", f"resume: {step}", step, SHAPE_FIELDS + FUNCTION_FIELDS,
                                            overrides)
    if cfg.init_from:
        step, problem = checkpoint_step("init_from", cfg.init_from)
        if problem:
            problems.append(problem)
        elif not resuming and not cfg.init_from_partial:
            problems += _model_problems(cfg, "init_from", f"init_from={cfg.init_from}", step, SHAPE_FIELDS, overrides)
    return problems


def _device_problems(cfg) -> list[str]:
    import torch

    if cfg.trainer.device == "cpu" and torch.cuda.is_available():
        # megatron-core places rotary tables, optimizer state and streams on the GPU wherever it
        # sees one (msa_model/platform/cpu_shim.py answers those questions only where none is)
        return ["trainer.device=cpu: this machine has a GPU, and megatron-core puts tensors on it wherever it sees "
                "one; to train on the CPU here, hide it (CUDA_VISIBLE_DEVICES= python train.py ...), or drop "
                "trainer.device to use it"]
    return []


def check_inputs(cfg, overrides: list[str] | None = None) -> list[str]:
    """Problems with what the configuration names on the file system, one line each, naming the
    key, the value and what would work; [] when there are none. Reads only: nothing is created.
    `cfg` is the resolved config; `overrides` the command line's (default: the Hydra job's), used
    to say which override to drop."""
    overrides = task_overrides() if overrides is None else overrides
    return [*_device_problems(cfg), *_corpus_problems(cfg.data, bool(cfg.trainer.probe_tasks)),
            *_checkpoint_problems(cfg, overrides)]
