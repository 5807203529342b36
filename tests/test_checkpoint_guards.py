"""What a relaunch may and may not do with a run's checkpoints: another architecture is refused
naming the fields (init_from may opt in to a partial load), a lower learning rate resumes on the
new schedule, a save replaces a stale step directory left by a rollback, and a damaged checkpoint
or a full disk ends the run with one line naming the checkpoint and the cause."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from msa_model.training.checkpoint_checks import diagnose, unreadable
from skeleton_helpers import metrics, run_train

# steps 1-2 warm the indexer up; checkpoints at 2 and 4; the schedule runs to 6
COMMON = ("trainer.max_steps=6", "trainer.indexer_warmup_tokens=2048", "checkpoint.interval=2", "checkpoint.keep=0")


def _last_line(proc) -> str:
    return proc.stderr.strip().splitlines()[-1]


def _latest(run_dir: Path) -> str:
    return (run_dir / "checkpoints" / "latest").read_text().strip()


@pytest.fixture(scope="module")
def base(tmp_path_factory, data_cache) -> Path:
    """A 2-layer run stopped at step 4 (checkpoints 2 and 4), started over a lock left by a
    process that no longer runs."""
    run_dir = tmp_path_factory.mktemp("guards") / "run"
    run_dir.mkdir()
    (run_dir / "run.lock").write_text(json.dumps({"host": os.uname().nodename, "pid": _dead_pid()}))
    proc = run_train(run_dir, *COMMON, "trainer.stop_at_step=4", data_cache=data_cache)
    assert "taking over the lock of run_dir" in proc.stdout + proc.stderr
    assert not (run_dir / "run.lock").exists() and _latest(run_dir) == "step_00000004"
    return run_dir


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _copy(base: Path, tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(base, run_dir)
    return run_dir


def _lr_schedule(lr: float, steps) -> list[float]:
    """The lr logged after each step (the config's schedule: 1 warmup step, cosine to step 6)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    class _Optimizer:
        param_groups = [{}]

    sched = OptimizerParamScheduler(_Optimizer(), init_lr=0.0, max_lr=lr, min_lr=3e-4, lr_warmup_steps=1,
                                    lr_decay_steps=6, lr_decay_style="cosine", start_wd=0.1, end_wd=0.1,
                                    wd_incr_steps=6, wd_incr_style="constant")
    out = []
    for step in steps:
        sched.num_steps = step
        out.append(sched.get_lr({}))
    return out


def test_resume_refuses_another_architecture(base, tmp_path, data_cache):
    run_dir = _copy(base, tmp_path)
    proc = run_train(run_dir, *COMMON, "model.num_layers=1", data_cache=data_cache, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = _last_line(proc)
    # refused before anything is written, with the relaunch that works
    assert line.startswith("  - resume: ") and "model.num_layers: 2 in the checkpoint, 1 now" in line, line
    assert "drop model.num_layers=1 to train the checkpoint's model" in line, line
    assert _latest(run_dir) == "step_00000004" and not (run_dir / "checkpoints" / "step_00000006").exists()


def test_a_resume_takes_the_model_its_checkpoint_records(base):
    """Without model= on the command line a relaunch trains the checkpoint's model (the 2-layer
    one the run was started with, not the preset's 4 layers); model= chooses the preset."""
    from hydra import compose, initialize_config_dir

    from msa_model.config import register_configs
    from msa_model.training.model_source import take_model_from_checkpoint
    from skeleton_helpers import REPO

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
        overrides = [f"run_dir={base}"]
        cfg, note = take_model_from_checkpoint(compose("train", overrides=overrides), overrides)
        assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.seq_length) == (2, 128, 256)
        assert note.startswith(f"model tiny as recorded by the checkpoint it resumes ({base / 'checkpoints'}"), note
        overrides += ["model=tiny"]
        cfg, note = take_model_from_checkpoint(compose("train", overrides=overrides), overrides)
        assert cfg.model.num_layers == 4 and note is None


def test_launch_slurm_checks_the_job_train_py_would_run(base, tmp_path):
    """launch.slurm composes the model the init_from checkpoint records (2 layers, 256 tokens), not
    the preset's, and skips the warmup of its trained index branch, as the job's train.py will:
    it validated and wrote config.yaml for the preset and warned that the checkpoint holds
    another model."""
    from launch.slurm import prepare
    from msa_model.training.run import input_problems

    overrides = ["recipe=cpt", f"init_from={base / 'checkpoints'}", f"run_dir={tmp_path / 'cpt'}",
                 "launch.gpus_per_node=0"]
    _, script, cfg = prepare(overrides)
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.seq_length) == (2, 128, 256)
    assert cfg.trainer.indexer_warmup_tokens == 0
    assert input_problems(cfg, overrides) == []


def test_a_resume_on_another_tp_names_the_vocabulary_padding(base):
    """The vocabulary (257) is padded to a multiple of make_vocab_size_divisible_by x TP: 320 rows
    at TP=1, 384 at TP=2. A relaunch at TP=2 stopped at the load, after rewriting config.yaml,
    saying the checkpoint was written by a different model; it is named before, with the divisor
    that keeps the checkpoint's rows."""
    from launch.slurm import prepare
    from msa_model.training.run import input_problems

    overrides = [*COMMON, "optim.warmup_steps=1", f"run_dir={base}", "launch.gpus_per_node=0", "launch.ranks_per_node=2", "parallel.tp=2",
                 "parallel.sequence_parallel=true"]
    (line,) = input_problems(prepare(overrides)[2], overrides)
    assert line.startswith(f"resume: {base / 'checkpoints' / 'step_00000004'}: the checkpoint's embedding has 320 "
                           "rows, this run's would have 384"), line
    assert line.endswith("model.make_vocab_size_divisible_by=32 keeps its 320 rows at parallel.tp=2"), line
    overrides.append("model.make_vocab_size_divisible_by=32")
    assert input_problems(prepare(overrides)[2], overrides) == []


def test_init_from_refuses_a_larger_model_unless_partial(base, tmp_path, data_cache):
    args = ("trainer.max_steps=2", "trainer.indexer_warmup_tokens=1024", "model.num_layers=1",
            f"init_from={base / 'checkpoints'}")
    proc = run_train(tmp_path / "strict", *args, data_cache=data_cache, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = _last_line(proc)
    assert "model.num_layers: 2 in the checkpoint, 1 now" in line and "init_from_partial=true" in line, line
    assert not (tmp_path / "strict" / "metrics.jsonl").exists()

    proc = run_train(tmp_path / "partial", *args, "init_from_partial=true", data_cache=data_cache)
    out = proc.stdout + proc.stderr
    assert "(init_from_partial)" in out and "checkpoint tensors unused (decoder.layers.1." in out, out[-3000:]
    # embeddings, layer 0 and the output layer come from a model trained for 4 steps
    assert metrics(tmp_path / "partial")[1]["lm_loss"] < metrics(base)[1]["lm_loss"] - 0.5


def test_a_save_after_a_rollback_replaces_the_stale_step_at_a_lower_lr(base, tmp_path, data_cache):
    run_dir = _copy(base, tmp_path)
    ckpts = run_dir / "checkpoints"
    (ckpts / "latest").write_text("step_00000002\n")
    stale = ckpts / "step_00000004" / "__0_0.distcp"
    stale.write_bytes(stale.read_bytes()[:100])
    proc = run_train(run_dir, *COMMON, "trainer.stop_at_step=4", "optim.lr=0.002", data_cache=data_cache)
    out = proc.stdout + proc.stderr
    assert "resumed from" in out and "step_00000002 at step 2" in out
    assert f"replacing {ckpts / 'step_00000004'}" in out
    assert _latest(run_dir) == "step_00000004" and diagnose(ckpts / "step_00000004") is None
    assert not [p.name for p in ckpts.iterdir() if p.name.startswith(".")]
    # the saved optimizer state does not bring the old learning rate back
    rows = metrics(run_dir)
    assert [rows[s]["lr"] for s in (3, 4)] == pytest.approx(_lr_schedule(0.002, (3, 4)), rel=1e-9)
    assert [rows[s]["lr"] for s in (1, 2)] == pytest.approx(_lr_schedule(0.003, (1, 2)), rel=1e-9)

    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(str(ckpts / "step_00000004"))
    assert common["trainer"]["step"] == 4 and common["model_config"]["num_layers"] == 2


def test_a_damaged_checkpoint_is_named_in_one_line(base, tmp_path, data_cache):
    run_dir = _copy(base, tmp_path)
    step = run_dir / "checkpoints" / "step_00000004"
    data = step / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    proc = run_train(run_dir, *COMMON, data_cache=data_cache, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = _last_line(proc)
    # the manifest check names the file before dist_checkpointing reads it
    assert line.startswith(f"error: resume: {step} is damaged: __0_0.distcp is "), line


def test_a_checkpoint_that_is_not_one_is_named(base, tmp_path):
    from megatron.core import dist_checkpointing

    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "metadata.json").write_bytes(bytes(range(256)))
    with pytest.raises(UnicodeDecodeError) as raised:
        dist_checkpointing.load_tensors_metadata(str(junk))
    message = str(unreadable("init_from", junk, raised.value))
    assert message == f"init_from {junk}: cannot read the checkpoint: metadata.json is not a dist_checkpointing " \
                      "metadata file (not JSON)"
    step = shutil.copytree(base / "checkpoints" / "step_00000002", tmp_path / "step")
    (step / ".metadata").write_bytes(b"\x80\x04junk")
    assert diagnose(step) == ".metadata is damaged (UnpicklingError)"
    (step / ".metadata").unlink()
    assert diagnose(step) == ".metadata is missing"


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs mount of 20 MiB (root only: skipped elsewhere)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(mount)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a small tmpfs")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_fails_the_save_loudly_and_keeps_latest(base, tmp_path, data_cache, small_disk):
    ckpts = small_disk / "checkpoints"
    shutil.copytree(base / "checkpoints" / "step_00000002", ckpts / "step_00000002")
    (ckpts / "latest").write_text("step_00000002\n")
    size = sum(p.stat().st_size for p in (ckpts / "step_00000002").iterdir())
    # room for the copy and part of one more
    filler = small_disk / "filler"
    filler.write_bytes(bytes(max(0, 20 * 2**20 - 2 * size + size // 2)))
    proc = run_train(tmp_path / "run", *COMMON, f"checkpoint.dir={ckpts}", "trainer.stop_at_step=4",
                     data_cache=data_cache, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = _last_line(proc)
    assert line.startswith(f"error: could not save checkpoint {ckpts / 'step_00000004'}") and "(full)" in line, line
    assert line.endswith("`latest` still names step_00000002"), line
    assert (ckpts / "latest").read_text().strip() == "step_00000002"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_00000002"]
