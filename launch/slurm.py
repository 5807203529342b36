"""Submit a training run to SLURM: `python -m launch.slurm [options] -- <hydra overrides>`.

    python -m launch.slurm --nodes 4 --gpus-per-node 8 --time 24:00:00 --partition gpu \\
        --account myproj -- recipe=pt model=small run_dir=/shared/runs/pt-small

What the job asks SLURM for is the config's `launch.*` (msa_model.config.LaunchConfig), so a
recipe can carry it (`-- recipe=msa_109b_pt`); the options above are shorthands for those keys
(`--nodes 4` is `launch.nodes=4`, `--time 24:00:00` is `launch.time_min=1440`) and win over them.
The Hydra overrides are composed here exactly as train.py would compose them, validated for the
world size of the job, and rendered with launch/submit.sbatch.in into <run_dir>/submit.sbatch next
to the resolved config (config.yaml) and the code's commit (git.txt). `sbatch <run_dir>/submit.sbatch`
relaunches the run; with resume=auto it continues from the latest complete checkpoint, which is
also what a requeued job does.

Two ways to start the ranks (launch.mode, `--mode`):
- torchrun (default): one srun task per node runs torchrun, which starts one rank per GPU and
  meets the other nodes through a c10d rendezvous at the first node of the allocation, whose store
  the submit script runs in a process of its own (launch/rdzv_store.py);
- srun: one srun task per rank; the trainer reads its rank from SLURM_PROCID / SLURM_NTASKS.
"""

from __future__ import annotations

import argparse
import logging
import math
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = Path(__file__).with_name("submit.sbatch.in")
COMM_ENV = Path(__file__).with_name("comm_env.sh")


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


def time_to_minutes(time: str) -> int:
    """A SLURM time as launch.time_min; seconds round up to the next minute, as SLURM rounds them."""
    return math.ceil(time_to_seconds(time) / 60)


def slurm_time(minutes: int) -> str:
    """launch.time_min as SLURM's [D-]HH:MM:SS."""
    days, rest = divmod(minutes, 24 * 60)
    hours, mins = divmod(rest, 60)
    return f"{days}-{hours:02d}:{mins:02d}:00" if days else f"{hours:02d}:{mins:02d}:00"


def world_size(launch) -> int:
    """The ranks a job of these launch settings (a LaunchConfig) starts."""
    return launch.nodes * launch.ranks_per_node


def compose_config(overrides: list[str]):
    """The config train.py would run with these overrides (struct mode: typos are errors), on the
    model its init_from or resume checkpoint records when no model= is given, as train.py takes it:
    otherwise the job would be checked, and its config.yaml written, for the preset's model."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from msa_model.config import register_configs
    from msa_model.training.model_source import take_model_from_checkpoint

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(REPO_ROOT / "configs"), version_base=None):
        return take_model_from_checkpoint(compose(config_name="train", overrides=overrides), overrides)[0]


def composed(overrides: list[str]):
    """compose_config, refusing what train.py refuses before it runs, in its words: a composition
    error (unknown key, no such recipe or model, a value of the wrong type) and a `+key=value`
    the schema does not have, each as one line naming the override (ConfigError)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from msa_model.config import ConfigError
    from msa_model.training.inputs import composition_error, unknown_keys

    try:
        cfg = compose_config(overrides)
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(composition_error(e, overrides)) from e
    unknown = unknown_keys(cfg, overrides)
    if unknown:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(unknown))
    return cfg


def job_overrides(overrides: list[str], run_dir: Path) -> list[str]:
    """The overrides the job runs with: the user's, with run_dir pinned to an absolute path so that
    every attempt of the job (and a manual relaunch) finds the same checkpoints."""
    kept = [o for o in overrides if not o.lstrip("+~").startswith("run_dir=")]
    return [*kept, f"run_dir={run_dir}"]


def _launch_command(launch) -> str:
    # --quiet: srun's own notes ("forcing job termination", ...) when SLURM ends or requeues the
    # job read like failures; its errors still show
    if launch.mode == "srun":
        return 'srun --quiet --kill-on-bad-exit=1 "$PYTHON" "$TRAIN_PY" "${TRAIN_ARGS[@]}"'
    # stop signals reach every process of the step. torchrun would die of USR1 and turn TERM into
    # a SIGTERM-then-SIGKILL of its workers, so it starts with both ignored (that survives exec)
    # and is told not to handle TERM itself; the trainers install their handlers, save and exit
    # while torchrun waits for them
    return (
        "srun --quiet --kill-on-bad-exit=1 --ntasks-per-node=1 bash -c 'trap \"\" USR1 TERM; exec \"$@\"' torchrun \\\n"
        '    "$PYTHON" -m torch.distributed.run --signals-to-handle=SIGINT,SIGHUP,SIGQUIT \\\n'
        '    --nnodes="$SLURM_JOB_NUM_NODES" '
        f"--nproc-per-node={launch.ranks_per_node} \\\n"
        '    --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" '
        '--rdzv-id="$SLURM_JOB_ID-${SLURM_RESTART_COUNT:-0}" --rdzv-conf=is_host=false \\\n'
        '    "$TRAIN_PY" "${TRAIN_ARGS[@]}"'
    )


def render(launch, overrides: list[str], run_dir: Path, env: dict[str, str] | None = None,
           sbatch_args: list[str] | None = None, python: str = sys.executable, workdir: Path | None = None) -> str:
    """The submit script for `overrides` (already including run_dir=...) under `launch`, the
    resolved and validated launch settings (a LaunchConfig); `env` is exported in the job and
    `sbatch_args` are passed to sbatch as they are. The job runs in `workdir` (default: this
    process's directory, so relative paths in the overrides mean what they meant here, as in
    launch.sh's relaunch) and starts the repository's train.py by its absolute path."""
    workdir = Path.cwd() if workdir is None else workdir
    for what, path in (("run_dir", run_dir), ("workdir", workdir)):
        if re.search(r"\s", str(path)):
            raise ValueError(f"{what} {path} contains whitespace, which #SBATCH lines cannot hold")
    extra = []
    if launch.gpus_per_node:
        extra.append(f"--gpus-per-node={launch.gpus_per_node}")
    if launch.cpus_per_task:
        extra.append(f"--cpus-per-task={launch.cpus_per_task}")
    if launch.partition:
        extra.append(f"--partition={launch.partition}")
    if launch.account:
        extra.append(f"--account={launch.account}")
    extra += sbatch_args or []
    torchrun = launch.mode == "torchrun"
    values = {
        "run_dir": str(run_dir),
        "job_name": launch.job_name,
        "nodes": str(launch.nodes),
        "tasks_per_node": "1" if torchrun else str(launch.ranks_per_node),
        "ranks_per_task": str(launch.ranks_per_node) if torchrun else "1",
        "time": slurm_time(launch.time_min),
        "workdir": str(workdir),
        "signal_seconds": str(launch.signal_seconds),
        "sbatch_extra": "\n".join(f"#SBATCH {shlex.quote(a)}" for a in extra),
        # the file's header (about the file itself) stays behind
        "comm_env": COMM_ENV.read_text().split("\n\n", 1)[1].rstrip(),
        "env_exports": "\n".join(f"export {k}={shlex.quote(v)}" for k, v in (env or {}).items()),
        "python": shlex.quote(python),
        "train_py": shlex.quote(str(REPO_ROOT / "train.py")),
        "train_args": " ".join(shlex.quote(o) for o in overrides),
        "launch_command": _launch_command(launch),
        # torchrun's rendezvous store, started by the script itself (launch/rdzv_store.py says why)
        "rdzv_store": shlex.quote(str(REPO_ROOT / "launch" / "rdzv_store.py")) if torchrun else "''",
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
    from msa_model.training.checkpoint import latest_checkpoint
    from msa_model.training.run_dir import change_lines, git_description, write_config

    run_dir.mkdir(parents=True, exist_ok=True)
    # a run directory in use keeps its earlier configuration, as a relaunch by train.py does, and
    # says here what changed (the job's train.py then finds config.yaml as it is)
    kept, changes = write_config(cfg, run_dir)
    resuming = cfg.resume != "never" and latest_checkpoint(Path(cfg.checkpoint.dir or run_dir / "checkpoints")) is not None
    for level, line in change_lines(kept, changes, resuming):
        print(("warning: " if level >= logging.WARNING else "") + f"{run_dir}: {line}",
              file=sys.stderr if level >= logging.WARNING else sys.stdout)
    (run_dir / "git.txt").write_text(git_description())
    path = run_dir / "submit.sbatch"
    path.write_text(script)
    path.chmod(0o755)
    return path


class SubmitError(RuntimeError):
    """sbatch refused the job or is not there; the message is one line for the user."""


def sbatch(script: Path, timeout: float = 60) -> str:
    """Submit and return the job id."""
    try:
        out = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True,
                             timeout=timeout)
    except subprocess.TimeoutExpired:
        raise SubmitError(f"sbatch {script} gave no answer in {timeout:.0f} s (is slurmctld reachable?)") from None
    if out.returncode != 0:
        # sbatch's last line is its verdict (`fatal: ...`, `error: Batch job submission failed: ...`)
        lines = out.stderr.strip().splitlines() or [f"exit status {out.returncode}"]
        raise SubmitError(f"sbatch {script} failed: {lines[-1]}")
    return out.stdout.strip().split(";")[0]


def prepare(overrides: list[str], env: dict[str, str] | None = None,
            sbatch_args: list[str] | None = None) -> tuple[Path, str, object]:
    """Compose the config, validate it for the world size of its launch.* settings; return
    (run_dir, script, cfg). Writes nothing."""
    from omegaconf import OmegaConf

    from msa_model.config import ConfigError, token_budget, validate
    from msa_model.training.index_history import WARMUP_KEY, plan_indexer_warmup
    from msa_model.training.inputs import override_for
    from msa_model.training.resume_tokens import (checkpoint_counters, planned_max_steps, schedule_problem,
                                                  schedule_steps_by_tokens)

    cfg = composed(overrides)
    run_dir = Path(str(cfg.run_dir))
    if not run_dir.is_absolute():
        run_dir = (Path.cwd() / run_dir).resolve()
    args = job_overrides(overrides, run_dir)
    cfg = composed(args)
    budget = token_budget(cfg)
    schedule_steps_by_tokens(cfg)
    OmegaConf.resolve(cfg)
    # a resume at other tokens a step than its checkpoint's goes on by tokens, as the job will
    planned = planned_max_steps(cfg, budget)
    if planned is not None:
        cfg.trainer.max_steps = planned
    # init_from's trained index branch skips the recipe's warmup, as train.py decides it
    plan_indexer_warmup(cfg, override_for(WARMUP_KEY, args) is not None)
    validate(cfg, world_size(cfg.launch), gpu=bool(cfg.launch.gpus_per_node))
    # the job would stop at it once it starts, after its wait in the queue
    counters = checkpoint_counters(cfg)
    problem = schedule_problem(cfg, counters[0] if counters else None)
    if problem:
        raise ConfigError(problem)
    return run_dir, render(cfg.launch, args, run_dir, env, sbatch_args), cfg


def submit(overrides: list[str], env: dict[str, str] | None = None,
           sbatch_args: list[str] | None = None) -> tuple[Path, str]:
    """Write the run dir and submit; return (run_dir, job id)."""
    run_dir, script, cfg = prepare(overrides, env, sbatch_args)
    return run_dir, sbatch(write_run_dir(run_dir, cfg, script))


@dataclass
class Request:
    """A command line: Hydra overrides (the options' launch.* keys last, so they win) and what
    goes to the job as it is."""

    overrides: list[str]
    env: dict[str, str]
    sbatch_args: list[str]
    dry_run: bool


# options that set the launch.* key of the same name (msa_model.config.LaunchConfig)
LAUNCH_OPTIONS = ("nodes", "gpus_per_node", "ranks_per_node", "cpus_per_task", "partition", "account",
                  "signal_seconds", "mode", "job_name")


def _hydra_value(value) -> str:
    """`value` as the right-hand side of a Hydra override: strings other than plain words quoted."""
    text = str(value)
    if not isinstance(value, str) or (re.fullmatch(r"[A-Za-z][\w.-]*", text)
                                      and text.lower() not in ("null", "true", "false", "nan", "inf")):
        return text
    # in Hydra's quoted strings, backslashes escape only before a quote or at the end
    return "'" + re.sub(r"(\\*)('|$)", lambda m: m.group(1) * 2 + ("\\'" if m.group(2) else ""), text) + "'"


def parse_args(argv: list[str]) -> Request:
    if "--" in argv:
        split = argv.index("--")
        argv, overrides = argv[:split], argv[split + 1:]
    else:
        overrides = []
    p = argparse.ArgumentParser(prog="python -m launch.slurm", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Options left out keep the config's launch.* values (defaults: "
                                       "msa_model.config.LaunchConfig).")
    p.add_argument("--nodes", type=int, help="launch.nodes")
    p.add_argument("--gpus-per-node", type=int, help="launch.gpus_per_node; 0 for CPU jobs (gloo)")
    p.add_argument("--ranks-per-node", type=int,
                   help="launch.ranks_per_node; with --gpus-per-node given, defaults to it (1 without GPUs)")
    p.add_argument("--cpus-per-task", type=int, help="launch.cpus_per_task")
    p.add_argument("--time", help="SLURM time limit, e.g. 04:00:00: launch.time_min")
    p.add_argument("--partition", help="launch.partition")
    p.add_argument("--account", help="launch.account")
    p.add_argument("--signal-seconds", type=int,
                   help="launch.signal_seconds: USR1 this many seconds before the time limit: save, requeue, exit")
    p.add_argument("--mode", choices=["torchrun", "srun"], help="launch.mode")
    p.add_argument("--job-name", help="launch.job_name")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="exported in the job (kept out of the run's config)")
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
    options = {key: getattr(a, key) for key in LAUNCH_OPTIONS if getattr(a, key) is not None}
    if a.ranks_per_node is None and a.gpus_per_node is not None:
        # one rank per GPU
        options["ranks_per_node"] = max(a.gpus_per_node, 1)
    if a.time is not None:
        try:
            options["time_min"] = time_to_minutes(a.time)
        except ValueError as e:
            p.error(str(e))
    launch = [f"launch.{key}={_hydra_value(value)}" for key, value in options.items()]
    return Request([*overrides, *launch], env, a.sbatch_arg, a.dry_run)


def main(argv: list[str] | None = None) -> None:
    from msa_model.config import ConfigError

    request = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        run_dir, script, cfg = prepare(request.overrides, request.env, request.sbatch_args)
    except (ConfigError, ValueError) as e:
        print(f"launch.slurm: {e}", file=sys.stderr)
        sys.exit(2)
    from msa_model.training.run import input_problems

    # what the job would stop at once it starts, after its wait in the queue
    for line in input_problems(cfg, request.overrides):
        print(f"warning: {line}", file=sys.stderr)
    if request.dry_run:
        print(script, end="")
        return
    # before the run directory is written: a machine without SLURM's client submits nothing
    if shutil.which("sbatch") is None:
        print("launch.slurm: sbatch not found: submit from a SLURM login node (--dry-run prints the job "
              "script)", file=sys.stderr)
        sys.exit(2)
    try:
        job_id = sbatch(write_run_dir(run_dir, cfg, script))
    except SubmitError as e:
        print(f"launch.slurm: {e}", file=sys.stderr)
        sys.exit(1)
    print(f"submitted job {job_id}: {cfg.launch.nodes} node(s) x {cfg.launch.ranks_per_node} rank(s), "
          f"run dir {run_dir}")
    print(f"  log:      {run_dir}/slurm-{job_id}.out")
    print(f"  relaunch: sbatch {run_dir}/submit.sbatch")


if __name__ == "__main__":
    main()
