"""What a run directory records so that a relaunch is one command, and where logs go.

<run_dir>/config.yaml   the resolved configuration (earlier ones of relaunches: config.yaml.1, ...)
<run_dir>/git.txt       commit of the code (and whether the tree had local changes)
<run_dir>/launch.sh     the command line that relaunches (and so resumes) this run
<run_dir>/train.log     the console log of rank 0
"""

from __future__ import annotations

import logging
import os
import shlex
import subprocess
import sys
from pathlib import Path

from omegaconf import OmegaConf

REPO_ROOT = Path(__file__).resolve().parents[2]


class _TqdmHandler(logging.StreamHandler):
    """Console handler that prints above an active tqdm progress bar instead of through it."""

    def emit(self, record):
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=sys.stdout)
        except Exception:
            self.handleError(record)


def setup_logging(run_dir: Path | None, is_main: bool) -> None:
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(logging.INFO if is_main else logging.WARNING)
    fmt = logging.Formatter("[%(asctime)s] %(message)s", datefmt="%H:%M:%S")
    console = _TqdmHandler()
    console.setFormatter(fmt)
    root.addHandler(console)
    if run_dir is not None and is_main:
        file_handler = logging.FileHandler(run_dir / "train.log")
        file_handler.setFormatter(fmt)
        root.addHandler(file_handler)
    # megatron logs its parameter lists and optimizer config at INFO; keep its warnings only,
    # and not the "GPTModel is deprecated" one printed on every build
    logging.getLogger("megatron").setLevel(logging.WARNING)
    logging.getLogger("megatron.core.models.gpt.gpt_model").setLevel(logging.ERROR)


def git_description() -> str:
    def git(*args):
        out = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 else ""

    commit = git("rev-parse", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return f"{commit}{' (with uncommitted changes)' if dirty else ''}\n"


def _hydra_multirun_overrides() -> list[str] | None:
    """The overrides of a Hydra multirun job (e.g. the submitit launcher's), else None."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
            return list(HydraConfig.get().overrides.task)
    except (ImportError, ValueError):
        pass
    return None


def relaunch_command(run_dir: str) -> str:
    """The command that re-runs this job in the same run dir (so resume=auto continues it)."""
    # a SLURM job rendered by launch/slurm.py: resubmitting its script is the relaunch (it holds
    # the rendezvous and the node count)
    script = Path(run_dir) / "submit.sbatch"
    if "SLURM_JOB_ID" in os.environ and script.is_file():
        return f"sbatch {shlex.quote(str(script))}"
    multirun = _hydra_multirun_overrides()
    argv = multirun if multirun is not None else sys.argv[1:]
    # one-job settings stay out of the relaunch command
    args = [a for a in argv if not a.startswith(("run_dir=", "resume=", "dry_run=", "trainer.stop_at_step="))]
    args.append(f"run_dir={run_dir}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if multirun is not None:
        # the launcher (e.g. submitit) submits the job again from the submitting machine
        launcher, entry, args = [sys.executable], "train.py", ["-m", *args]
    elif world > 1 and "LOCAL_WORLD_SIZE" in os.environ:
        nnodes = world // int(os.environ["LOCAL_WORLD_SIZE"])
        launcher = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
                    f"--nproc-per-node={os.environ['LOCAL_WORLD_SIZE']}"]
        if nnodes == 1:
            launcher.append("--standalone")
        else:
            # several nodes need a rendezvous; this one's address is the best guess for node 0
            launcher += ["--rdzv-backend=c10d",
                         f"--rdzv-endpoint={os.environ.get('MASTER_ADDR', 'HOST')}:{os.environ.get('MASTER_PORT', '29500')}"]
        entry = sys.argv[0] or "train.py"
    else:
        launcher, entry = [sys.executable], sys.argv[0] or "train.py"
    return " ".join(shlex.quote(a) for a in [*launcher, entry, *args])


def write_run_files(cfg, run_dir: Path) -> None:
    """config.yaml, git.txt and launch.sh (rank 0 only). A relaunch with a different configuration
    keeps the earlier one as config.yaml.1, .2, ... (oldest first)."""
    config = run_dir / "config.yaml"
    text = OmegaConf.to_yaml(cfg, resolve=True)
    if config.exists() and config.read_text() != text:
        n = 1
        while (run_dir / f"config.yaml.{n}").exists():
            n += 1
        config.rename(run_dir / f"config.yaml.{n}")
    config.write_text(text)
    (run_dir / "git.txt").write_text(git_description())
    launch = run_dir / "launch.sh"
    launch.write_text("#!/usr/bin/env bash\n# relaunch this run; resume=auto continues from its latest checkpoint\n"
                      f"set -euo pipefail\ncd {shlex.quote(os.getcwd())}\n{relaunch_command(str(run_dir.resolve()))}\n")
    launch.chmod(0o755)
