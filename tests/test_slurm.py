"""The launchers on a real SLURM cluster: two fake nodes on this host (launch/local_cluster.sh),
CPU ranks over gloo.

Every job trains the same tiny run (2 nodes x 1 rank, torchrun inside srun), so an uninterrupted
job must reproduce the loss curve of one local process with the same global batch, and every
interrupted job must reproduce the uninterrupted job's curve bit for bit. The interruptions are
the real ones, each sent once a periodic checkpoint exists:
- USR1 to the job step (`scancel --signal=USR1`), and to the batch shell only (`scancel --batch`);
- SIGTERM from `scontrol requeue` (SLURM signals every process of the job and requeues it);
- the time-limit warning of `#SBATCH --signal=USR1@N`, brought forward by shortening the job's
  time limit (slurmctld checks limits every 30 s, so the trainers are paused until the signal is
  pending, which keeps the run from finishing first);
- SIGKILL to every trainer and torchrun agent (a node failure), then a relaunch of the run's
  submit script.
Each must save (except the kill), requeue, resume from that save and log every step once. The
uninterrupted job tokenizes its own data cache in a directory that does not exist yet (a first
job's lot), the two USR1 jobs start together on another new one (one builds, the other waits for it
and reuses it), the others read the cache of the reference run. One more job has a bad input that
only its second rank sees (its data.cache_dir names a node-local directory): that rank's error is
in the job's log once, and rank 0 stops naming it. All jobs run at once, with the Hydra submitit
launcher's job beside them, so the scenarios cost about as much wall time as the slowest of them.
The cluster lives in a private state directory with its own ports, is started by a session
fixture and stopped at the end with a check that none of its daemons is left.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from launch.slurm import sbatch, submit

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
CLUSTER = REPO / "launch" / "local_cluster.sh"
PY = sys.executable
MAX_STEPS = 12
INTERVAL = 3
# a fraction of a second per step; start-up (imports, rendezvous) dominates. 256 tokens a step:
# indexer warmup for steps 1-3, top-k from step 4
TINY = [
    f"trainer.max_steps={MAX_STEPS}", "model.seq_length=64", "model.msa.block_size=16", "model.msa.topk=2",
    "trainer.indexer_warmup_tokens=768", f"checkpoint.interval={INTERVAL}",
    "parallel.micro_batch_size=2", "parallel.global_batch_size=4", "optim.warmup_steps=1",
    "data.max_bytes=300000", "checkpoint.keep=0", "logging.log_interval=1", "logging.wandb_mode=disabled",
    "logging.tensorboard=false", "logging.progress_bar=false",
]
COMPARED = ("lm_loss", "kl_loss", "moe_aux_loss", "grad_norm", "lr", "keys_per_query", "phase", "tokens")
# a guard against a hung job, not a speed check: `make test` runs the rest of the suite beside it
CAMPAIGN_TIMEOUT = 1200
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
# generous limits, so that only the signals a scenario sends arrive on a busy machine. The
# time-limit scenario's warning comes 150 s before the end; once a checkpoint exists the limit is
# cut to leave 90-150 s, so the warning is due at once (slurmctld sends it within 30 s) with time
# to save and requeue before the limit
TIME_MIN, SIGNAL_S = 30, 150


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def _cluster_processes(state: Path) -> list[str]:
    """The daemons of the cluster in `state` still alive: its pid files and its step daemons."""
    found = []
    for pid_file in [*state.glob("*.pid"), state / "munge" / "munged.pid"]:
        try:
            pid = int(pid_file.read_text())
        except (OSError, ValueError):
            continue
        if _alive(pid):
            found.append(f"{pid}:{pid_file.name}")
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if (proc / "comm").read_text().strip() == "slurmstepd" and \
                    os.readlink(proc / "cwd").startswith(str(state)) and _alive(int(proc.name)):
                found.append(f"{proc.name}:slurmstepd")
        except OSError:
            continue
    return found


def _free_port_block(n: int = 3) -> int:
    """A port p with p .. p+n-1 free, below the range jobs use for MASTER_PORT (20000+)."""
    for base in range(15000 + os.getpid() % 4000, 19990, 7):
        try:
            for p in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    raise RuntimeError("no free ports for the local cluster")


def _cluster(command: str, env: dict, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(CLUSTER), command], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **env})


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("the local SLURM cluster needs root")
    if shutil.which("sbatch") is None and shutil.which("apt-get") is None:
        pytest.skip("slurm is not installed and apt-get is unavailable")
    # a cluster of our own: another one on this host (other ports, other state) is left alone
    state = Path(tempfile.mkdtemp(prefix="msa-slurm-test-", dir="/var/tmp"))
    # 16 CPUs a node: every scenario's job runs at once (they share the host's cores)
    # KillWait 90 s instead of 30: the scenarios' jobs share two cores, where a stop save and the
    # exit of a gloo job have been seen to outlast 30 s (task 1 then dies by SIGKILL)
    env = {"MSA_SLURM_STATE": str(state), "MSA_SLURM_PORT": str(_free_port_block()), "MSA_SLURM_CPUS": "16",
           "MSA_SLURM_KILL_WAIT": "90"}
    install = _cluster("install", env, timeout=900)
    assert install.returncode == 0, f"slurm install failed:\n{install.stderr}"
    start = _cluster("start", env, timeout=120)
    if start.returncode != 0:
        _cluster("stop", env, timeout=120)
        pytest.fail(f"local SLURM cluster did not start:\n{start.stderr}")
    previous = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(state / "slurm.conf")
    try:
        yield state
    finally:
        stop = _cluster("stop", env, timeout=120)
        if previous is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = previous
        left = _cluster_processes(state)
        # the daemons' logs outlive the cluster, for a failure's post-mortem
        shutil.copytree(state / "log", tmp_path_factory.mktemp("slurm-daemon-logs"), dirs_exist_ok=True)
        shutil.rmtree(state, ignore_errors=True)
    assert stop.returncode == 0 and not left, f"cluster stop left {left}:\n{stop.stderr}"


def job_info(job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, timeout=30)
    return dict(re.findall(r"(\w+)=(\S*)", out.stdout))


def read_records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    # a line still being written has no newline yet
    return [json.loads(line) for line in text.split("\n")[:-1] if line.strip()]


def curve(run_dir: Path) -> dict[int, dict]:
    """step -> record; every step 1..MAX_STEPS logged exactly once."""
    records = read_records(run_dir)
    steps = [r["step"] for r in records]
    assert steps == list(range(1, MAX_STEPS + 1)), f"steps logged in {run_dir / 'metrics.jsonl'}: {steps}"
    return {r["step"]: r for r in records}


def tiny(run_dir: Path, data_cache: Path) -> list[str]:
    return [*TINY, f"run_dir={run_dir}", f"data.cache_dir={data_cache}"]


def saved_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*"))


def run_pids(run_dir: Path, agents: bool = False) -> list[int]:
    """The trainer processes of a run (with `agents`, the torchrun agents too; never srun or the
    shells around them)."""
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            args = [a.decode(errors="replace") for a in (proc / "cmdline").read_bytes().split(b"\0")]
        except OSError:
            continue
        if not args or args[0].endswith(("srun", "bash")) or not _alive(int(proc.name)):
            continue
        if any(a.endswith("train.py") for a in args) and f"run_dir={run_dir}" in args \
                and (agents or "torch.distributed.run" not in args):
            pids.append(int(proc.name))
    return pids


def signal_pending(pid: int, sig: signal.Signals) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    pending = 0
    for key in ("ShdPnd", "SigPnd"):
        m = re.search(rf"^{key}:\s*([0-9a-f]+)", status, re.M)
        pending |= int(m.group(1), 16) if m else 0
    return bool(pending & (1 << (sig - 1)))


@dataclass
class Scenario:
    """One job and the interruption the driver sends it once its first periodic checkpoint
    exists and a step after it is logged."""

    name: str
    run_dir: Path
    job_id: str = ""
    fired_at_step: int | None = None
    phase: str = "running"  # running -> fired -> (paused) -> done
    jobs: list[str] = field(default_factory=list)
    info: dict = field(default_factory=dict)
    trainers: list[int] = field(default_factory=list)
    logged_before_relaunch: int = 0

    def log(self, job_id: str | None = None) -> str:
        path = self.run_dir / f"slurm-{job_id or self.job_id}.out"
        return path.read_text() if path.exists() else "(no log)"


def _ready(sc: Scenario) -> bool:
    return (sc.run_dir / "checkpoints" / "latest").exists() and len(read_records(sc.run_dir)) > INTERVAL


def _fire(sc: Scenario) -> None:
    """Send the scenario's interruption (the kill's relaunch and the time limit's resume follow
    in _advance)."""
    sc.fired_at_step = len(read_records(sc.run_dir))
    job = sc.job_id
    if sc.name == "usr1_step":
        subprocess.run(["scancel", "--signal=USR1", job], check=True, timeout=30)
    elif sc.name == "usr1_batch":
        subprocess.run(["scancel", "--batch", "--signal=USR1", job], check=True, timeout=30)
    elif sc.name == "sigterm_requeue":
        subprocess.run(["scontrol", "requeue", job], check=True, timeout=30)
    elif sc.name == "time_limit":
        sc.trainers = run_pids(sc.run_dir)
        assert len(sc.trainers) == 2, f"trainers of {sc.run_dir}: {sc.trainers}"
        for pid in sc.trainers:
            os.kill(pid, signal.SIGSTOP)
        h, m, s = (int(x) for x in job_info(job)["RunTime"].split("-")[-1].split(":"))
        minutes = (h * 3600 + m * 60 + s + SIGNAL_S) // 60
        subprocess.run(["scontrol", "update", f"JobId={job}", f"TimeLimit={minutes}"], check=True, timeout=30)
        sc.phase = "paused"
        return
    elif sc.name == "kill":
        # what a node failure does to the trainers and their launchers: they are gone at once
        # (scancel --signal=KILL would be a cancellation: SIGTERM first, which saves)
        pids = run_pids(sc.run_dir, agents=True)
        assert len(pids) == 4, f"trainers and agents of {sc.run_dir}: {pids}"
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
    sc.phase = "fired"


def _advance(sc: Scenario) -> None:
    """One poll of a scenario."""
    info = job_info(sc.job_id)
    state = info.get("JobState", "")
    if sc.phase == "running" and sc.name not in UNINTERRUPTED and _ready(sc) and state == "RUNNING":
        _fire(sc)
        return
    if sc.phase == "paused" and all(signal_pending(p, signal.SIGUSR1) or not _alive(p) for p in sc.trainers):
        # slurmctld sent the time-limit warning while the trainers were paused: let them act on it
        for pid in sc.trainers:
            if _alive(pid):
                os.kill(pid, signal.SIGCONT)
        sc.phase = "fired"
        return
    if sc.name == "time_limit" and state == "PENDING" and int(info.get("Restarts", "0")) > 0 \
            and info.get("TimeLimit") != f"00:{TIME_MIN:02d}:00":
        # the requeued job gets its full time back
        subprocess.run(["scontrol", "update", f"JobId={sc.job_id}", f"TimeLimit={TIME_MIN}"], timeout=30)
    if state in TERMINAL:
        if sc.name == "kill" and len(sc.jobs) == 1 and sc.phase == "fired":
            sc.info = info
            sc.logged_before_relaunch = len(read_records(sc.run_dir))
            sc.job_id = sbatch(sc.run_dir / "submit.sbatch")
            sc.jobs.append(sc.job_id)
            return
        if sc.name in UNINTERRUPTED or sc.phase == "fired" or state != "COMPLETED":
            sc.info = info
            sc.phase = "done"


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("slurm-data")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_cache) -> dict[int, dict]:
    """The loss curve of one local process with the same global batch (it also builds the data
    cache every job then reads)."""
    run_dir = tmp_path_factory.mktemp("slurm-ref")
    out = subprocess.run([PY, "train.py", *tiny(run_dir, data_cache)], cwd=REPO, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return curve(run_dir)


SCENARIOS = ("usr1_step", "usr1_batch", "sigterm_requeue", "time_limit")
UNINTERRUPTED = ("straight", "rank_fails")


def _job_cache(name: str, root: Path, data_cache: Path) -> str:
    """The data.cache_dir of a scenario's job (module docstring)."""
    if name == "straight":
        return str(root / "straight-cache")
    if name in ("usr1_step", "usr1_batch"):
        return str(root / "shared-cache")
    if name == "rank_fails":
        # resolved by each rank: node1's rank 0 builds its own, node2's rank 1 finds none
        return f"{root}/node-local/${{oc.env:SLURMD_NODENAME,login}}"
    return str(data_cache)


@pytest.fixture(scope="module")
def campaign(slurm_cluster, reference, data_cache, tmp_path_factory) -> dict:
    """Submit every scenario at once, interrupt each at its moment, wait for all of them."""
    root = tmp_path_factory.mktemp("slurm-jobs")
    started = time.monotonic()
    scenarios = {name: Scenario(name, root / name) for name in ("straight", *SCENARIOS, "kill", "rank_fails")}
    for sc in scenarios.values():
        signal_s = SIGNAL_S if sc.name == "time_limit" else 30
        cache = _job_cache(sc.name, root, data_cache)
        _, sc.job_id = submit([*TINY, f"run_dir={sc.run_dir}", f"data.cache_dir={cache}", "launch.nodes=2",
                               f"launch.time_min={TIME_MIN}", f"launch.signal_seconds={signal_s}",
                               f"launch.job_name=test-{sc.name}"])
        sc.jobs.append(sc.job_id)
    submitit_dir = root / "submitit"
    submitit = subprocess.Popen(
        [PY, "train.py", "-m", "launch=slurm", "launch.nodes=2", f"launch.time_min={TIME_MIN}", "launch.signal_seconds=30",
         *tiny(submitit_dir, data_cache)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = started + CAMPAIGN_TIMEOUT
    try:
        while any(sc.phase != "done" for sc in scenarios.values()):
            for sc in scenarios.values():
                if sc.phase != "done":
                    _advance(sc)
            if time.monotonic() > deadline:
                stuck = {n: (sc.phase, job_info(sc.job_id).get("JobState")) for n, sc in scenarios.items()
                         if sc.phase != "done"}
                tails = "\n".join(f"--- {n}\n{scenarios[n].log()[-2500:]}" for n in stuck)
                pytest.fail(f"scenarios not done after {CAMPAIGN_TIMEOUT}s: {stuck}\n{tails}")
            time.sleep(0.3)
        submitit_out, _ = submitit.communicate(timeout=max(30.0, deadline - time.monotonic()))
    finally:
        for sc in scenarios.values():
            for pid in sc.trainers:
                if _alive(pid):
                    os.kill(pid, signal.SIGCONT)
        if submitit.poll() is None:
            submitit.kill()
            subprocess.run(["scancel", "--name=tiny-pt"], timeout=30)
        for sc in scenarios.values():
            if sc.phase != "done":
                subprocess.run(["scancel", sc.job_id], timeout=30)
    wall = time.monotonic() - started
    print(f"\nSLURM scenarios (all at once) took {wall:.0f}s")
    return {"scenarios": scenarios, "submitit": (submitit.returncode, submitit_out, submitit_dir), "wall": wall,
            "root": root}


def _same_bits(got: dict[int, dict], ref: dict[int, dict]) -> None:
    for step in ref:
        a = {k: got[step].get(k) for k in COMPARED}
        b = {k: ref[step].get(k) for k in COMPARED}
        assert a == b, f"step {step}: {a} != uninterrupted {b}"


def test_sbatch_two_nodes_matches_single_process(campaign, reference):
    sc = campaign["scenarios"]["straight"]
    assert sc.info["JobState"] == "COMPLETED", f"job {sc.job_id} {sc.info['JobState']}:\n{sc.log()[-4000:]}"
    assert sc.info["NumNodes"] == "2" and sc.info["Restarts"] == "0"
    got = curve(sc.run_dir)
    for step in reference:
        assert abs(got[step]["lm_loss"] - reference[step]["lm_loss"]) <= 1e-5, \
            f"step {step}: loss {got[step]['lm_loss']} != single-process {reference[step]['lm_loss']}"
    # relaunchable: the exact script, the resolved config and the commit; launch.sh resubmits it
    script = (sc.run_dir / "submit.sbatch").read_text()
    assert "#SBATCH --nodes=2" in script and f"run_dir={sc.run_dir}" in script
    cfg = OmegaConf.load(sc.run_dir / "config.yaml")
    assert cfg.trainer.max_steps == MAX_STEPS and cfg.run_dir == str(sc.run_dir)
    assert re.match(r"[0-9a-f]{40}", (sc.run_dir / "git.txt").read_text())
    assert (sc.run_dir / "launch.sh").read_text().rstrip().endswith(f"sbatch {sc.run_dir / 'submit.sbatch'}")
    # it tokenized the corpus into a cache directory that did not exist before the job
    assert f"into {campaign['root'] / 'straight-cache'}/stdlib-" in sc.log(), sc.log()[-4000:]


def _cache_files(cache: Path) -> list[str]:
    return sorted(str(p.relative_to(cache)) for p in cache.rglob("*") if not p.is_dir())


def test_two_jobs_started_together_on_one_new_cache_build_it_once(campaign):
    """usr1_step and usr1_batch: each trains and resumes (their own tests); here, the cache."""
    cache = campaign["root"] / "shared-cache"
    logs = [campaign["scenarios"][name].log() for name in ("usr1_step", "usr1_batch")]
    assert sum(log.count(f"into {cache}/stdlib-") for log in logs) == 1, "\n".join(log[-3000:] for log in logs)
    # the tokens and the sample indices, each recorded: no lock, no temporary, nothing set aside
    files = _cache_files(cache)
    keys = {f.split("/")[0] for f in files}
    assert len(keys) == 1, files
    key = keys.pop()
    index = sorted(f.split("/")[-1] for f in files if f.startswith(f"{key}/index/"))
    recorded = json.loads((cache / key / "index" / "manifest.json").read_text())["files"]
    assert sorted(f.rsplit("-", 1)[-1] for f in recorded) == \
        ["description.txt", "document_index.npy", "sample_index.npy", "shuffle_index.npy"], files
    assert index == sorted([*recorded, "manifest.json"]), files
    assert sorted(f for f in files if "/index/" not in f) == [f"{key}/{n}" for n in ("manifest.json", "tokens.bin",
                                                                                     "tokens.idx")], files


def test_a_rank_that_fails_is_named_once_in_the_job_log(campaign):
    """Rank 1 cannot find the data cache rank 0 built (node-local, on the other node: torchrun's
    rendezvous decides which): its error is in the job's log once, with its rank and host; rank 0
    stops with one line naming it, in the job's log and in train.log, and the broken collective is
    not dumped."""
    sc, root = campaign["scenarios"]["rank_fails"], campaign["root"]
    log = sc.log()
    assert sc.info["JobState"] == "FAILED", f"job {sc.job_id} {sc.info['JobState']}:\n{log[-4000:]}"
    errors = [line for line in log.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, log[-4000:]
    m = re.match(rf"error: \[rank 1 on (node[12])\] data cache {root}/node-local/(node[12])/stdlib-\w+ does not exist "
                 "after rank 0 built it: data.cache_dir must be on a file system every node sees$", errors[0])
    assert m and m.group(1) == m.group(2), errors[0]
    other = "node1" if m.group(1) == "node2" else "node2"
    stop = f"[rank 0 on {other}] stopping: rank 1 on {m.group(1)} failed"
    assert stop in log and "Connection closed by peer" not in log and "gloo" not in log, log[-4000:]
    train_log = (sc.run_dir / "train.log").read_text().splitlines()
    assert train_log[-2].endswith(errors[0]) and train_log[-1].endswith(stop), train_log[-3:]


@pytest.mark.parametrize("name", SCENARIOS)
def test_stop_after_a_checkpoint_saves_requeues_and_resumes_bitwise(campaign, name):
    sc, straight = campaign["scenarios"][name], campaign["scenarios"]["straight"]
    log = sc.log()
    assert sc.info["JobState"] == "COMPLETED", f"job {sc.job_id} {sc.info['JobState']}:\n{log[-4000:]}"
    assert sc.info["Restarts"] == "1", f"expected one requeue, scontrol says Restarts={sc.info['Restarts']}:\n{log[-4000:]}"
    # the signal came after a periodic save; the stop saved the step it was in, the requeued job
    # went on from exactly that save
    sig = "SIGTERM" if name == "sigterm_requeue" else "SIGUSR1"
    m = re.search(rf"stopped by {sig} after step (\d+): checkpoint (\S+); (.*)", log)
    assert m, f"no stop line for {sig}:\n{log[-4000:]}"
    stop = int(m.group(1))
    assert sc.fired_at_step > INTERVAL and INTERVAL < stop < MAX_STEPS, (sc.fired_at_step, stop)
    assert m.group(2) == str(sc.run_dir / "checkpoints" / f"step_{stop:08d}")
    assert m.group(3) == (f"SLURM is requeueing job {sc.job_id}" if name == "sigterm_requeue"
                          else f"requeueing job {sc.job_id}")
    assert stop in saved_steps(sc.run_dir) and MAX_STEPS in saved_steps(sc.run_dir)
    assert f"resumed from {sc.run_dir}/checkpoints/step_{stop:08d} at step {stop}" in log
    assert "attempt 1 done (exit status 0)" in log
    # a requeue that worked reads like one: no tracebacks, no failed tasks
    for noise in ("Traceback", "BrokenPipeError", "SignalException", "srun: error", "Exited with exit code"):
        assert noise not in log, f"{noise!r} in the log of a clean requeue:\n{log[-4000:]}"
    _same_bits(curve(sc.run_dir), curve(straight.run_dir))


def test_killed_job_relaunch_resumes_from_last_complete_checkpoint(campaign):
    """A node failure: every process dies at once, nothing is saved; relaunching the run's own
    submit script continues from the last complete checkpoint and reproduces the curve."""
    sc, straight = campaign["scenarios"]["kill"], campaign["scenarios"]["straight"]
    first, relaunch = sc.jobs
    log = sc.log(relaunch)
    assert sc.info["JobState"] == "COMPLETED", f"job {relaunch} {sc.info['JobState']}:\n{log[-4000:]}"
    m = re.search(r"resumed from \S+/step_(\d+) at step (\d+)", log)
    assert m and m.group(1).lstrip("0") == m.group(2), log[-4000:]
    resume_step = int(m.group(2))
    assert INTERVAL <= resume_step < MAX_STEPS and resume_step % INTERVAL == 0
    # the killed job's rows after that checkpoint were dropped and logged again, once
    if sc.logged_before_relaunch > resume_step:
        assert f"removed {sc.logged_before_relaunch - resume_step} record(s) after step {resume_step}" in log, \
            log[-4000:]
    _same_bits(curve(sc.run_dir), curve(straight.run_dir))


def test_submitit_launcher_two_nodes_matches_single_process(campaign, reference):
    rc, out, run_dir = campaign["submitit"]
    assert rc == 0, out[-4000:]
    got = curve(run_dir)
    for step in reference:
        assert abs(got[step]["lm_loss"] - reference[step]["lm_loss"]) <= 1e-5, step
    assert (run_dir / "config.yaml").exists() and (run_dir / "git.txt").exists()
    scripts = list(run_dir.glob(".submitit/*/*_submission.sh"))
    assert scripts and "#SBATCH --nodes=2" in scripts[0].read_text()
    # the relaunch command submits the same multirun again
    launch = (run_dir / "launch.sh").read_text()
    assert "train.py -m" in launch and "launch=slurm" in launch and f"run_dir={run_dir}" in launch
