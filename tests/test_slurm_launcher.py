"""The SLURM launchers without a cluster: rendered scripts, config composition, requeue policy."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from launch.slurm import _hydra_value, parse_args, prepare, slurm_time, time_to_minutes, time_to_seconds
from msa_model.config import ConfigError, register_configs

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("text,seconds", [("90", 5400), ("5:30", 330), ("04:00:00", 14400),
                                          ("1-00:00:00", 86400), ("2-3", 2 * 86400 + 3 * 3600)])
def test_time_formats(text, seconds):
    assert time_to_seconds(text) == seconds


@pytest.mark.parametrize("minutes,text", [(30, "00:30:00"), (1440, "1-00:00:00"), (2890, "2-00:10:00")])
def test_time_min_renders_as_a_slurm_time(minutes, text):
    assert slurm_time(minutes) == text and time_to_minutes(text) == minutes
    # SLURM rounds seconds up to the next minute
    assert time_to_minutes("5:30") == 6


def test_options_are_launch_keys():
    request = parse_args(["--nodes", "4", "--gpus-per-node", "8", "--time", "1-00:00:00", "--partition", "gpu,long",
                          "--env", "A=1", "--sbatch-arg=--exclusive", "--", "recipe=pt", "launch.nodes=2"])
    # the options come last: they win over the same keys among the overrides
    assert request.overrides == ["recipe=pt", "launch.nodes=2", "launch.nodes=4", "launch.gpus_per_node=8",
                                 "launch.partition='gpu,long'", "launch.ranks_per_node=8", "launch.time_min=1440"]
    assert (request.env, request.sbatch_args, request.dry_run) == ({"A": "1"}, ["--exclusive"], False)
    # an option left out keeps the config's value
    assert parse_args(["--", "recipe=pt"]).overrides == ["recipe=pt"]
    assert "launch.ranks_per_node=1" in parse_args(["--gpus-per-node", "0"]).overrides


@pytest.mark.parametrize("value", ["gpu", "gpu,long", "a b", "it's", "back\\", "x\\'y", "null", "1"])
def test_string_options_reach_the_config_as_they_are(value):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    override = OverridesParser.create().parse_override(f"launch.account={_hydra_value(value)}")
    assert override.value() == value


def test_dry_run_prints_the_script_and_writes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "launch.slurm", "--nodes", "4", "--gpus-per-node", "8", "--partition", "gpu",
         "--account", "proj", "--time", "04:00:00", "--signal-seconds", "600", "--env", "NCCL_SOCKET_IFNAME=ib0",
         "--dry-run", "--", "parallel.global_batch_size=64", f"run_dir={run_dir}"],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    script = out.stdout
    for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --partition=gpu", "#SBATCH --account=proj", "#SBATCH --time=04:00:00",
                 "#SBATCH --signal=USR1@600", "#SBATCH --requeue", "export NCCL_SOCKET_IFNAME=ib0",
                 "--nproc-per-node=8", "--rdzv-backend=c10d", "--rdzv-conf=is_host=false", "launch/rdzv_store.py",
                 "export TORCH_NCCL_ASYNC_ERROR_HANDLING"):
        assert line in script, line
    # the job's config records what it asked SLURM for
    assert f"run_dir={run_dir}" in script and "launch.nodes=4 launch.gpus_per_node=8" in script
    assert "{{" not in script
    assert not run_dir.exists()
    # the rendered script is valid bash
    check = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stderr


def test_srun_mode_runs_one_task_per_rank(tmp_path):
    run_dir, script, _ = prepare(["parallel.global_batch_size=16", f"run_dir={tmp_path}/r", "launch.nodes=2",
                                  "launch.gpus_per_node=4", "launch.ranks_per_node=4", "launch.mode=srun"])
    assert run_dir == tmp_path / "r"
    assert "#SBATCH --ntasks-per-node=4" in script
    assert "torch.distributed.run" not in script and 'srun --quiet --kill-on-bad-exit=1 "$PYTHON" "$TRAIN_PY"' in script


def test_relative_run_dir_is_pinned_to_an_absolute_path(tmp_path, monkeypatch):
    """The run directory is absolute; the job runs where it was submitted from (other relative
    paths, data.blend's, mean what they meant there) and starts the repository's train.py."""
    monkeypatch.chdir(tmp_path)
    run_dir, script, cfg = prepare(["run_dir=rel/run", "data.tokenizer=tok"])
    assert run_dir == tmp_path / "rel" / "run" and cfg.run_dir == str(run_dir)
    assert f"run_dir={run_dir}" in script and "run_dir=rel/run" not in script
    assert f"#SBATCH --chdir={tmp_path}\n" in script and "data.tokenizer=tok" in script
    assert f"TRAIN_PY={REPO / 'train.py'}\n" in script and '"$TRAIN_PY" "${TRAIN_ARGS[@]}"' in script


def test_invalid_jobs_are_refused_before_submission(tmp_path):
    with pytest.raises(ConfigError, match="global_batch_size"):
        prepare([f"run_dir={tmp_path}", "launch.nodes=3"])
    with pytest.raises(ConfigError, match=r"launch.signal_seconds \(300\)"):
        prepare(parse_args(["--time", "5", "--", f"run_dir={tmp_path}"]).overrides)
    with pytest.raises(ConfigError, match="launch.mode"):
        prepare([f"run_dir={tmp_path}", "launch.mode=mpirun"])


def test_submitit_launch_group_maps_onto_the_launcher():
    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
        cfg = compose("train", overrides=["launch=slurm", "launch.nodes=2", "launch.ranks_per_node=8",
                                          "launch.gpus_per_node=8", "launch.partition=gpu",
                                          "launch.signal_seconds=600", "run_dir=/tmp/r"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node, launcher.partition) == (2, 8, 8, "gpu")
    assert launcher.additional_parameters.signal == "USR1@600" and launcher.additional_parameters.requeue
    assert launcher.submitit_folder == "/tmp/r/.submitit/%j"
    assert cfg.hydra.callbacks.torch_distributed_env._target_ == "launch.submitit_env.ExportTorchDistributedEnv"


def test_the_script_survives_stop_signals_and_requeues_after_the_step(tmp_path):
    _, script, _ = prepare([f"run_dir={tmp_path}/r", "launch.nodes=2"])
    # a signal to the batch shell goes on to the step; srun itself never gets SIGTERM from it
    assert "trap 'forward USR1' USR1" in script and "trap 'forward TERM' TERM" in script
    assert 'scancel --signal="$1" "$SLURM_JOB_ID"' in script
    # the step runs in the background so the traps run while it does
    assert re.search(r'"\$TRAIN_PY" "\$\{TRAIN_ARGS\[@\]\}" &\nstep=\$!', script)
    # torchrun ignores USR1 and TERM and leaves TERM to the trainers
    assert "trap \"\" USR1 TERM; exec" in script and "--signals-to-handle=SIGINT,SIGHUP,SIGQUIT" in script
    # rank 0 asks, the shell requeues once the step is over
    assert f"export MSA_REQUEUE_REQUEST={tmp_path}/r/.requeue-$SLURM_JOB_ID" in script
    assert script.index("wait \"$step\"") < script.index('scontrol requeue "$SLURM_JOB_ID"')


def test_launch_sh_of_a_slurm_run_resubmits_its_script(tmp_path, monkeypatch):
    from msa_model.training.run_dir import relaunch_command

    (tmp_path / "submit.sbatch").write_text("#!/bin/bash\n")
    monkeypatch.setattr(sys, "argv", ["train.py", "model=small", f"run_dir={tmp_path}"])
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    for key, value in {"RANK": "0", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}.items():
        monkeypatch.setenv(key, value)
    assert relaunch_command(str(tmp_path)) == f"sbatch {tmp_path}/submit.sbatch"
    # torchrun outside SLURM: the virtualenv's torchrun, with a rendezvous for several nodes
    monkeypatch.delenv("SLURM_JOB_ID")
    monkeypatch.setenv("MASTER_ADDR", "gpu01")
    monkeypatch.setenv("MASTER_PORT", "29400")
    cmd = relaunch_command(str(tmp_path))
    assert cmd.startswith(f"{sys.executable} -m torch.distributed.run --nnodes=2 --nproc-per-node=8 "
                          "--rdzv-backend=c10d --rdzv-endpoint=gpu01:29400 train.py model=small")
    assert cmd.endswith(f"run_dir={tmp_path}")


def test_rendezvous_store_outlives_stop_signals_and_ends_with_the_script(tmp_path):
    """launch/rdzv_store.py, as the submit script runs it: it serves torchrun's agents after the
    trainers' stop signals (TERM, USR1), ends on the script's SIGHUP, and ends by itself when the
    script is gone (SIGKILL, as at SLURM's KillWait)."""
    import signal
    import socket
    import time
    from datetime import timedelta

    from torch.distributed import TCPStore

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def start(parent_script: str, port: int, ready: Path) -> subprocess.Popen:
        proc = subprocess.Popen(["bash", "-c", parent_script, "bash", sys.executable,
                                 str(REPO / "launch" / "rdzv_store.py"), str(port), str(ready)],
                                stdout=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the store did not start"
            time.sleep(0.1)
        return proc

    # the script starts the store and prints its pid; the test plays SLURM's signals
    port, ready = free_port(), tmp_path / "ready"
    script = start('"$1" "$2" "$3" "$4" & echo $!; wait $!', port, ready)
    store_pid = int(script.stdout.readline())
    client = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    client.set("k", "v")
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        os.kill(store_pid, sig)
    time.sleep(0.5)
    assert client.get("k") == b"v"
    os.kill(store_pid, signal.SIGHUP)
    assert script.wait(timeout=30) == 128 + signal.SIGHUP  # `wait` returns the store's status

    # the script killed: the store follows within a few seconds
    port, ready = free_port(), tmp_path / "ready2"
    script = start('"$1" "$2" "$3" "$4" & echo $!; sleep 600', port, ready)
    store_pid = int(script.stdout.readline())
    script.kill()
    script.wait(timeout=10)
    deadline = time.monotonic() + 15
    while Path(f"/proc/{store_pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not Path(f"/proc/{store_pid}").exists() or "Z" in Path(f"/proc/{store_pid}/stat").read_text().split()[2]


def test_submitit_jobs_take_a_port_below_the_ephemeral_range(monkeypatch):
    """launch/submitit_env.py: the job's MASTER_PORT by the rule of launch/submit.sbatch.in, not
    submitit's random one (up to 60000, where the node's outgoing connections may hold it)."""
    from launch.submitit_env import ExportTorchDistributedEnv

    slurm = {"SLURM_JOB_ID": "4711", "SLURM_RESTART_COUNT": "1", "SUBMITIT_EXECUTOR": "slurm",
             "SLURM_JOB_NODELIST": "node1", "SLURM_NODELIST": "node1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
             "SLURM_NTASKS": "1", "SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_STEP_NODELIST": "node1",
             "SLURM_STEP_TASKS_PER_NODE": "1", "SLURM_TASKS_PER_NODE": "1", "SLURM_JOB_NUM_NODES": "1"}
    for key, value in slurm.items():
        monkeypatch.setenv(key, value)
    # what the callback exports is put back after the test (setenv records the original values)
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    ExportTorchDistributedEnv().on_job_start()
    assert os.environ["MASTER_PORT"] == str(20000 + (4711 * 16 + 1) % 12768)
    rule = (REPO / "launch" / "submit.sbatch.in").read_text()
    assert "export MASTER_PORT=$(( 20000 + (SLURM_JOB_ID * 16 + ${SLURM_RESTART_COUNT:-0}) % 12768 ))" in rule


@pytest.mark.parametrize("override, message", [
    ("recipe=pts", "recipe=pts: no recipe named 'pts' (available: "),
    ("optim.lrr=1", "optim.lrr=1: unknown key optim.lrr (did you mean optim.lr?)"),
    ("+data.foo=1", "+data.foo=1: unknown key data.foo"),
])
def test_composition_errors_are_one_line_as_train_py_says_them(tmp_path, capsys, override, message):
    """Not Hydra's traceback: the line names the override, exit status 2, nothing written."""
    from launch.slurm import main

    with pytest.raises(SystemExit) as done:
        main(["--dry-run", "--", override, f"run_dir={tmp_path}/run"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and message in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()


def test_inputs_the_job_would_stop_at_are_warned_of_before_submission(tmp_path, capsys):
    from launch.slurm import main

    main(["--dry-run", "--", f"data.blend=[[0.5,{tmp_path}/nothing]]", f"run_dir={tmp_path}/run"])
    out = capsys.readouterr()
    assert out.out.startswith("#!/usr/bin/env bash")
    assert f"warning: data.blend: {tmp_path}/nothing.json is missing" in out.err, out.err
    assert not (tmp_path / "run").exists()


def test_submitting_into_a_used_run_dir_keeps_its_earlier_config(tmp_path, capsys):
    """As a relaunch by train.py does: the config a run trained with is not overwritten unseen,
    the changed keys are named, and a resume whose data stream changed is warned of (the job's
    train.py finds config.yaml already rewritten, so only the submission can say it)."""
    from launch.slurm import write_run_dir

    run_dir, script, cfg = prepare([f"run_dir={tmp_path}/run", "optim.lr=1e-3"])
    write_run_dir(run_dir, cfg, script)
    _, script, changed = prepare([f"run_dir={tmp_path}/run", "optim.lr=2e-3"])
    write_run_dir(run_dir, changed, script)
    assert (run_dir / "config.yaml.1").read_text().count("lr: 0.001") == 1
    assert "lr: 0.002" in (run_dir / "config.yaml").read_text()
    out = capsys.readouterr()
    assert "optim.lr: 0.001 -> 0.002" in out.out and "warning" not in out.err
    write_run_dir(run_dir, changed, script)
    assert not (run_dir / "config.yaml.2").exists()
    # a checkpoint to resume from, and another data split: a warning
    (run_dir / "checkpoints" / "step_00000002").mkdir(parents=True)
    (run_dir / "checkpoints" / "latest").write_text("step_00000002\n")
    _, script, other = prepare([f"run_dir={tmp_path}/run", "optim.lr=2e-3", "data.split=[90,10,0]"])
    write_run_dir(run_dir, other, script)
    err = capsys.readouterr().err
    assert "warning: " in err and "the data stream changed since the last launch (data.split)" in err


def test_a_machine_without_sbatch_is_told_so_before_anything_is_written(tmp_path, capsys, monkeypatch):
    from launch.slurm import main

    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(SystemExit) as done:
        main(["--", f"run_dir={tmp_path}/run"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.startswith("launch.slurm: sbatch not found") and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()


def test_a_refused_submission_is_one_line_with_sbatch_s_verdict(tmp_path, capsys, monkeypatch):
    """sbatch without a reachable controller: its last line, not a traceback."""
    from launch.slurm import main

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "sbatch"
    fake.write_text("#!/bin/sh\necho 'sbatch: error: fetch_config: DNS SRV lookup failed' >&2\n"
                    "echo 'sbatch: fatal: Could not establish a configuration source' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(SystemExit) as done:
        main(["--", f"run_dir={tmp_path}/run"])
    err = capsys.readouterr().err
    assert done.value.code == 1 and "Traceback" not in err, err
    assert err.splitlines()[-1] == (f"launch.slurm: sbatch {tmp_path}/run/submit.sbatch failed: "
                                    "sbatch: fatal: Could not establish a configuration source"), err


def _submitit(tmp_path, path: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": path, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "train.py", "-m", "launch=slurm", "launch.partition=gpu",
                           f"run_dir={tmp_path}/run"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_submitit_launcher_without_slurm_or_refused_is_one_line(tmp_path):
    """`python train.py -m launch=slurm ...` away from a cluster: one line naming the missing commands,
    nothing written (it was submitit's traceback); a refused submission ends in sbatch's verdict."""
    proc = _submitit(tmp_path, str(tmp_path / "empty"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == ("error: launch=slurm submits with sbatch and srun, not found "
                                                    "on this machine: run it on a SLURM login node"), proc.stderr
    assert not (tmp_path / "run").exists()

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("srun", "exit 0"), ("sbatch", "echo 'sbatch: fatal: Could not establish a configuration "
                                                      "source' >&2; exit 1")):
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    proc = _submitit(tmp_path, f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == "error: sbatch: fatal: Could not establish a configuration source"


def test_a_job_that_ran_and_failed_keeps_submitit_s_message():
    """FailedJobError is also what Hydra's submitit launcher raises for a job that ran and failed on
    the cluster (it waits for its jobs): that is not a refused submission, whose last line is
    sbatch's verdict; its message (ending in the job's log paths) is shown whole."""
    code = """
import subprocess, train
from submitit.core.utils import FailedJobError
try:
    raise FailedJobError("sbatch: error: Batch job submission failed: Invalid partition") from \\
        subprocess.CalledProcessError(1, ["sbatch"])
except FailedJobError as e:
    print(repr(train.submission_refusal(e)))
print(repr(train.submission_refusal(FailedJobError("Job (task=0) failed\\n  - /r/.submitit/1/1_0_log.out"))))
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-2:] == ["'sbatch: error: Batch job submission failed: Invalid partition'", "None"]
