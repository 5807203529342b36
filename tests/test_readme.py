"""The README's commands work as written. Every command of its bash blocks is classified below (a
command this file does not know fails the test, so the README cannot drift away from it):

- run: CPU commands, executed in order in a copy of the repository, in a shell that activated the
  virtualenv exactly as the README says (nothing else puts python or torchrun on the PATH). Runs
  of train.py get overrides appended that shrink the model and the step count (Hydra: the last
  value wins); everything the README passes (recipe, run_dir, init_from, dry_run) stays.
- validate: cluster or GPU commands, composed and validated here for the world size they launch.
- skip: commands that need what a fresh clone does not have (your Hugging Face checkpoint, a SLURM
  job's own files), or that run the test suite itself.

The first run (what `make train` runs) keeps the default logging and also checks what a new user
sees: a line after the first step, no library notices, the run's own summary last.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from launch.slurm import parse_args, world_size
from msa_model.config import register_configs, validate
from skeleton_helpers import REPO

register_configs()

# what makes a CPU run cheap; the README's own arguments come first and stay
SMALL = ["model.num_layers=2", "model.hidden_size=128", "model.ffn_hidden_size=256", "model.moe_ffn_hidden_size=128",
         "model.seq_length=256", "model.msa.block_size=16", "model.msa.topk=4", "parallel.micro_batch_size=2",
         "parallel.global_batch_size=4", "optim.warmup_steps=1", "trainer.max_steps=3",
         "trainer.indexer_warmup_tokens=1024"]
QUIET = ["logging.wandb_mode=disabled", "logging.tensorboard=false"]


def readme_commands() -> list[str]:
    """Every command of the README's bash blocks, continuation lines joined, comments dropped."""
    blocks = re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    commands = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                commands.append(shlex.join(words))
    return commands


def classify(command: str) -> str:
    words = shlex.split(command)
    if words[:2] in (["make", "train"],) or words[:1] in (["torchrun"], ["source"]):
        return "run"
    if words[:2] == ["make", "test"]:
        return "skip"
    if words[:2] == ["python", "train.py"]:
        if any(w.startswith(("model=qwen3", "init_from=runs/qwen3")) for w in words):
            return "skip"  # a conversion of your Hugging Face checkpoint
        if "-m" in words or any(w.startswith(("model=small", "model=msa_109b", "recipe=msa_109b")) for w in words):
            # the 109B dry runs are run by tests/test_recipes.py
            return "validate"
        if any(w.startswith("optim.") for w in words):
            return "validate"  # the path of `make train` with other values: composing them is the test
        return "run"
    if words[:3] == ["python", "-m", "launch.slurm"]:
        return "run" if "--dry-run" in words else "validate"
    if words[:3] in (["python", "-m", "data.prepare"], ["python", "-m", "data.train_tokenizer"]):
        return "skip"  # your corpus (tests/test_data_prepare.py, test_data_tokenizer.py run both on small ones)
    if words[:3] == ["python", "-m", "msa_model.convert"]:
        # hf-to-msa and verify need your Hugging Face checkpoint, and msa-to-hf writes to /tmp/export,
        # outside the test's directory (tests/test_convert_hf.py runs all three on tiny models)
        return "run" if words[3] == "dense-to-msa" else "skip"
    if words[0] == "sbatch":
        return "skip"  # a file the submit command writes on the cluster
    raise AssertionError(f"README command not covered by tests/test_readme.py: {command}")


def _hydra_overrides(words: list[str]) -> list[str]:
    """The overrides the command composes; launch.slurm's options become the launch.* keys they set."""
    if words[:3] == ["python", "-m", "launch.slurm"]:
        return parse_args(words[3:]).overrides
    return [w for w in words if "=" in w and not w.startswith(("-", "hydra."))]


def test_every_readme_command_is_covered():
    kinds = [classify(c) for c in readme_commands()]
    assert kinds.count("run") >= 6 and kinds.count("validate") >= 3, kinds


@pytest.mark.parametrize("command", [c for c in readme_commands() if classify(c) == "validate"])
def test_cluster_and_gpu_commands_validate(command):
    words = shlex.split(command)
    overrides = _hydra_overrides(words)
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
        cfg = compose("train", overrides=[o for o in overrides if not o.startswith("launch=")]
                      + (["launch=slurm"] if "launch=slurm" in overrides else []))
    # the ranks it launches (every launcher and the dry run read launch.*)
    validate(cfg, world_size=world_size(cfg.launch))


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """A copy of the repository, its .venv the one running the tests."""
    dest = tmp_path_factory.mktemp("clone") / "repo"
    shutil.copytree(REPO, dest, ignore=shutil.ignore_patterns(".venv", ".git", "runs", ".cache", "outputs",
                                                                 "__pycache__", ".pytest_cache", "*.egg-info"))
    (dest / ".venv").symlink_to(Path(sys.executable).resolve().parents[1] if not (REPO / ".venv").exists()
                                else (REPO / ".venv").resolve())
    return dest


def _shell(clone: Path, command: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "RANK", "WORLD_SIZE")}
    venv_bin = {str(Path(sys.executable).parent), str(REPO / ".venv" / "bin")}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if p not in venv_bin)
    env["OMP_NUM_THREADS"] = "1"
    # one stream, in the order a terminal shows it
    return subprocess.run(["bash", "-c", command], cwd=clone, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)


@pytest.mark.slow
def test_cpu_commands_run_as_written(clone):
    commands = [c for c in readme_commands() if classify(c) == "run"]
    activate = next(c for c in commands if c.startswith("source "))
    outputs = {}
    for command in commands:
        if command == activate:
            continue
        words = shlex.split(command)
        line = "python train.py" if words[:2] == ["make", "train"] else command
        trains = "train.py" in words or words[:2] == ["make", "train"]
        if trains:
            # the first run keeps the default logging: it is what `make train` shows. A dry run gets
            # the small model too: it shows the model of the checkpoint its run directory holds
            # (the first run's), which the default schedule would not fit
            line += " " + shlex.join(SMALL + ([] if words[:2] == ["make", "train"] else QUIET))
        proc = _shell(clone, f"{activate} && {line}")
        out = proc.stdout
        assert proc.returncode == 0, f"{command}\n{out[-4000:]}"
        assert "nothing to do" not in out, command
        outputs[command] = out

    first = outputs["make train"].strip().splitlines()
    assert any(re.search(r"step 1/3 \| lm [0-9.]+ \| [0-9.]+ s/step", line) for line in first), first[:20]
    assert "finished at step 3 of 3" in first[-2] and "last logged lm loss" in first[-2], first[-4:]
    assert first[-1].endswith("(latest: step_00000003)") and "wandb/" in first[-1], first[-4:]
    for noise in ("Run summary", "Falling back", "full_param_layout", "async save is deprecated",
                  "GPTModel", "UserWarning", "FutureWarning", "Setting accelerator", "0.0 TFLOP/s"):
        assert not [line for line in first if noise in line], (noise, first)
    # the one line that stands for megatron's Transformer Engine / Apex notices
    assert len([line for line in first if "Transformer Engine" in line]) == 1, first
    assert (clone / "runs" / "tiny-pt-dp2" / "checkpoints" / "latest").exists()
    assert (clone / "runs" / "tiny-dense-msa" / "latest").exists()
