"""msa_model.compat: the private APIs' version check."""

import logging
from importlib import metadata

from msa_model import compat


def test_the_installed_versions_are_the_checked_ones():
    # the CPU venv and the GPU machine run what compat.CHECKED_WITH names; a new one must be checked
    assert compat.untested_versions() == []


def test_another_version_is_named_with_what_was_checked(monkeypatch, caplog):
    monkeypatch.setitem(compat.CHECKED_WITH, "megatron-core", ("0.1",))
    found = compat.untested_versions()
    assert found == [f"megatron-core {metadata.version('megatron-core')} (checked with 0.1)"]
    with caplog.at_level(logging.WARNING):
        compat.warn_untested_versions()
    assert "megatron-core" in caplog.text and "msa_model/compat.py" in caplog.text


def test_a_version_prefix_matches_its_patch_releases(monkeypatch):
    monkeypatch.setattr(compat.metadata, "version", lambda package: "2.11.0+cu130")
    monkeypatch.setattr(compat, "CHECKED_WITH", {"torch": ("2.11",)})
    assert compat.untested_versions() == []
    monkeypatch.setattr(compat, "CHECKED_WITH", {"torch": ("2.1",)})
    assert compat.untested_versions() == ["torch 2.11.0+cu130 (checked with 2.1)"]
