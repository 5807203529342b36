"""Run train.py in subprocesses (megatron and the CPU shim stay out of the pytest process) and
read back what a run wrote."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import train_server

REPO = Path(__file__).resolve().parents[1]

# a model small enough for tests: 2 layers (1 dense, 1 MoE), 256 tokens, 4 x 16-token blocks
TINY_TEST = [
    "model.num_layers=2", "model.hidden_size=128", "model.ffn_hidden_size=256", "model.moe_ffn_hidden_size=128",
    "model.seq_length=256", "model.msa.block_size=16", "model.msa.topk=4", "model.msa.index_head_dim=32",
    "parallel.micro_batch_size=2", "parallel.global_batch_size=4", "optim.warmup_steps=1",
    "logging.log_interval=1", "logging.wandb_mode=disabled", "logging.tensorboard=false",
    "logging.progress_bar=false",
]


def _env(threads: int = 1) -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def run_train(run_dir: Path, *overrides: str, data_cache: Path, script: str = "train.py", nproc: int = 1,
              check: bool = True, timeout: int = 300, forked_ranks: bool = False) -> subprocess.CompletedProcess:
    """train.py (or `script`) on the tiny model; nproc > 1 under torchrun, or with forked_ranks
    as run_ranks' forked ranks (where forking is on)."""
    args = [*TINY_TEST, f"run_dir={run_dir}", f"data.cache_dir={data_cache}", *overrides]
    if nproc == 1:
        cmd = [sys.executable, script, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               f"--master-port={free_port()}", script, *args]
    if nproc == 1:
        proc = run_python(cmd[1:], timeout=timeout)
    elif forked_ranks and train_server.enabled():
        proc = run_ranks([script, *args], nproc, _env(), timeout)
    else:
        proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def run_python(argv: list[str], env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python SCRIPT ARGS...` in the repository, its output captured (default environment: _env()):
    a fresh process forked from one that has imported the trainer (tests/train_server.py), or, where
    that is off, one started from scratch."""
    env = _env() if env is None else env
    if train_server.enabled():
        return train_server.run(argv, REPO, env, timeout)
    return subprocess.run([sys.executable, *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def run_ranks(argv: list[str], nproc: int, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """`python *argv` as the `nproc` ranks of one job, each forked as run_python's runs are (rank r
    from server r, tests/train_server.py), the variables torchrun would set given by hand: what a
    test of the ranks' training (not of torchrun) starts, without a launcher and `nproc` imports
    of the trainer. The ranks' outputs one after the other; the exit code the first that is not 0."""
    port = free_port()
    envs = [{**env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)} for r in range(nproc)]
    ranks = train_server.run_together([(argv, e) for e in envs], REPO, timeout=timeout)
    code = next((p.returncode for p in ranks if p.returncode), 0)
    return subprocess.CompletedProcess([sys.executable, *argv], code, "".join(p.stdout for p in ranks),
                                       "".join(p.stderr for p in ranks))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metrics(run_dir: Path) -> dict[int, dict]:
    """step -> the last record written for it (a resumed run may rewrite steps)."""
    out = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = rec
    return out


def placeholder_run(root: Path, **data):
    """A run directory under `root` (config.yaml of the schema's defaults with these data.* values,
    a placeholder checkpoint at step 1), for the commands that read a run before loading weights.
    Returns (run directory, its config)."""
    from omegaconf import OmegaConf

    from msa_model.config import TrainConfig

    run = root / "run"
    step = run / "checkpoints" / "step_00000001"
    step.mkdir(parents=True)
    (step / "metadata.json").write_text("{}")
    (run / "checkpoints" / "latest").write_text("step_00000001\n")
    cfg = OmegaConf.structured(TrainConfig)
    for key, value in data.items():
        cfg.data[key] = value
    (run / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    return run, cfg
