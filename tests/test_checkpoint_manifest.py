"""Checkpoint manifests: every file's size and SHA-256 written at save, checked at load. A flipped
byte in any file of `latest` is refused at resume (and at init_from) naming the file; resume=fallback
goes back to the newest older checkpoint that verifies, only when asked."""

from __future__ import annotations

import json
import shutil

import pytest

from msa_model.training.manifest import MANIFEST, DamagedCheckpointError, check_manifest, verify_checkpoint, write_manifest
from skeleton_helpers import metrics, run_train

COMMON = ("trainer.max_steps=4", "trainer.indexer_warmup_tokens=2048", "checkpoint.interval=2", "checkpoint.keep=0")
COMPARED = ("lm_loss", "kl_loss", "moe_aux_loss", "grad_norm", "lr")


def _flip(path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if offset is None else offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_manifest_names_each_damaged_file(tmp_path):
    d = tmp_path / "step"
    (d / "sub").mkdir(parents=True)
    (d / "a.distcp").write_bytes(bytes(range(256)) * 100)
    (d / "metadata.json").write_text('{"x": 1}')
    (d / "sub" / "b.bin").write_bytes(b"\x00" * 10)
    write_manifest(d)
    files = json.loads((d / MANIFEST).read_text())["files"]
    assert sorted(files) == ["a.distcp", "metadata.json", "sub/b.bin"]
    assert files["a.distcp"]["size"] == 25600
    assert check_manifest(d) == (True, [])

    for name in files:
        original = (d / name).read_bytes()
        _flip(d / name)
        has, problems = check_manifest(d)
        assert has and len(problems) == 1 and problems[0].startswith(f"{name} has different contents"), problems
        with pytest.raises(DamagedCheckpointError, match=f"{d} is damaged: {name} "):
            verify_checkpoint(d)
        (d / name).write_bytes(original)
    (d / "a.distcp").write_bytes(b"short")
    (d / "sub" / "b.bin").unlink()
    assert check_manifest(d)[1] == ["a.distcp is 5 bytes, the manifest says 25,600", "sub/b.bin is missing"]

    (d / MANIFEST).write_text("{not json")
    assert check_manifest(d)[1][0].startswith(f"{MANIFEST} is unreadable")
    (d / MANIFEST).unlink()
    # written before manifests existed: loads as it is (with a warning)
    assert check_manifest(d) == (False, []) and verify_checkpoint(d) is False


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory, data_cache):
    """A 4-step run with checkpoints at steps 2 and 4 (kept pristine; tests work on copies)."""
    run_dir = tmp_path_factory.mktemp("manifest") / "run"
    run_train(run_dir, *COMMON, data_cache=data_cache)
    return run_dir


def _copy(saved_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(saved_run, run_dir)
    return run_dir


def test_every_file_of_a_real_checkpoint_is_covered(saved_run):
    latest = saved_run / "checkpoints" / "step_00000004"
    files = json.loads((latest / MANIFEST).read_text())["files"]
    on_disk = sorted(p.relative_to(latest).as_posix() for p in latest.rglob("*") if p.is_file() and p.name != MANIFEST)
    assert sorted(files) == on_disk and len(on_disk) >= 3
    assert check_manifest(latest) == (True, [])


def test_a_flipped_byte_in_latest_is_refused_at_resume_naming_the_file(saved_run, tmp_path, data_cache):
    run_dir = _copy(saved_run, tmp_path)
    latest = run_dir / "checkpoints" / "step_00000004"
    files = sorted(p.relative_to(latest).as_posix() for p in latest.rglob("*") if p.is_file() and p.name != MANIFEST)
    # every file of latest, through the check resume makes
    for name in files:
        original = (latest / name).read_bytes()
        _flip(latest / name)
        with pytest.raises(DamagedCheckpointError, match=rf"step_00000004 is damaged: {name} has different"):
            verify_checkpoint(latest)
        (latest / name).write_bytes(original)
    # and one through a real relaunch: one line naming the file, no traceback, nothing trained,
    # and the run's records as they were (the refused relaunch's config does not replace them)
    _flip(latest / "__0_0.distcp")
    records = {name: (run_dir / name).read_text() for name in ("config.yaml", "launch.sh")}
    proc = run_train(run_dir, *COMMON, "trainer.max_steps=6", data_cache=data_cache, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert f"error: resume: {latest} is damaged: __0_0.distcp has different contents" in proc.stderr
    assert "resume=fallback" in proc.stderr and "Traceback" not in out
    assert max(metrics(run_dir)) == 4 and (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000004"
    assert {name: (run_dir / name).read_text() for name in records} == records
    assert not (run_dir / "config.yaml.1").exists()


def test_resume_fallback_sets_the_damaged_checkpoint_aside_and_reproduces_the_run(saved_run, tmp_path, data_cache):
    run_dir = _copy(saved_run, tmp_path)
    ckpts = run_dir / "checkpoints"
    _flip(ckpts / "step_00000004" / ".metadata", offset=100)
    proc = run_train(run_dir, *COMMON, "resume=fallback", data_cache=data_cache)
    out = proc.stdout + proc.stderr
    assert "set aside as damaged-step_00000004" in out and f"resumed from {ckpts / 'step_00000002'} at step 2" in out
    # the start-up lines name the step loaded as the model's and the tokenizer's source, not the damaged one
    assert f"model tiny as recorded by the checkpoint it resumes ({ckpts / 'step_00000002'})" in out
    assert f"(the checkpoint this run resumes ({ckpts / 'step_00000002'}))" in out
    assert f"resumes ({ckpts / 'step_00000004'})" not in out
    assert (ckpts / "damaged-step_00000004").is_dir()
    # steps 3-4 ran again from step 2 and wrote a new, complete step 4 that verifies
    assert (ckpts / "latest").read_text().strip() == "step_00000004"
    assert check_manifest(ckpts / "step_00000004") == (True, [])
    a, b = metrics(saved_run), metrics(run_dir)
    assert sorted(b) == [1, 2, 3, 4]
    for step in a:
        assert {k: a[step][k] for k in COMPARED} == {k: b[step][k] for k in COMPARED}, step


def test_init_from_a_damaged_checkpoint_is_refused_naming_the_file(saved_run, tmp_path, data_cache):
    src = _copy(saved_run, tmp_path) / "checkpoints"
    _flip(src / "step_00000004" / "__0_0.distcp")
    proc = run_train(tmp_path / "new", "trainer.max_steps=2", "trainer.indexer_warmup_tokens=1024",
                     f"init_from={src}", data_cache=data_cache, check=False)
    assert proc.returncode == 2, (proc.stdout + proc.stderr)[-3000:]
    assert f"error: init_from {src / 'step_00000004'} is damaged: __0_0.distcp" in proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    # refused before the new run's records: the directory it made for the lock is gone again
    assert not (tmp_path / "new").exists()
    # one the user made stays, empty
    (tmp_path / "made").mkdir()
    proc = run_train(tmp_path / "made", "trainer.max_steps=2", "trainer.indexer_warmup_tokens=1024",
                     f"init_from={src}", data_cache=data_cache, check=False)
    assert proc.returncode == 2 and f"error: init_from {src / 'step_00000004'} is damaged" in proc.stderr
    assert (tmp_path / "made").is_dir() and not list((tmp_path / "made").iterdir())
