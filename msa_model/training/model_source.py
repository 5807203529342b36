"""Where a run's model configuration comes from: `model=` on the command line, else the checkpoint
the run starts from.

Every checkpoint records the model it holds: `model_config` in its common state (training runs,
and conversions since they write it), or OUT/model/<name>.yaml next to an older conversion. When
the command line does not choose a model preset (`model=...`), `init_from=DIR` and a resume
(`<run_dir>/checkpoints/latest`, unless resume=never) take that configuration: the run's config
is composed again with the recorded model as the `model` group's option, so what the recipe and
the command line set under `model.*` still applies on top of it, exactly as on top of a preset.
A resume checkpoint wins over init_from (it is what the run loads). What differs from the
checkpoint is then refused before anything is written (msa_model/training/inputs.py), naming the fields.
"""

from __future__ import annotations

import re
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from msa_model.config import ModelConfig

# the `model` group option the recorded configuration is stored as (Hydra's ConfigStore)
CHECKPOINT_OPTION = "_checkpoint_"
CONVERSION_FILE = "conversion.json"  # msa_model/convert/megatron_io.py


def recorded_model_config(step_dir: str | Path) -> dict | None:
    """The model configuration a checkpoint step directory records, or None (no record, or
    unreadable: the load reports that, naming the file)."""
    step_dir = Path(step_dir)
    from megatron.core import dist_checkpointing

    from msa_model.training.checkpoint_checks import CHECKPOINT_FAILURES, quiet_load

    try:
        with quiet_load():
            common = dist_checkpointing.load_common_state_dict(str(step_dir))
    except CHECKPOINT_FAILURES:  # a damaged checkpoint is reported where it is loaded
        common = None
    if isinstance(common, dict) and isinstance(common.get("model_config"), dict):
        return common["model_config"]
    # a conversion from before checkpoints recorded their model: its Hydra model entry
    root = step_dir.parent
    yamls = sorted((root / "model").glob("*.yaml")) if (root / CONVERSION_FILE).is_file() else []
    if len(yamls) == 1:
        return OmegaConf.to_container(OmegaConf.load(yamls[0]), resolve=True)
    return None


def known_model_fields(recorded: dict) -> tuple[dict, list[str]]:
    """The recorded fields this version's ModelConfig has (and the dotted names of those it has not:
    fields of an older or newer version are left out; missing ones take the schema's default)."""
    dropped: list[str] = []

    def keep(values: dict, schema: DictConfig, prefix: str) -> dict:
        out = {}
        for key, value in values.items():
            if key not in schema:
                dropped.append(f"{prefix}{key}")
                continue
            node = schema._get_node(key)
            if isinstance(value, dict) and isinstance(node, DictConfig):
                out[key] = keep(value, node, f"{prefix}{key}.")
            else:
                out[key] = value
        return out

    return keep(recorded, OmegaConf.structured(ModelConfig), "model."), dropped


def model_on_command_line(overrides: list[str]) -> bool:
    """Whether the command line chooses the model group option (`model=...`, `~model`)."""
    return any(re.match(r"^[+~]*model(@[^=]*)?(=|$)", o) for o in overrides)


def _checkpoint_root(cfg) -> Path:
    resolved = OmegaConf.to_container(cfg, resolve=True)
    return Path(resolved["checkpoint"]["dir"] or Path(resolved["run_dir"]) / "checkpoints")


def _step_of(path: str | Path) -> Path | None:
    from msa_model.training.inputs import checkpoint_step

    step, _ = checkpoint_step("", path)
    return step


def _compose(config_name: str, overrides: list[str], recorded: dict, source: str) -> DictConfig:
    from hydra import compose
    from hydra.core.config_store import ConfigStore

    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from msa_model.config import ConfigError

    ConfigStore.instance().store(group="model", name=CHECKPOINT_OPTION, node=recorded)
    try:
        return compose(config_name=config_name, overrides=[*overrides, f"model={CHECKPOINT_OPTION}"])
    except (HydraException, OmegaConfBaseException) as e:
        from msa_model.training.inputs import composition_error

        raise ConfigError(f"{source}: the model configuration the checkpoint records does not compose with this "
                          f"run's: {composition_error(e, overrides)}; pass model=<preset> to choose one") from e


def take_model_from_checkpoint(cfg: DictConfig, overrides: list[str], config_name: str = "train",
                               searchpath: list[str] | None = None) -> tuple[DictConfig, str | None]:
    """`cfg` composed again on the model its resume or init_from checkpoint records, when the command
    line (`overrides`, Hydra's task overrides) chooses no model preset. Returns (config, the line
    the run logs about it, or None when `cfg` is kept). Paths that are not checkpoints are left to
    msa_model.training.inputs.check_inputs, which reports them."""
    if model_on_command_line(overrides):
        return cfg, None
    extra = list(searchpath or [])
    source, recorded, out = None, None, cfg
    if cfg.init_from:
        step = _step_of(cfg.init_from)
        found = recorded_model_config(step) if step is not None else None
        if found is not None:
            source, recorded = f"init_from={cfg.init_from}", found
            out = _compose(config_name, [*overrides, *extra], known_model_fields(found)[0], source)
    if out.resume != "never":
        root = _checkpoint_root(out)
        step = _step_of(root) if (root / "latest").is_file() else None
        found = recorded_model_config(step) if step is not None else None
        if found is not None:
            if found != recorded:
                # the run directory stays where the checkpoint was found (its default names the model)
                run_dir = OmegaConf.to_container(out, resolve=True)["run_dir"]
                out = _compose(config_name, [*overrides, *extra], known_model_fields(found)[0], f"resume: {step}")
                out.run_dir = run_dir
            source, recorded = f"the checkpoint it resumes ({step})", found
    if recorded is None:
        return cfg, None
    _, dropped = known_model_fields(recorded)
    m = out.model
    note = (f"model {m.name} as recorded by {source} ({m.num_layers} layers, hidden {m.hidden_size}, "
            f"{m.attention} attention, context {m.seq_length}); model=<preset> on the command line chooses a preset "
            "instead")
    if dropped:
        note += f"; fields this version does not know were left out: {', '.join(dropped)}"
    return out, note
