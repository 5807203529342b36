"""What a run directory records so that a relaunch is one command, and where logs go.

<run_dir>/config.yaml   the resolved configuration (earlier ones of relaunches: config.yaml.1, ...)
<run_dir>/git.txt       commit of the code (and whether the tree had local changes)
<run_dir>/launch.sh     the command line that relaunches (and so resumes) this run
<run_dir>/train.log     the console log of rank 0
<run_dir>/run.lock      who is training in this directory now (host, pid), while it runs
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from omegaconf import OmegaConf

from msa_model.platform.lock_files import create_lock, pid_state, read_lock, remove_stale

REPO_ROOT = Path(__file__).resolve().parents[2]
log = logging.getLogger(__name__)


class _TqdmHandler(logging.StreamHandler):
    """Console handler that prints above an active tqdm progress bar instead of through it."""

    def emit(self, record):
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=sys.stdout)
        except Exception:
            self.handleError(record)


# megatron notices that concern its own roadmap, not this run, repeated on every build or save
_LIBRARY_NOISE = ("full_param_layout not provided", "async save is deprecated",
                  "Building a BlendedDataset for a single MegatronDataset")


def _not_noise(record: logging.LogRecord) -> bool:
    return not (record.name.startswith("megatron") and any(n in record.getMessage() for n in _LIBRARY_NOISE))


def setup_logging(run_dir: Path | None, is_main: bool) -> None:
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(logging.INFO if is_main else logging.WARNING)
    fmt = logging.Formatter("[%(asctime)s] %(message)s", datefmt="%H:%M:%S")
    console = _TqdmHandler()
    console.setFormatter(fmt)
    console.addFilter(_not_noise)
    root.addHandler(console)
    if run_dir is not None and is_main:
        file_handler = logging.FileHandler(run_dir / "train.log")
        file_handler.setFormatter(fmt)
        file_handler.addFilter(_not_noise)
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
            # as given, interpolations unresolved (inputs.task_overrides)
            return OmegaConf.to_container(HydraConfig.get().overrides.task, resolve=False)
    except (ImportError, ValueError):
        pass
    return None


def _last_of_each_key(overrides: list[str]) -> list[str]:
    """The overrides with a key set more than once (a relaunch through launch.sh adds its own after
    the ones launch.sh records) reduced to the last setting, the one Hydra applies; additions and
    deletions (`+key=`, `~key`) are kept as they are."""
    keys = [a.split("=", 1)[0] if "=" in a and not a.startswith(("+", "~")) else None for a in overrides]
    return [a for i, (a, key) in enumerate(zip(overrides, keys)) if key is None or key not in keys[i + 1:]]


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
    args = _last_of_each_key(args) + [f"run_dir={run_dir}"]
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


# what decides which tokens the samples after a saved data position hold: a resume with another
# value reads other samples than the run it continues would have
DATA_STREAM_KEYS = ("data.source", "data.glob", "data.max_bytes", "data.blend", "data.split", "data.valid_blend",
                    "data.seed", "data.add_bos", "data.eod_token", "data.retrieval_share", "data.retrieval_tasks",
                    "data.retrieval_min_length", "model.seq_length")


def _flat(node, prefix: str = "") -> dict:
    """{dotted key: value} of a config container; lists are values."""
    if not isinstance(node, dict):
        return {prefix[:-1]: node}
    return {k: v for key, child in node.items() for k, v in _flat(child, f"{prefix}{key}.").items()}


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _same_run_dir(key: str, old, new) -> bool:
    """The run directory as given first (relative) and as launch.sh's relaunch gives it (absolute,
    from the same directory): the same run, not a change."""
    return key == "run_dir" and isinstance(old, str) and isinstance(new, str) and \
        Path(old).resolve() == Path(new).resolve()


def _schema_defaults() -> dict:
    """{dotted key: default} of the config schema."""
    from msa_model.config import TrainConfig

    return _flat(OmegaConf.to_container(OmegaConf.structured(TrainConfig)))


def write_config(cfg, run_dir: Path) -> tuple[Path | None, list[str]]:
    """Write the resolved `cfg` as run_dir/config.yaml. An earlier, different one is kept as
    config.yaml.1, .2, ... (oldest first); one that differs only in how run_dir is spelt, or only
    by keys it lacks that now hold the schema's default (a setting added since it was written), is
    replaced. Returns (the kept file or None, one `key: old -> new` line per changed key)."""
    config = run_dir / "config.yaml"
    text = OmegaConf.to_yaml(cfg, resolve=True)
    kept, changes = None, []
    if config.exists() and config.read_text() != text:
        before = _flat(OmegaConf.to_container(OmegaConf.create(config.read_text())))
        after = _flat(OmegaConf.to_container(OmegaConf.create(text)))
        added = after.keys() - before.keys()
        defaults = _schema_defaults() if added else {}
        new_default = {key for key in added if key in defaults and defaults[key] == after[key]}
        changes = [f"{key}: {_short(before.get(key))} -> {_short(after.get(key))}"
                   for key in sorted(before.keys() | after.keys())
                   if before.get(key) != after.get(key) and key not in new_default
                   and not _same_run_dir(key, before.get(key), after.get(key))]
    if changes:
        n = 1
        while (run_dir / f"config.yaml.{n}").exists():
            n += 1
        kept = run_dir / f"config.yaml.{n}"
        config.rename(kept)
    config.write_text(text)
    return kept, changes


def change_lines(kept: Path | None, changes: list[str], resuming: bool) -> list[tuple[int, str]]:
    """(logging level, line) of a relaunch's changed configuration (write_config's result): a
    warning when a resume's data stream changed (DATA_STREAM_KEYS), then the changed keys."""
    if kept is None:
        return []
    lines = []
    stream = sorted({c.split(":")[0] for c in changes} & set(DATA_STREAM_KEYS))
    if resuming and stream:
        lines.append((logging.WARNING, f"the data stream changed since the last launch ({', '.join(stream)}): this "
                                       "resume reads other samples than the run it continues would have; the "
                                       f"earlier configuration is {kept}"))
    lines.append((logging.INFO, f"configuration changed since the last launch (the earlier one kept as {kept.name}): "
                                + "; ".join(changes)))
    return lines


def write_run_files(cfg, run_dir: Path, resuming: bool = False) -> None:
    """config.yaml, git.txt and launch.sh (rank 0 only). A relaunch with a different configuration
    keeps the earlier one as config.yaml.1, .2, ... (oldest first) and says what changed; a
    resume (`resuming`) whose data stream changed (DATA_STREAM_KEYS: e.g. a relaunch that left
    out data.blend) is a warning, since it does not continue the samples of the run."""
    kept, changes = write_config(cfg, run_dir)
    for level, line in change_lines(kept, changes, resuming):
        log.log(level, "%s", line)
    (run_dir / "git.txt").write_text(git_description())
    launch = run_dir / "launch.sh"
    command = relaunch_command(str(run_dir.resolve()))
    note = "resume=auto continues from its latest checkpoint"
    if not command.startswith("sbatch "):
        # overrides given to launch.sh come last, so they win (e.g. trainer.max_steps=N)
        command += ' "$@"'
        note += "; arguments are added overrides"
    # a new file moved into place: the relaunch itself may be running this launch.sh, and bash
    # reads a script as it goes, so rewriting it in place would feed bash the new file's tail
    tmp = run_dir / "launch.sh.tmp"
    tmp.write_text(f"#!/usr/bin/env bash\n# relaunch this run; {note}\n"
                   f"set -euo pipefail\ncd {shlex.quote(os.getcwd())}\n{command}\n")
    tmp.chmod(0o755)
    os.replace(tmp, launch)


def launch_directory(run_dir: str | Path) -> Path | None:
    """The directory the run was launched from (launch.sh's `cd`), against which the relative paths
    of its config.yaml (init_from, data.blend, ...) were read; None without a launch.sh."""
    launch = Path(run_dir) / "launch.sh"
    if not launch.is_file():
        return None
    for line in launch.read_text().splitlines():
        if line.startswith("cd "):
            return Path(shlex.split(line)[1])
    return None


def run_path(run_dir: str | Path, value: str) -> Path:
    """A path of a run's config.yaml as the run read it: relative ones from its launch directory."""
    path = Path(value)
    if path.is_absolute():
        return path
    return (launch_directory(run_dir) or Path.cwd()) / path


class RunDirBusy(RuntimeError):
    """Another live process trains in this run directory."""


class RunDirLock:
    """`<run_dir>/run.lock`: one training process (rank 0 of the job) per run directory.

    The file holds the holder's host, pid and SLURM job, and its modification time is a heartbeat
    refreshed every `heartbeat_s` while the holder lives. A lock is stale, and taken over with a
    warning, when its holder is provably gone: on this host its pid no longer runs (or now belongs
    to another process); inside the same SLURM job it belongs to an earlier run of a requeued job;
    on another host its heartbeat is older than `stale_after_s`. Creation is atomic (a complete
    file is hard-linked into place), so two launches never both hold it.
    """

    NAME = "run.lock"

    def __init__(self, run_dir: str | Path, stale_after_s: float = 300.0, heartbeat_s: float = 30.0):
        self.run_dir, self.path = Path(run_dir), Path(run_dir) / self.NAME
        self.stale_after_s, self.heartbeat_s = stale_after_s, heartbeat_s
        self.info = {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": pid_state(os.getpid())[1],
                     "started": time.strftime("%Y-%m-%d %H:%M:%S"), "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
                     "slurm_restart_count": os.environ.get("SLURM_RESTART_COUNT", "0"),
                     "command": " ".join(sys.argv)[:500]}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- reading and judging a lock ---------------------------------------------------------------

    def _read(self, path: Path) -> tuple[dict | None, float | None]:
        return read_lock(path)

    def _stale_reason(self, info: dict, mtime: float) -> str | None:
        """Why the holder is gone, or None if it may be alive."""
        me = self.info
        if info.get("host") == me["host"]:
            pid = info.get("pid")
            if not isinstance(pid, int) or pid <= 0:
                return "it names no process"
            alive, start = pid_state(pid)
            if not alive:
                return f"process {pid} on {me['host']} is no longer running"
            if info.get("pid_start") and start and start != info["pid_start"]:
                return f"process {pid} on {me['host']} has exited (the pid now belongs to another process)"
            if pid == me["pid"]:
                return "it was left by this very process"
            return None
        if (me["slurm_job_id"] and info.get("slurm_job_id") == me["slurm_job_id"]
                and str(info.get("slurm_restart_count")) != str(me["slurm_restart_count"])):
            # SLURM ends every process of a job before it starts the requeued one
            return f"it belongs to an earlier run of SLURM job {me['slurm_job_id']} (requeued since)"
        age = time.time() - mtime
        if age > self.stale_after_s:
            return f"its holder on {info.get('host')} has not refreshed it for {age:.0f} s"
        return None

    def _describe(self, info: dict, mtime: float) -> str:
        job = f", SLURM job {info['slurm_job_id']}" if info.get("slurm_job_id") else ""
        return (f"pid {info.get('pid')} on host {info.get('host')} (started {info.get('started')}{job}; "
                f"heartbeat {time.time() - mtime:.0f} s ago)")

    # -- taking and giving back -------------------------------------------------------------------

    def _try_create(self) -> bool:
        tmp = self.path.with_name(f".{self.NAME}.{self.info['host']}.{self.info['pid']}")
        return create_lock(self.path, tmp, json.dumps(self.info, indent=1) + "\n")

    def acquire(self, attempts: int = 8) -> None:
        """Take the lock, taking over a stale one with a warning; raise RunDirBusy naming a live
        holder."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for _ in range(attempts):
            if self._try_create():
                self._start_heartbeat()
                return
            info, mtime = self._read(self.path)
            if mtime is None:
                continue  # released between our two looks
            if info is None:
                if time.time() - mtime < 5:
                    time.sleep(0.5)  # being written by a launch without hard links
                    continue
                info, reason = {}, "the lock file is unreadable"
            else:
                reason = self._stale_reason(info, mtime)
                if reason is None:
                    raise RunDirBusy(
                        f"run_dir {self.run_dir} is in use by {self._describe(info, mtime)}: wait for that run to "
                        f"end, stop it, or pass another run_dir=. If it is gone, {self.path} goes stale after "
                        f"{self.stale_after_s:.0f} s without heartbeat; you may also delete it.")
            aside = self.path.with_name(f".{self.NAME}.stale.{self.info['host']}.{self.info['pid']}")
            if remove_stale(self.path, aside, info):
                log.warning("taking over the lock of run_dir %s from %s: %s", self.run_dir,
                            f"pid {info.get('pid')} on {info.get('host')}" if info else "an unknown holder", reason)
        raise RunDirBusy(f"could not lock run_dir {self.run_dir}: other launches keep racing for {self.path}")

    def _owned(self) -> bool:
        info, _ = self._read(self.path)
        return info == self.info

    def _start_heartbeat(self) -> None:
        def beat():
            while not self._stop.wait(self.heartbeat_s):
                try:
                    if self._owned():
                        os.utime(self.path)
                except OSError:
                    pass

        self._thread = threading.Thread(target=beat, name="run-dir-lock-heartbeat", daemon=True)
        self._thread.start()

    def release(self) -> None:
        self._stop.set()
        if self._owned():
            self.path.unlink(missing_ok=True)


def lock_run_dir(run_dir: str | Path, is_main: bool) -> RunDirLock | None:
    """Rank 0 takes the run directory's lock; every rank learns the outcome, so a refused launch
    stops everywhere (the other ranks never touch the file). Call after the process group exists."""
    import torch.distributed as dist

    lock, error = None, None
    if is_main:
        lock = RunDirLock(run_dir)
        try:
            lock.acquire()
        except RunDirBusy as e:
            lock, error = None, str(e)
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise RunDirBusy(error if is_main else f"rank 0 could not lock the run directory: {error}")
    return lock
