"""What a relaunch does to the run directory's records: metrics.jsonl rows written after the
checkpoint it resumes from are dropped (they are written again), a changed configuration keeps
the earlier config.yaml, and the config's relative paths are read from the launch directory."""

from __future__ import annotations

import json

from omegaconf import OmegaConf

from msa_model.training.metrics import trim_metrics_after
from msa_model.training.run_dir import write_run_files


def test_trim_metrics_after_the_resume_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "lm_loss": 1.0 / s} for s in (2, 4, 6, 8)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 10, "lm_lo')  # torn by a crash
    assert trim_metrics_after(path, 4) == 3
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [2, 4]
    assert trim_metrics_after(path, 4) == 0
    assert trim_metrics_after(tmp_path / "absent.jsonl", 0) == 0


def test_a_changed_config_keeps_the_earlier_one(tmp_path):
    first, second = OmegaConf.create({"lr": 1e-3}), OmegaConf.create({"lr": 5e-4})
    write_run_files(first, tmp_path)
    write_run_files(first, tmp_path)  # unchanged: nothing kept aside
    assert not (tmp_path / "config.yaml.1").exists()
    write_run_files(second, tmp_path)
    write_run_files(first, tmp_path)
    assert OmegaConf.load(tmp_path / "config.yaml.1").lr == 1e-3
    assert OmegaConf.load(tmp_path / "config.yaml.2").lr == 5e-4
    assert OmegaConf.load(tmp_path / "config.yaml").lr == 1e-3
    assert (tmp_path / "launch.sh").exists() and (tmp_path / "git.txt").exists()


def test_launch_sh_relaunches_with_added_overrides_last(tmp_path, monkeypatch):
    """launch.sh reruns the job's own command in the same run dir; its arguments follow, so an
    override given to it wins over the job's."""
    import subprocess
    import sys

    entry = tmp_path / "entry.py"
    entry.write_text("import sys; print(' '.join(sys.argv[1:]))\n")
    monkeypatch.setattr(sys, "argv", [str(entry), "trainer.max_steps=10", "resume=never"])
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_run_files(OmegaConf.create({"lr": 1e-3}), run_dir)
    out = subprocess.run(["bash", str(run_dir / "launch.sh"), "trainer.max_steps=4"], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["trainer.max_steps=10", f"run_dir={run_dir.resolve()}", "trainer.max_steps=4"]


def test_a_relaunch_through_launch_sh_that_rewrites_it_exits_cleanly(tmp_path, monkeypatch):
    """The relaunch run by launch.sh writes a new launch.sh (its command line has the added
    override); bash, still reading the old script, must not go on into the new one's tail."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    entry = tmp_path / "entry.py"
    # stands for train.py: it records the run files for its own command line, as a run does
    entry.write_text(f"import sys; sys.path.insert(0, {str(repo)!r})\n"
                     "from pathlib import Path\nfrom omegaconf import OmegaConf\n"
                     "from msa_model.training.run_dir import write_run_files\n"
                     f"write_run_files(OmegaConf.create({{}}), Path({str(run_dir)!r}))\n")
    monkeypatch.setattr(sys, "argv", [str(entry), "trainer.max_steps=10"])
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    write_run_files(OmegaConf.create({}), run_dir)
    done = subprocess.run(["bash", str(run_dir / "launch.sh"), "trainer.max_steps=30"], capture_output=True,
                          text=True)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    # the override given to launch.sh replaces the recorded one (the value Hydra applied)
    launch = (run_dir / "launch.sh").read_text()
    assert "trainer.max_steps=30 run_dir=" in launch and "max_steps=10" not in launch
    assert not (run_dir / "launch.sh.tmp").exists()


def test_the_relaunch_command_keeps_the_last_setting_of_each_key(tmp_path, monkeypatch):
    """A key set twice (launch.sh's recorded overrides, then the relaunch's own) appears once, with
    the value Hydra applied; additions and deletions stay as given."""
    import sys

    from msa_model.training.run_dir import relaunch_command

    monkeypatch.setattr(sys, "argv", ["train.py", "model=small", "+foo=1", "optim.lr=1e-3", "model=tiny", "~bar",
                                      "optim.lr=2e-3", "run_dir=/elsewhere"])
    for key in ("SLURM_JOB_ID", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    want = f"train.py +foo=1 model=tiny '~bar' optim.lr=2e-3 run_dir={tmp_path}"
    assert relaunch_command(str(tmp_path)).endswith(want)


def test_a_runs_relative_init_from_is_read_from_its_launch_directory(tmp_path, monkeypatch):
    """msa-to-hf finds the family of a CPT run through its init_from; a relative init_from is
    relative to where the run was launched (launch.sh's cd), wherever the export runs from."""
    import sys

    from msa_model.convert.megatron_io import CONVERSION_FILE, find_conversion_record

    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    (work / "runs" / "llama-msa").mkdir(parents=True)
    (work / "runs" / "llama-msa" / CONVERSION_FILE).write_text(json.dumps({"family": "llama"}))
    run_dir = work / "runs" / "cpt"
    (run_dir / "checkpoints" / "step_00000004").mkdir(parents=True)
    elsewhere.mkdir()
    monkeypatch.setattr(sys, "argv", ["train.py", "init_from=runs/llama-msa"])
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.chdir(work)
    write_run_files(OmegaConf.create({"init_from": "runs/llama-msa"}), run_dir)
    monkeypatch.chdir(elsewhere)
    for src in (run_dir / "checkpoints", run_dir / "checkpoints" / "step_00000004"):
        assert find_conversion_record(src) == {"family": "llama"}


def test_a_changed_config_names_its_keys_and_a_resume_on_another_data_stream_is_warned_of(tmp_path, caplog):
    """A relaunch that leaves out data.blend (or changes the split, the context) would continue the
    step count on other samples without a word."""
    first = OmegaConf.create({"data": {"blend": [[0.7, "runs/data/web"]], "split": [98, 2, 0]},
                              "trainer": {"max_steps": 6}})
    schedule = OmegaConf.merge(first, {"trainer": {"max_steps": 8}})
    other_data = OmegaConf.merge(schedule, {"data": {"blend": None}})
    write_run_files(first, tmp_path)
    with caplog.at_level("INFO", logger="msa_model.training.run_dir"):
        write_run_files(schedule, tmp_path, resuming=True)
    assert [r.levelname for r in caplog.records] == ["INFO"]
    assert "kept as config.yaml.1): trainer.max_steps: 6 -> 8" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="msa_model.training.run_dir"):
        write_run_files(other_data, tmp_path, resuming=True)
    warning = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warning) == 1 and "the data stream changed since the last launch (data.blend)" in warning[0]
    assert "data.blend: [[0.7, 'runs/data/web']] -> None" in caplog.text
    # a new run (nothing to resume) is told what changed, without the warning
    caplog.clear()
    with caplog.at_level("INFO", logger="msa_model.training.run_dir"):
        write_run_files(first, tmp_path, resuming=False)
    assert [r.levelname for r in caplog.records] == ["INFO"]


def test_a_setting_added_since_the_config_was_written_is_no_change_at_its_default(tmp_path, caplog):
    """A run directory written before data.retrieval_min_length existed, resumed: the key at its
    default is no change (and no data-stream warning); set to another value, it is one."""
    older = {"data": {"blend": None, "retrieval_share": 0.5}, "trainer": {"max_steps": 6}}
    now = OmegaConf.merge(older, {"data": {"retrieval_min_length": 0}})
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(older)))
    with caplog.at_level("INFO", logger="msa_model.training.run_dir"):
        write_run_files(now, tmp_path, resuming=True)
    assert caplog.records == [] and not (tmp_path / "config.yaml.1").exists()
    assert "retrieval_min_length: 0" in (tmp_path / "config.yaml").read_text()
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(older)))
    with caplog.at_level("INFO", logger="msa_model.training.run_dir"):
        write_run_files(OmegaConf.merge(now, {"data": {"retrieval_min_length": 128}}), tmp_path, resuming=True)
    assert "the data stream changed since the last launch (data.retrieval_min_length)" in caplog.text


def test_the_relaunch_of_a_relative_run_dir_is_not_a_change(tmp_path, monkeypatch, caplog):
    """launch.sh relaunches with the absolute run_dir of a run started with a relative one: the
    same configuration, so nothing is kept aside and no change is logged."""
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "runs" / "a"
    run_dir.mkdir(parents=True)
    first = OmegaConf.create({"run_dir": "runs/a", "trainer": {"max_steps": 6}})
    write_run_files(first, run_dir)
    with caplog.at_level("INFO", logger="msa_model.training.run_dir"):
        write_run_files(OmegaConf.merge(first, {"run_dir": str(run_dir)}), run_dir, resuming=True)
    assert caplog.records == [] and not (run_dir / "config.yaml.1").exists()
    assert f"run_dir: {run_dir}" in (run_dir / "config.yaml").read_text()
    with caplog.at_level("INFO", logger="msa_model.training.run_dir"):
        write_run_files(OmegaConf.merge(first, {"run_dir": str(tmp_path / "other")}), run_dir, resuming=True)
    assert "run_dir: " in caplog.text and (run_dir / "config.yaml.1").exists()
