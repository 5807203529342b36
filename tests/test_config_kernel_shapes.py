"""Shapes the model and the fused kernels cannot take are refused by `validate`, naming the field,
before anything is built; a ConfigError from train.py is one message and a non-zero exit."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir

from msa_model.config import ConfigError, register_configs, validate
from skeleton_helpers import REPO, _env

register_configs()


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
        return compose("train", overrides=list(overrides))


@pytest.mark.parametrize("override,message", [
    ("model.msa.index_head_dim=7", r"model.msa.index_head_dim \(7\) must be even"),
    ("model.head_dim=33", r"model.head_dim \(33\) must be even"),
])
def test_odd_rotary_dims_are_refused_on_any_device(override, message):
    with pytest.raises(ConfigError, match=message):
        validate(_compose(override), world_size=1, gpu=False)


def test_an_odd_index_dim_does_not_matter_without_an_index_branch():
    validate(_compose("recipe=dense", "model.msa.index_head_dim=7"), world_size=1, gpu=True)


@pytest.mark.parametrize("overrides,field", [
    (["model.msa.index_head_dim=24"], "model.msa.index_head_dim (24) must be a power of two >= 16"),
    (["model.msa.index_head_dim=8"], "model.msa.index_head_dim (8) must be a power of two >= 16"),
    (["model.head_dim=48"], "model.head_dim (48) must be a power of two in [16, 256]"),
    (["model.msa.block_size=256", "model.seq_length=2048"], "model.msa.block_size (256) must be a power of two in [16, 128]"),
    (["model.msa.block_size=8"], "model.msa.block_size (8) must be a power of two in [16, 128]"),
])
def test_the_triton_kernels_shapes_are_checked_when_they_will_run(overrides, field):
    cfg = _compose(*overrides)
    with pytest.raises(ConfigError) as e:
        validate(cfg, world_size=1, gpu=True)
    assert field in str(e.value)
    # the PyTorch reference (CPU, or asked for) takes them
    validate(cfg, world_size=1, gpu=False)
    validate(_compose(*overrides, "model.msa.backend=reference"), world_size=1, gpu=True)
    # backend=triton means the kernels whatever the machine
    with pytest.raises(ConfigError, match="Triton"):
        validate(_compose(*overrides, "model.msa.backend=triton"), world_size=1, gpu=False)


def test_every_problem_is_listed_at_once():
    with pytest.raises(ConfigError) as e:
        validate(_compose("model.msa.index_head_dim=12", "model.head_dim=20"), world_size=1, gpu=True)
    text = str(e.value)
    assert "model.msa.index_head_dim (12)" in text and "model.head_dim (20)" in text


def test_a_config_error_prints_its_message_and_exits_without_a_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "train.py", "model.msa.index_head_dim=7", f"run_dir={tmp_path}"], cwd=REPO,
                          env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: invalid configuration:"), proc.stderr
    assert "model.msa.index_head_dim (7) must be even" in proc.stderr
    for noise in ("Traceback", "HYDRA_FULL_ERROR", "raise ConfigError"):
        assert noise not in proc.stdout + proc.stderr
