"""The launchers on a real SLURM cluster: two fake nodes on this host (launch/local_cluster.sh),
CPU ranks over gloo.

Every job trains the same tiny run, so each must reproduce the loss curve of one local process
with the same global batch: a 2-node x 1-rank job through sbatch (torchrun inside srun), the same
through Hydra's submitit launcher, and a job preempted with USR1 mid-run that saves, requeues
itself and resumes. The cluster is installed (Debian packages) and started by a session fixture,
and stopped at the end with a check that no SLURM daemon is left.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from launch.slurm import JobSpec, sbatch, submit

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
CLUSTER = REPO / "launch" / "local_cluster.sh"
PY = sys.executable
MAX_STEPS = 8
# a few seconds per step on 2 shared cores; start-up (imports, rendezvous) dominates. 256 tokens a
# step: indexer warmup for steps 1-3, top-k from step 4
TINY = [
    f"trainer.max_steps={MAX_STEPS}", "model.seq_length=64", "model.msa.block_size=16", "model.msa.topk=2",
    "trainer.indexer_warmup_tokens=768",
    "parallel.micro_batch_size=2", "parallel.global_batch_size=4", "optim.warmup_steps=1",
    "data.max_bytes=300000", "checkpoint.keep=0", "logging.log_interval=1", "logging.wandb_mode=disabled",
    "logging.tensorboard=false", "logging.progress_bar=false",
]
JOB_TIMEOUT = 240
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def _slurm_daemons() -> list[str]:
    """slurmctld/slurmd/slurmstepd processes alive on this host (zombies excluded)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            comm = (proc / "comm").read_text().strip()
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if comm in ("slurmctld", "slurmd", "slurmstepd") and state not in ("Z", "X"):
            found.append(f"{proc.name}:{comm}")
    return found


def _cluster(command: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(CLUSTER), command], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def slurm_cluster():
    if os.geteuid() != 0:
        pytest.skip("the local SLURM cluster needs root")
    if shutil.which("sbatch") is None and shutil.which("apt-get") is None:
        pytest.skip("slurm is not installed and apt-get is unavailable")
    install = _cluster("install", timeout=900)
    assert install.returncode == 0, f"slurm install failed:\n{install.stderr}"
    start = _cluster("start", timeout=120)
    if start.returncode != 0:
        _cluster("stop", timeout=120)
        pytest.fail(f"local SLURM cluster did not start:\n{start.stderr}")
    yield
    stop = _cluster("stop", timeout=120)
    left = _slurm_daemons()
    assert stop.returncode == 0 and not left, f"cluster stop left {left}:\n{stop.stderr}"


def _job_info(job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, timeout=30)
    return dict(re.findall(r"(\w+)=(\S*)", out.stdout))


def wait_for_job(job_id: str, log: Path, timeout: float = JOB_TIMEOUT, expedite_requeue: bool = False) -> dict:
    """Poll until the job ends; cancel it and fail with its log on timeout.

    SLURM holds a requeued job for about two minutes before it is eligible again; with
    `expedite_requeue` the test makes it eligible at once (StartTime=now) to keep CI short.
    """
    deadline = time.monotonic() + timeout
    while True:
        info = _job_info(job_id)
        state = info.get("JobState", "")
        if state in TERMINAL:
            return info
        if expedite_requeue and state == "PENDING" and int(info.get("Restarts", "0")) > 0:
            subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], capture_output=True, timeout=30)
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job_id], timeout=30)
            tail = log.read_text()[-4000:] if log.exists() else "(no log)"
            pytest.fail(f"job {job_id} still {state} after {timeout}s; log tail:\n{tail}")
        time.sleep(0.5)


def read_records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    # a line still being written has no newline yet
    return [json.loads(line) for line in text.split("\n")[:-1] if line.strip()]


def read_losses(run_dir: Path) -> dict[int, float]:
    """step -> lm loss from metrics.jsonl (log_interval=1: one record per step, each step once)."""
    records = read_records(run_dir)
    steps = [r["step"] for r in records]
    assert len(steps) == len(set(steps)), f"steps logged twice in {path}: {steps}"
    return {r["step"]: r["lm_loss"] for r in records}


def assert_same_curve(got: dict[int, float], ref: dict[int, float]) -> None:
    assert sorted(got) == list(range(1, MAX_STEPS + 1)), f"steps logged: {sorted(got)}"
    for step in ref:
        assert abs(got[step] - ref[step]) <= 1e-5, f"step {step}: loss {got[step]} != single-process {ref[step]}"


def tiny(run_dir: Path) -> list[str]:
    # a data cache per run: concurrent runs never race on building it
    return [*TINY, f"run_dir={run_dir}", f"data.cache_dir={run_dir}/data-cache"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    """The loss curve of one local process with the same global batch."""
    run_dir = tmp_path_factory.mktemp("slurm-ref")
    out = subprocess.run([PY, "train.py", *tiny(run_dir)], cwd=REPO, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    losses = read_losses(run_dir)
    assert sorted(losses) == list(range(1, MAX_STEPS + 1))
    return losses


def test_sbatch_two_nodes_matches_single_process(slurm_cluster, reference, tmp_path):
    run_dir = tmp_path / "run"
    spec = JobSpec(nodes=2, time="5", signal_seconds=30, job_name="test-sbatch")
    got_dir, job_id = submit(spec, tiny(run_dir))
    assert got_dir == run_dir
    info = wait_for_job(job_id, run_dir / f"slurm-{job_id}.out")
    log = (run_dir / f"slurm-{job_id}.out").read_text()
    assert info["JobState"] == "COMPLETED", f"job {job_id} {info['JobState']}:\n{log[-4000:]}"
    assert info["NumNodes"] == "2" and info["Restarts"] == "0"
    assert_same_curve(read_losses(run_dir), reference)
    # relaunchable: the exact script, the resolved config and the commit
    script = (run_dir / "submit.sbatch").read_text()
    assert "#SBATCH --nodes=2" in script and f"run_dir={run_dir}" in script
    cfg = OmegaConf.load(run_dir / "config.yaml")
    assert cfg.trainer.max_steps == MAX_STEPS and cfg.run_dir == str(run_dir)
    assert re.match(r"[0-9a-f]{40}", (run_dir / "git.txt").read_text())


def test_submitit_launcher_two_nodes_matches_single_process(slurm_cluster, reference, tmp_path):
    run_dir = tmp_path / "run"
    cmd = [PY, "train.py", "-m", "launch=slurm", "launch.nodes=2", "launch.time_min=5",
           "launch.signal_seconds=30", *tiny(run_dir)]
    try:
        out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=JOB_TIMEOUT)
    except subprocess.TimeoutExpired:
        subprocess.run(["scancel", "--name=tiny-pt"], timeout=30)
        logs = "\n".join(p.read_text()[-2000:] for p in run_dir.glob(".submitit/*/*.out"))
        pytest.fail(f"submitit multirun did not finish in {JOB_TIMEOUT}s:\n{logs}")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert_same_curve(read_losses(run_dir), reference)
    assert (run_dir / "config.yaml").exists() and (run_dir / "git.txt").exists()
    scripts = list(run_dir.glob(".submitit/*/*_submission.sh"))
    assert scripts and "#SBATCH --nodes=2" in scripts[0].read_text()


def test_preemption_saves_requeues_and_resumes(slurm_cluster, reference, tmp_path):
    run_dir = tmp_path / "run"
    spec = JobSpec(nodes=2, time="5", signal_seconds=30, job_name="test-preempt")
    _, job_id = submit(spec, tiny(run_dir))
    log_path = run_dir / f"slurm-{job_id}.out"

    # signal once the trainers are past their first step (their handlers are installed), early
    # enough that the stop comes well before the last step
    deadline = time.monotonic() + JOB_TIMEOUT
    while len(read_losses(run_dir)) < 1:
        state = _job_info(job_id).get("JobState")
        if state in TERMINAL or time.monotonic() > deadline:
            subprocess.run(["scancel", job_id], timeout=30)
            pytest.fail(f"job {job_id} {state} before its first step:\n{log_path.read_text()[-4000:]}")
        time.sleep(0.2)
    subprocess.run(["scancel", "--signal=USR1", job_id], check=True, timeout=30)

    info = wait_for_job(job_id, log_path, expedite_requeue=True)
    log = log_path.read_text()
    assert info["JobState"] == "COMPLETED", f"job {job_id} {info['JobState']}:\n{log[-4000:]}"
    assert int(info["Restarts"]) == 1, f"expected one requeue, scontrol says Restarts={info['Restarts']}"
    # the stop saved a checkpoint before the end, and the second attempt went on from it
    saved = sorted(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*"))
    assert len(saved) == 2 and saved[0] < MAX_STEPS and saved[1] == MAX_STEPS, f"checkpoints: {saved}"
    assert_same_curve(read_losses(run_dir), reference)


def test_killed_job_relaunch_resumes_from_last_complete_checkpoint(slurm_cluster, reference, tmp_path):
    """A node failure: every process dies at once, nothing is saved; relaunching the run's own
    submit script continues from the last complete checkpoint and reproduces the curve."""
    run_dir = tmp_path / "run"
    spec = JobSpec(nodes=2, time="5", signal_seconds=30, job_name="test-kill")
    _, job_id = submit(spec, [*tiny(run_dir), "checkpoint.interval=2"])
    log_path = run_dir / f"slurm-{job_id}.out"
    latest = run_dir / "checkpoints" / "latest"
    deadline = time.monotonic() + JOB_TIMEOUT
    while not (latest.exists() and len(read_records(run_dir)) >= 3):
        state = _job_info(job_id).get("JobState")
        if state in TERMINAL or time.monotonic() > deadline:
            subprocess.run(["scancel", job_id], timeout=30)
            pytest.fail(f"job {job_id} {state} before its first checkpoint:\n{log_path.read_text()[-4000:]}")
        time.sleep(0.2)
    subprocess.run(["scancel", "--signal=KILL", "--full", job_id], check=True, timeout=30)
    info = wait_for_job(job_id, log_path)
    assert info["JobState"] != "COMPLETED" and int(info["Restarts"]) == 0
    resume_step = int(latest.read_text().split("_")[1])
    logged_before = len(read_records(run_dir))
    assert resume_step < MAX_STEPS

    relaunch = sbatch(run_dir / "submit.sbatch")
    info = wait_for_job(relaunch, run_dir / f"slurm-{relaunch}.out")
    log = (run_dir / f"slurm-{relaunch}.out").read_text()
    assert info["JobState"] == "COMPLETED", f"job {relaunch} {info['JobState']}:\n{log[-4000:]}"
    records = read_records(run_dir)
    # the relaunch went on from the checkpoint, not from scratch: it dropped the killed job's rows
    # after the checkpoint (if the kill came between a save and the next one) and logged every later
    # step once
    if logged_before > resume_step:
        assert f"removed {logged_before - resume_step} record(s) after step {resume_step}" in log, log[-4000:]
    assert [r["step"] for r in records] == list(range(1, MAX_STEPS + 1))
    assert_same_curve({r["step"]: r["lm_loss"] for r in records}, reference)
