"""config.json translation that every family uses.

The keys that are one ModelConfig (or MSAConfig) field each are tables, read by hf-to-msa and
written by msa-to-hf: a field that maps one to one is one line of its family's table
(llama_families, minimax_m3). What is not one key to one field (the MoE layout, layer types,
dtype, what a family refuses) stays code beside the table; RoPE, which every family writes the
same way, and the text config of a vision-language config.json are here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from msa_model.config import RopeScalingConfig
from msa_model.convert.hf_io import ConversionError

REQUIRED = object()


@dataclass(frozen=True)
class Key:
    """config.json `hf` <-> the field `field`.

    Read: the first of `hf`, *`aliases` that is set, else `default` (REQUIRED: an error naming
    `hf`; a callable: default(fields read so far, by field name)), converted by `to_model`.
    Written under `hf`: the field's value, through `to_hf` when given.
    """

    hf: str
    field: str
    to_model: Callable[[Any], Any] = int
    default: Any = REQUIRED
    aliases: tuple[str, ...] = ()
    to_hf: Callable[[Any], Any] | None = None


def lookup(cfg: dict, *names: str, default: Any = None) -> Any:
    """The value of the first of `names` set (not null) in `cfg`, else `default`."""
    for n in names:
        if cfg.get(n) is not None:
            return cfg[n]
    return default


def read_keys(table: tuple[Key, ...], cfg: dict, where: str, **known) -> dict[str, Any]:
    """{field: value} of every row of `table` from config.json `cfg`; `known` fields (not
    returned) are there for the callable defaults."""
    fields: dict[str, Any] = {}
    for key in table:
        value = lookup(cfg, key.hf, *key.aliases)
        if value is None:
            if key.default is REQUIRED:
                raise ConversionError(f"{where}: missing {key.hf!r}")
            value = key.default({**known, **fields}) if callable(key.default) else key.default
        fields[key.field] = key.to_model(value)
    return fields


def write_keys(table: tuple[Key, ...], obj) -> dict[str, Any]:
    """{config.json key: value} of every row of `table` from `obj`'s fields; of two rows with one
    key, the later one is written."""
    return {key.hf: key.to_hf(getattr(obj, key.field)) if key.to_hf else getattr(obj, key.field) for key in table}


def text_config(hf_config: dict) -> dict:
    """The text model's config: `text_config` of a vision-language config.json, else the config."""
    return hf_config.get("text_config") or hf_config


def rope_from_hf(cfg: dict, where: str, default_theta: float = 10000.0) -> tuple[float, RopeScalingConfig]:
    """(theta, scaling) from `rope_parameters` (transformers >= 5) or `rope_theta`/`rope_scaling`;
    a config without a theta has its model's `default_theta` in transformers."""
    params = dict(cfg.get("rope_parameters") or {})
    legacy = cfg.get("rope_scaling") or {}
    theta = float(lookup(params, "rope_theta", default=lookup(cfg, "rope_theta", default=default_theta)))
    kind = lookup(params, "rope_type", "type", default=None) or lookup(legacy, "rope_type", "type", default="default")
    source = params if params.get("factor") is not None or not legacy else legacy
    if kind == "default":
        return theta, RopeScalingConfig()
    if kind == "linear":
        return theta, RopeScalingConfig(type="linear", factor=float(source["factor"]))
    if kind == "llama3":
        return theta, RopeScalingConfig(
            type="llama3", factor=float(source["factor"]),
            low_freq_factor=float(source.get("low_freq_factor", 1.0)),
            high_freq_factor=float(source.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(source.get("original_max_position_embeddings", 8192)))
    raise ConversionError(f"{where}: RoPE scaling type {kind!r} is not supported (supported: default, linear, llama3)")


def rope_to_hf(theta: float, scaling) -> dict:
    """`rope_parameters` of config.json for a rotary base and a RopeScalingConfig."""
    if scaling.type == "none":
        return {"rope_theta": theta, "rope_type": "default"}
    if scaling.type == "linear":
        return {"rope_theta": theta, "rope_type": "linear", "factor": scaling.factor}
    return {"rope_theta": theta, "rope_type": "llama3", "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor, "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings}
