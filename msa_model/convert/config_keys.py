"""config.json keys that are one ModelConfig (or MSAConfig) field each, as tables read by hf-to-msa
and written by msa-to-hf: a field that maps one to one is one line of its family's table
(hf_families, minimax_m3). What is not one key to one field (RoPE, the MoE layout, layer types,
dtype, what a family refuses) stays code beside the table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

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
