"""msa_model.platform.compat: the private APIs' version check."""

import os
import logging
from importlib import metadata

from msa_model.platform import compat


def test_the_installed_versions_are_the_checked_ones():
    # the CPU venv and the GPU machine run what compat.CHECKED_WITH names; a new one must be checked
    assert compat.untested_versions() == []


def test_another_version_is_named_with_what_was_checked(monkeypatch, caplog):
    monkeypatch.setitem(compat.CHECKED_WITH, "megatron-core", ("0.1",))
    found = compat.untested_versions()
    assert found == [f"megatron-core {metadata.version('megatron-core')} (checked with 0.1)"]
    with caplog.at_level(logging.WARNING):
        compat.warn_untested_versions()
    assert "megatron-core" in caplog.text and "msa_model/platform/compat.py" in caplog.text


def test_a_version_prefix_matches_its_patch_releases(monkeypatch):
    monkeypatch.setattr(compat.metadata, "version", lambda package: "2.11.0+cu130")
    monkeypatch.setattr(compat, "CHECKED_WITH", {"torch": ("2.11",)})
    assert compat.untested_versions() == []
    monkeypatch.setattr(compat, "CHECKED_WITH", {"torch": ("2.1",)})
    assert compat.untested_versions() == ["torch 2.11.0+cu130 (checked with 2.1)"]


def test_megatron_imports_without_torch_compile_on_cpu():
    """msa_model/platform/megatron_imports.py: on CPU megatron's fusions are plain functions and importing
    megatron pulls in neither dynamo and inductor nor wandb (seconds of every process start); wandb
    still imports for the runs that log to it."""
    import subprocess
    import sys

    code = ("import sys, msa_model, megatron.core, torch\n"
            "from megatron.core import jit\n"
            "from megatron.core.fusions.fused_bias_geglu import bias_geglu\n"
            "from megatron.core.transformer.moe.router import InferenceTopKRouter\n"
            "assert not torch.cuda.is_available()\n"
            "assert jit.jit_fuser is jit.noop_decorator, jit.jit_fuser\n"
            "assert type(bias_geglu).__name__ == 'function', type(bias_geglu)\n"
            "assert type(InferenceTopKRouter.__dict__['_compiled_topk_routing'].__func__).__name__ == 'function'\n"
            "assert torch.compile.__module__ == 'torch', torch.compile\n"
            "assert 'torch._inductor.compile_fx' not in sys.modules\n"
            "from megatron.core import timers\n"
            "assert timers.wandb is None and 'wandb' not in sys.modules\n"
            "import wandb\n"
            "assert hasattr(wandb, 'init')\n"
            "print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.stdout.strip() == "ok", proc.stdout + proc.stderr[-3000:]
