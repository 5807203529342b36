"""Bad input stops train.py before anything is written: one line naming the key and the value,
every problem at once, exit code 2, no run directory. Hydra's composition errors (unknown key,
wrong type, unknown config group option) read the same, and `+key=value` cannot slip a key past
the schema."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import OmegaConf

from msa_model.config import register_configs
from msa_model.training.inputs import check_inputs, composition_error, unknown_keys
from skeleton_helpers import REPO, _env

register_configs()


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
        cfg = compose("train", overrides=list(overrides))
    OmegaConf.resolve(cfg)
    return cfg


def _train(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    """train.py as a user runs it, into tmp_path/run."""
    return subprocess.run([sys.executable, "train.py", *overrides, f"run_dir={tmp_path / 'run'}"], cwd=REPO,
                          env=_env(), capture_output=True, text=True, timeout=180)


def _problem_lines(proc) -> list[str]:
    """The error's lines: `error: X`, or `error: invalid configuration:` and `  - X` lines."""
    lines = proc.stderr.strip().splitlines()
    assert lines and lines[0].startswith("error: "), proc.stdout[-2000:] + proc.stderr[-3000:]
    if lines[0] == "error: invalid configuration:":
        assert all(line.startswith("  - ") for line in lines[1:]), lines
        return [line[4:] for line in lines[1:]]
    assert len(lines) == 1, lines
    return [lines[0][len("error: "):]]


# (override, what its one line must say besides the override itself)
BAD_INPUTS = [
    ("data.source=/nonexistent", "no such directory"),
    ("data.tokenizer=gpt2", "does not exist"),
    ("init_from=/nonexistent", "no such directory"),
    ("optim.lrr=0.1", "did you mean optim.lr?"),
    ("+optim.lrr=0.1", "did you mean optim.lr?"),
    ("model.num_layers=four", "could not be converted to Integer"),
    ("model.msa.tuning.sparse_attention.fwd_rowz=32", "did you mean model.msa.tuning.sparse_attention.fwd_rows?"),
    ("recipe=cdt", "available: cpt, dense"),
]


@pytest.mark.parametrize("override, says", BAD_INPUTS, ids=[o for o, _ in BAD_INPUTS])
def test_a_bad_input_is_one_line_exit_2_and_nothing_written(override, says, tmp_path):
    proc = _train(tmp_path, override)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    (line,) = _problem_lines(proc)
    key, value = override.lstrip("+").split("=", 1)
    assert key.split(".")[0] in line and value in line and says in line, line
    assert "Traceback" not in proc.stderr and "HYDRA_FULL_ERROR" not in proc.stderr
    assert not (tmp_path / "run").exists()


def test_every_problem_at_once(tmp_path):
    proc = _train(tmp_path, "data.source=/nonexistent", "data.tokenizer=gpt2", f"init_from={tmp_path}", "optim.lr=-1")
    assert proc.returncode == 2
    lines = _problem_lines(proc)
    assert sorted(next(k for k in ("optim.lr", "data.source", "data.tokenizer", "init_from") if k in line)
                  for line in lines) == ["data.source", "data.tokenizer", "init_from", "optim.lr"], lines
    assert any(line.startswith(f"init_from={tmp_path}: not a checkpoint") for line in lines), lines
    assert not (tmp_path / "run").exists() and not list(tmp_path.iterdir())


def test_init_from_a_hugging_face_directory_names_the_conversion(tmp_path):
    """A Hugging Face model given to init_from as it is: one line, naming the conversion that makes
    a checkpoint of it (not also a second one about the tokenizer it would record)."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (hf / "model.safetensors").write_bytes(b"")
    proc = _train(tmp_path, "recipe=cpt", f"init_from={hf}")
    assert proc.returncode == 2
    assert _problem_lines(proc) == [f"init_from={hf}: not a checkpoint (no `latest` file, no metadata.json); a "
                                    f"Hugging Face model (config.json): convert it first, `python -m "
                                    f"msa_model.convert hf-to-msa {hf} OUT`, then init_from=OUT"]
    assert not (tmp_path / "run").exists()


def test_a_user_who_sets_hydra_full_error_gets_hydras_error(tmp_path):
    env = {**_env(), "HYDRA_FULL_ERROR": "1"}
    proc = subprocess.run([sys.executable, "train.py", "optim.lrr=0.1", f"run_dir={tmp_path / 'run'}"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "ConfigCompositionException" in proc.stderr


def _composition_error(*overrides: str) -> str:
    with pytest.raises(HydraException) as e:
        _compose(*overrides)
    return composition_error(e.value, list(overrides))


def test_composition_errors_in_one_line():
    from hydra.core.config_store import ConfigStore

    from msa_model.training.model_source import CHECKPOINT_OPTION

    # what a run that took its model from a checkpoint leaves in this process is not offered
    ConfigStore.instance().store(group="model", name=CHECKPOINT_OPTION, node={"name": "recorded"})
    assert _composition_error("model.hiden_size=64") == \
        "model.hiden_size=64: unknown key model.hiden_size (did you mean model.hidden_size?)"
    assert _composition_error("model=tinny") == \
        "model=tinny: no model named 'tinny' (available: m3_tiny, msa_109b, msa_109b_proxy, small, tiny)"
    assert _composition_error("parallel.tp=2.5").startswith("parallel.tp=2.5: Value '2.5' of type 'float'")
    assert _composition_error("optim.lr=(").startswith("cannot parse 'optim.lr=('")
    assert _composition_error("trainer.max_steps") == "trainer.max_steps: an override needs a value, " \
                                                       "trainer.max_steps=VALUE"
    assert "\n" not in _composition_error("model.msa=3")


def test_keys_added_with_plus_are_refused():
    overrides = ["+optim.lrr=0.1", "++model.msa.topkk=3", "+foo=1", "optim.lr=0.01"]
    lines = sorted(unknown_keys(_compose(*overrides), overrides))
    assert len(lines) == 3, lines
    assert lines[0].startswith("++model.msa.topkk=3: unknown key model.msa.topkk (did you mean model.msa.topk?)")
    assert lines[1].startswith("+foo=1: unknown key foo")
    assert lines[2].startswith("+optim.lrr=0.1: unknown key optim.lrr (did you mean optim.lr?)")
    assert unknown_keys(_compose("optim.lr=0.01"), ["optim.lr=0.01"]) == []


def test_file_system_checks(tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / "site-packages").mkdir(parents=True)
    (corpus / "site-packages" / "a.py").write_text("x = 1\n")  # not part of a corpus
    (corpus / "notes.txt").write_text("text\n")
    assert check_inputs(_compose(f"data.source={corpus}"), []) == [
        f"data.glob='**/*.py': no file under data.source={corpus} matches it (e.g. data.glob='**/*.txt', "
        "or '**/*.jsonl' for the records of .jsonl files)"]
    assert check_inputs(_compose(f"data.source={corpus}", "data.glob=*.txt"), []) == []
    (line,) = check_inputs(_compose(f"data.source={corpus / 'notes.txt'}"), [])
    assert "a file, not a directory" in line and f"data.source={corpus} data.glob='notes.txt' reads this one" in line

    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000002").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step_00000004\n")
    (line,) = check_inputs(_compose(f"init_from={run}", f"run_dir={tmp_path / 'new'}"), [])
    assert line == f"init_from={run}: not a checkpoint (no `latest` file, no metadata.json); a run directory: " \
                   f"its checkpoints are {run / 'checkpoints'}"
    (line,) = check_inputs(_compose(f"init_from={run / 'checkpoints'}", f"run_dir={tmp_path / 'new'}"), [])
    assert "its `latest` names step_00000004, which does not exist" in line
    (line,) = check_inputs(_compose(f"run_dir={run}", "resume=never"), [])
    assert line.startswith("resume=never: ") and "already holds checkpoints" in line
    (line,) = check_inputs(_compose(f"run_dir={run}"), [])
    assert line.startswith(f"resume: {run / 'checkpoints'}: its `latest` names step_00000004"), line


def test_a_cpu_run_where_a_gpu_is_present_is_refused_with_the_way_out(monkeypatch):
    import torch

    def device_lines(*overrides):
        return [line for line in check_inputs(_compose(*overrides), []) if line.startswith("trainer.device")]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    (line,) = device_lines("trainer.device=cpu")
    assert line.startswith("trainer.device=cpu: this machine has a GPU") and "CUDA_VISIBLE_DEVICES=" in line, line
    assert device_lines("trainer.device=auto") == device_lines("trainer.device=cuda") == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_lines("trainer.device=cpu") == []


def test_directories_the_run_writes_are_checked_before_any_is_made(tmp_path):
    """A file where run_dir, checkpoint.dir or data.cache_dir goes was a traceback from mkdir (the
    data cache's after the run directory existed)."""
    from msa_model.training.inputs import output_problems

    (tmp_path / "file").write_text("x")
    cfg = _compose(f"run_dir={tmp_path / 'file'}", f"checkpoint.dir={tmp_path / 'file' / 'a' / 'b'}",
                   f"data.cache_dir={tmp_path / 'new' / 'cache'}")
    assert output_problems(cfg) == [f"run_dir={tmp_path / 'file'}: {tmp_path / 'file'} is a file, not a directory",
                                    f"checkpoint.dir={tmp_path / 'file' / 'a' / 'b'}: cannot be made, "
                                    f"{tmp_path / 'file'} is a file"]
    proc = _train(tmp_path, f"data.cache_dir={tmp_path / 'file'}")
    assert proc.returncode == 2 and _problem_lines(proc) == [
        f"data.cache_dir={tmp_path / 'file'}: {tmp_path / 'file'} is a file, not a directory"]
    assert not (tmp_path / "run").exists()
