"""Submit a training run to SLURM: `python -m launch.slurm [options] -- <hydra overrides>`.

    python -m launch.slurm --nodes 4 --gpus-per-node 8 --time 24:00:00 --partition gpu \\
        --account myproj -- recipe=pt model=small run_dir=/shared/runs/pt-small

The Hydra overrides are composed here exactly as train.py would compose them, validated for the
world size of the job, and rendered with launch/submit.sbatch.in into <run_dir>/submit.sbatch next
to the resolved config (config.yaml) and the code's commit (git.txt). `sbatch <run_dir>/submit.sbatch`
relaunches the run; with resume=auto it continues from the latest complete checkpoint, which is
also what a requeued job does.

Two ways to start the ranks:
- torchrun (default): one srun task per node runs torchrun, which starts one rank per GPU and
  meets the other nodes through a c10d rendezvous at the first node of the allocation;
- srun: one srun task per rank; the trainer reads its rank from SLURM_PROCID / SLURM_NTASKS.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = Path(__file__).with_name("submit.sbatch.in")
COMM_ENV = Path(__file__).with_name("comm_env.sh")


@dataclass
class JobSpec:
    """What the job asks SLURM for. ranks_per_node defaults to gpus_per_node (1 without GPUs)."""

    nodes: int = 1
    gpus_per_node: int = 0
    ranks_per_node: int | None = None
    cpus_per_task: int | None = None
    time: str = "01:00:00"
    partition: str | None = None
    account: str | None = None
    signal_seconds: int = 300
    mode: str = "torchrun"  # torchrun | srun
    job_name: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    sbatch_args: list[str] = field(default_factory=list)

    @property
    def ranks(self) -> int:
        return self.ranks_per_node or max(self.gpus_per_node, 1)

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks


def time_to_seconds(time: str) -> int:
    """SLURM time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S."""
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", time.strip())
    if not m:
        raise ValueError(f"--time {time!r} is not a SLURM time (e.g. 90, 04:00:00, 1-00:00:00)")
    days, a, b, c = m.groups()
    if days is not None:  # D-H[:M[:S]]
        return int(days) * 86400 + int(a) * 3600 + int(b or 0) * 60 + int(c or 0)
    if c is not None:  # H:M:S
        return int(a) * 3600 + int(b) * 60 + int(c)
    return int(a) * 60 + int(b or 0)  # M or M:S


def compose_config(overrides: list[str]):
    """The config train.py would run with these overrides (struct mode: typos are errors)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from msa_model.config import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(REPO_ROOT / "configs"), version_base=None):
        return compose(config_name="train", overrides=overrides)


def job_overrides(overrides: list[str], run_dir: Path) -> list[str]:
    """The overrides the job runs with: the user's, with run_dir pinned to an absolute path so that
    every attempt of the job (and a manual relaunch) finds the same checkpoints."""
    kept = [o for o in overrides if not o.lstrip("+~").startswith("run_dir=")]
    return [*kept, f"run_dir={run_dir}"]


def _launch_command(spec: JobSpec) -> str:
    # --quiet: srun's own notes ("forcing job termination", ...) when SLURM ends or requeues the
    # job read like failures; its errors still show
    if spec.mode == "srun":
        return 'srun --quiet --kill-on-bad-exit=1 "$PYTHON" train.py "${TRAIN_ARGS[@]}"'
    if spec.mode != "torchrun":
        raise ValueError(f"--mode must be torchrun or srun, got {spec.mode!r}")
    # stop signals reach every process of the step. torchrun would die of USR1 and turn TERM into
    # a SIGTERM-then-SIGKILL of its workers, so it starts with both ignored (that survives exec)
    # and is told not to handle TERM itself; the trainers install their handlers, save and exit
    # while torchrun waits for them
    return (
        "srun --quiet --kill-on-bad-exit=1 --ntasks-per-node=1 bash -c 'trap \"\" USR1 TERM; exec \"$@\"' torchrun \\\n"
        '    "$PYTHON" -m torch.distributed.run --signals-to-handle=SIGINT,SIGHUP,SIGQUIT \\\n'
        '    --nnodes="$SLURM_JOB_NUM_NODES" '
        f"--nproc-per-node={spec.ranks} \\\n"
        '    --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" '
        '--rdzv-id="$SLURM_JOB_ID-${SLURM_RESTART_COUNT:-0}" \\\n'
        '    train.py "${TRAIN_ARGS[@]}"'
    )


def render(spec: JobSpec, overrides: list[str], run_dir: Path, job_name: str,
           python: str = sys.executable, workdir: Path = REPO_ROOT) -> str:
    """The submit script for `overrides` (already including run_dir=...)."""
    if spec.signal_seconds >= time_to_seconds(spec.time):
        raise ValueError(f"--signal-seconds ({spec.signal_seconds}) must be shorter than --time ({spec.time})")
    for what, path in (("run_dir", run_dir), ("workdir", workdir)):
        if re.search(r"\s", str(path)):
            raise ValueError(f"{what} {path} contains whitespace, which #SBATCH lines cannot hold")
    extra = []
    if spec.gpus_per_node:
        extra.append(f"--gpus-per-node={spec.gpus_per_node}")
    if spec.cpus_per_task:
        extra.append(f"--cpus-per-task={spec.cpus_per_task}")
    if spec.partition:
        extra.append(f"--partition={spec.partition}")
    if spec.account:
        extra.append(f"--account={spec.account}")
    extra += spec.sbatch_args
    torchrun = spec.mode == "torchrun"
    values = {
        "run_dir": str(run_dir),
        "job_name": job_name,
        "nodes": str(spec.nodes),
        "tasks_per_node": "1" if torchrun else str(spec.ranks),
        "ranks_per_task": str(spec.ranks) if torchrun else "1",
        "time": spec.time,
        "workdir": str(workdir),
        "signal_seconds": str(spec.signal_seconds),
        "sbatch_extra": "\n".join(f"#SBATCH {shlex.quote(a)}" for a in extra),
        # the file's header (about the file itself) stays behind
        "comm_env": COMM_ENV.read_text().split("\n\n", 1)[1].rstrip(),
        "env_exports": "\n".join(f"export {k}={shlex.quote(v)}" for k, v in spec.env.items()),
        "python": shlex.quote(python),
        "train_args": " ".join(shlex.quote(o) for o in overrides),
        "launch_command": _launch_command(spec),
    }
    text = TEMPLATE.read_text()
    missing = set(re.findall(r"{{(\w+)}}", text)) - values.keys()
    if missing:
        raise KeyError(f"{TEMPLATE.name} has placeholders with no value: {sorted(missing)}")
    text = re.sub(r"{{(\w+)}}", lambda m: values[m.group(1)], text)
    # optional blocks that rendered empty leave no blank lines behind
    return re.sub(r"\n{3,}", "\n\n", text)


def write_run_dir(run_dir: Path, cfg, script: str) -> Path:
    """config.yaml, git.txt and submit.sbatch; the trainer rewrites the first two identically."""
    from omegaconf import OmegaConf

    from msa_model.training.run_dir import git_description

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    (run_dir / "git.txt").write_text(git_description())
    path = run_dir / "submit.sbatch"
    path.write_text(script)
    path.chmod(0o755)
    return path


def sbatch(script: Path, timeout: float = 60) -> str:
    """Submit and return the job id."""
    out = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"sbatch {script} failed: {out.stderr.strip()}")
    return out.stdout.strip().split(";")[0]


def prepare(spec: JobSpec, overrides: list[str]) -> tuple[Path, str, object]:
    """Compose and validate the config; return (run_dir, script, cfg). Writes nothing."""
    from omegaconf import OmegaConf

    from msa_model.config import validate

    cfg = compose_config(overrides)
    run_dir = Path(str(cfg.run_dir))
    if not run_dir.is_absolute():
        run_dir = (Path.cwd() / run_dir).resolve()
    args = job_overrides(overrides, run_dir)
    cfg = compose_config(args)
    OmegaConf.resolve(cfg)
    validate(cfg, spec.world_size, gpu=spec.gpus_per_node > 0)
    name = spec.job_name or f"{cfg.model.name}-{cfg.name}"
    return run_dir, render(spec, args, run_dir, name), cfg


def submit(spec: JobSpec, overrides: list[str]) -> tuple[Path, str]:
    """Write the run dir and submit; return (run_dir, job id)."""
    run_dir, script, cfg = prepare(spec, overrides)
    path = write_run_dir(run_dir, cfg, script)
    return run_dir, sbatch(path)


def parse_args(argv: list[str]) -> tuple[JobSpec, list[str], bool]:
    if "--" in argv:
        split = argv.index("--")
        argv, overrides = argv[:split], argv[split + 1:]
    else:
        overrides = []
    p = argparse.ArgumentParser(prog="python -m launch.slurm", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=0, help="0 for CPU jobs (gloo)")
    p.add_argument("--ranks-per-node", type=int, default=None, help="default: gpus per node, or 1")
    p.add_argument("--cpus-per-task", type=int, default=None)
    p.add_argument("--time", default="01:00:00", help="SLURM time limit, e.g. 04:00:00")
    p.add_argument("--partition", default=None)
    p.add_argument("--account", default=None)
    p.add_argument("--signal-seconds", type=int, default=300,
                   help="USR1 this many seconds before the time limit: save, requeue, exit")
    p.add_argument("--mode", choices=["torchrun", "srun"], default="torchrun")
    p.add_argument("--job-name", default=None)
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="exported in the job")
    p.add_argument("--sbatch-arg", action="append", default=[], metavar="ARG",
                   help="extra sbatch option, e.g. --sbatch-arg=--exclusive")
    p.add_argument("--dry-run", action="store_true", help="print the submit script; submit and write nothing")
    a = p.parse_args(argv)
    env = {}
    for item in a.env:
        key, sep, value = item.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            p.error(f"--env expects KEY=VALUE, got {item!r}")
        env[key] = value
    spec = JobSpec(nodes=a.nodes, gpus_per_node=a.gpus_per_node, ranks_per_node=a.ranks_per_node,
                   cpus_per_task=a.cpus_per_task, time=a.time, partition=a.partition, account=a.account,
                   signal_seconds=a.signal_seconds, mode=a.mode, job_name=a.job_name, env=env,
                   sbatch_args=a.sbatch_arg)
    return spec, overrides, a.dry_run


def main(argv: list[str] | None = None) -> None:
    from msa_model.config import ConfigError

    spec, overrides, dry_run = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if dry_run:
            _, script, _ = prepare(spec, overrides)
            print(script, end="")
            return
        run_dir, job_id = submit(spec, overrides)
    except (ConfigError, ValueError) as e:
        sys.exit(f"launch.slurm: {e}")
    print(f"submitted job {job_id}: {spec.nodes} node(s) x {spec.ranks} rank(s), run dir {run_dir}")
    print(f"  log:      {run_dir}/slurm-{job_id}.out")
    print(f"  relaunch: sbatch {run_dir}/submit.sbatch")


if __name__ == "__main__":
    main()
