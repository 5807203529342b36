"""The config.json <-> ModelConfig tables drive both directions: every row that hf-to-msa reads
from a family's config comes back under its key from msa-to-hf, and reads back to the same field."""

from __future__ import annotations

import dataclasses

import pytest

from msa_model.convert import minimax_m3 as m3
from msa_model.convert.config_keys import Key, read_keys, write_keys
from msa_model.convert.families import FAMILIES, model_config_from_hf
from msa_model.convert.hf_io import ConversionError
from msa_model.convert.llama_families import MSA_KEYS

from convert_fixtures import _COMMON, M3_TINY, TINY


def _config(family: str) -> dict:
    if family == "minimax_m3":
        return {"architectures": [m3.EXPORT_ARCHITECTURE], **M3_TINY}
    _, architecture, extra = TINY[family]
    return {"architectures": [architecture], **_COMMON, **extra}


def _rows(family: str, model) -> list[tuple[Key, object]]:
    """(row, the object holding its field) of every table the family's translation uses."""
    if family == "minimax_m3":
        return [(k, model) for k in m3.CONFIG_KEYS + m3.MOE_KEYS] + [(k, model.msa) for k in m3.MSA_KEYS]
    return [(k, model) for k in FAMILIES[family].keys] + [(k, model.msa) for k in MSA_KEYS]


@pytest.mark.parametrize("family", [*TINY, "minimax_m3"])
def test_every_row_survives_export_and_import(family):
    fam, model = model_config_from_hf(_config(family))
    exported = fam.hf_config(model)
    _, again = model_config_from_hf(exported)
    assert dataclasses.asdict(again) == dataclasses.asdict(model)
    # what is exported under each key reads back as its field's value (msa.local_blocks = 1 is
    # left out, as its default)
    msa = exported.get("msa", exported)
    for key, owner in _rows(family, model):
        written = (msa if owner is model.msa else exported).get(key.hf, key.default)
        assert key.to_model(written) == getattr(owner, key.field), key


def test_a_missing_required_key_is_named():
    with pytest.raises(ConversionError, match="config.json: missing 'hidden_size'"):
        read_keys(FAMILIES["llama"].keys, {"num_hidden_layers": 2}, "config.json")


def test_defaults_and_aliases():
    table = (Key("a", "a"), Key("b", "b", default=lambda f: 2 * f["a"] + f["c"]), Key("d", "d", aliases=("e",)))
    assert read_keys(table, {"a": 3, "e": "7"}, "x", c=1) == {"a": 3, "b": 7, "d": 7}
    assert write_keys(table, dataclasses.make_dataclass("M", ["a", "b", "d"])(1, 2, 3)) == {"a": 1, "b": 2, "d": 3}
