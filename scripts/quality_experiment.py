"""Quality study: does MSA train as well as dense attention? Dense, MSA-PT and MSA-CPT (and any
ablation arm) at equal tokens over several seeds, several runs side by side on each GPU; per arm
the mean and std of the final loss and the paired difference to its reference (same seed).

    python scripts/quality_experiment.py --work runs/quality --out OUT --budget 540 --tokens 10e6 --seeds 3 --lanes 6
    python scripts/quality_experiment.py --preset tiny --corpus stdlib --work /tmp/q --out /tmp/q/out --tokens 16384
    # retrieval at 4x a 512-key budget, in a 2K context
    python scripts/quality_experiment.py --arms dense-retr,pt-retr --seq-length 2048 --override model.msa.topk=4 ...

Arms (`--arms`, default dense,pt,cpt; `--arm "NAME=BASE KEY=VALUE ..."` adds one, repeatable):
    dense   recipe=dense
    pt      recipe=pt, indexer warmup for --warmup-share of the tokens
    cpt     the reference arm's run of the same seed (dense) converted at its mid-way step
            (`python -m msa_model.convert dense-to-msa`), then recipe=cpt for the other half, made
            fair: the data stream continues where the dense run was (init_from_data_position),
            the lr follows the dense run's remaining schedule (optim.schedule_start_step, same lr,
            decay steps and end), the index branch is clipped on its own (optim.index_clip_grad)
            and warms up for the same tokens as pt
    dense-retr, pt-retr   dense and pt on a retrieval-heavy mixture (--retrieval-arm-share of the
            tokens synthetic retrieval documents, `data/retrieval.py`, of the tasks
            --retrieval-tasks: by default passkey, multi-key, variable tracking), evaluated on
            those tasks at --eval-lengths; pt-retr's reference is dense-retr
    NAME=BASE KEY=VALUE ...   BASE's run (dense, pt, cpt or an arm above) with train.py overrides
            on top, e.g. "pt-lb2=pt model.msa.local_blocks=2"; `vs=ARM` names its reference
            (default dense; a cpt-based arm branches from its reference's runs)
Every arm runs seeds 0..N-1 (`--seeds N`: trainer.seed; the data order is the same for every
seed, so a paired difference compares two models on the same batches). `--vary-data`: each seed
also reads the data in its own order (data.seed = the seed), so the seed std holds the data
order's share of the spread too; the arms of one seed still read the same batches.

Lanes: every run is one train.py process; up to --lanes of them share each GPU of --gpus (`small`
at 8K with micro-batch 2: 18.7 GiB dense, 19.5 MSA measured: six fit on an H200; micro-batch 2
halves the launches per token, which MSA lanes at 8K are bound by). Runs start in
seed order, dense first (CPT needs its mid-way checkpoint); the first run of a data mixture
starts alone until it has built the tokenized cache and logged a step, then the others follow.

Resumable: a call does what --budget seconds allow. Before the end, running jobs get SIGTERM
(they save and exit) as far as the free disk holds their checkpoints (`small`: about 8.5 GiB
each), the rest are killed and restart from their last checkpoint; a Ctrl-C ends a call the same
way (exit code 130; a second one kills the runs unsaved). The same command continues in the same
--work. A machine that lost --work continues from the finished runs of an earlier
call's OUT/runs.tar.gz given to --import (a CPT run whose dense parent was imported re-trains the
parent to mid-way first). Finished runs' checkpoints are deleted unless evaluated or
--keep-checkpoints (disk).

Report (scripts/quality_report.py; every call, also when not finished): <work>/report and --out:
quality.md, quality.json, loss_curves.png, runs.tar.gz (metrics, logs, eval results), driver.log.
`--budget 0` writes it again without starting anything.
Final loss of a run: the mean lm loss of its last --final-window logged intervals.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

from msa_model.training.metrics_file import read_metrics

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from quality_plan import PRESETS, InputError, Run, Study, key_of, merged, value_of  # noqa: E402
from quality_report import archive, markdown, plot, summarize  # noqa: E402

LOG = None


def say(msg: str) -> None:
    line = f"[{time.strftime('%H:%M:%S')}] {msg}"
    print(line, flush=True)
    if LOG is not None:
        with open(LOG, "a") as f:
            f.write(line + "\n")


class Budget:
    def __init__(self, seconds: float):
        self.start = time.monotonic()
        self.end = self.start + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def used(self) -> float:
        return time.monotonic() - self.start


def latest_step(run_dir: Path) -> int:
    pointer = run_dir / "checkpoints" / "latest"
    return int(pointer.read_text().strip().split("_")[-1]) if pointer.is_file() else 0


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@dataclass
class Job:
    name: str
    kind: str  # train | parent | convert | eval
    cmd: list[str]
    log: Path
    gpu: str | None
    proc: subprocess.Popen | None = None
    run: Run | None = None
    stopped: bool = False
    started_step: int = 0


class Scheduler:
    def __init__(self, study: Study, budget: Budget):
        self.s, self.budget, self.args = study, budget, study.args
        self.jobs: dict[str, Job] = {}
        self.failed: dict[str, str] = {}
        self.gpus = study.args.gpus.split(",") if study.args.gpus else [None]
        self.ckpt_bytes = study.preset["ckpt_gib"] * 2**30
        self.ready_data = study.work / ".data-ready"
        self.call_steps: dict[str, tuple[int, int]] = {}  # run -> (step at start of call, step now)
        self.measured: set[Path] = set()
        # the budget's last seconds: stop saves (or kills) and the report
        self.stop_margin = study.preset["stop_margin"] if study.args.stop_save == "auto" else 15
        cores = os.cpu_count() or 1
        self.threads = max(1, cores // (len(self.gpus) * study.args.lanes))

    def env(self, gpu: str | None) -> dict:
        env = dict(os.environ, OMP_NUM_THREADS=str(self.threads), PYTHONUNBUFFERED="1")
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(key, None)
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        return env

    def free_gpu(self) -> str | None | bool:
        """The GPU with a free lane and the fewest jobs (None on CPU); False when every lane is busy."""
        load = {g: 0 for g in self.gpus}
        for job in self.jobs.values():
            if job.kind != "convert":
                load[job.gpu] += 1
        gpu = min(load, key=load.get)
        return gpu if load[gpu] < self.args.lanes else False

    def start(self, job: Job) -> None:
        job.log.parent.mkdir(parents=True, exist_ok=True)
        with open(job.log, "a") as logf:
            job.proc = subprocess.Popen(job.cmd, cwd=REPO, stdout=logf, stderr=subprocess.STDOUT, env=self.env(job.gpu))
        self.jobs[job.name] = job
        where = f" on GPU {job.gpu}" if job.gpu else ""
        say(f"{job.name}: {job.kind} started{where} (log {job.log})")

    # --- what can start ------------------------------------------------------------------------

    def train_job(self, run: Run, gpu) -> Job:
        s = self.s
        s.check_settings(run)
        run.dir.mkdir(parents=True, exist_ok=True)
        if not (run.dir / "driver.json").is_file():
            (run.dir / "driver.json").write_text(json.dumps({"settings": s.signature(run.overrides)}, indent=1))
        if latest_step(run.dir) == 0 and (run.dir / "metrics.jsonl").exists():
            # a start from scratch (its checkpoints were lost): its old records go
            (run.dir / "metrics.jsonl").unlink()
        if run.parent is not None and (s.work / "branch" / f"{run.parent}.json").is_file():
            shutil.copy(s.work / "branch" / f"{run.parent}.json", run.dir / "parent.json")
        cmd = [sys.executable, "train.py", *run.overrides, f"run_dir={run.dir}"]
        job = Job(run.name, "train", cmd, Path(f"{run.dir}.log"), gpu, run=run)
        job.started_step = latest_step(run.dir)
        return job

    def converted(self, run: Run) -> bool:
        """A CPT run's start is written (its conversion has ended)."""
        return (run.init / "latest").is_file() and f"convert-{run.parent}" not in self.jobs

    def parent_dir(self, dense: str) -> Path:
        """Where the first half of the dense run `dense` is re-trained when its own run went past it."""
        return self.s.work / "parent" / dense

    def branch_source(self, run: Run) -> Path | None:
        """The mid-way dense checkpoint a CPT run converts, once it exists."""
        step = f"step_{self.s.mid:08d}"
        for d in (self.s.runs[run.parent].dir, self.parent_dir(run.parent)):
            if (d / "checkpoints" / step / "metadata.json").is_file():
                return d / "checkpoints" / step
        return None

    def data_ready(self, run: Run) -> bool | None:
        """True: the tokenized data is there; None: its first run is building it; False: nobody is."""
        if (self.ready_data / self.s.data_signature(run)).is_file():
            return True
        for job in self.jobs.values():
            if job.run is not None and job.kind in ("train", "parent") and \
                    self.s.data_signature(job.run) == self.s.data_signature(run):
                if read_metrics(job.run.dir if job.kind == "train" else self.parent_dir(job.run.name)):
                    self.ready_data.mkdir(exist_ok=True)
                    (self.ready_data / self.s.data_signature(run)).touch()
                    return True
                return None
        return False

    def next_jobs(self) -> list[Job]:
        """Jobs that may start now, in priority order (a GPU is given by `fill`)."""
        s, out = self.s, []
        left = self.budget.left() - self.stop_margin
        for run in s.runs.values():
            if run.name in self.failed:
                continue
            if run.arm.base == "cpt" and not s.done(run) and not self.converted(run):
                out += self.branch_jobs(run)
                continue
            if not s.done(run) and run.name not in self.jobs and left > s.preset["start_cost"]:
                out.append(self.train_job_spec(run))
            elif s.done(run) and run.arm.eval and not (s.eval_dir(run) / "results.json").is_file() \
                    and f"eval-{run.name}" not in self.jobs and f"eval-{run.name}" not in self.failed \
                    and left > self.args.eval_seconds:
                if latest_step(run.dir) == run.steps:
                    out.append(self.eval_job(run))
                else:
                    self.failed[f"eval-{run.name}"] = (
                        "no final checkpoint on this machine: the run was imported, or trained in a call whose "
                        "--eval did not name its arm (it then saves none); evaluate it in another --work")
                    say(f"eval-{run.name}: {self.failed[f'eval-{run.name}']}")
        return out

    def train_job_spec(self, run: Run) -> Job:
        return Job(run.name, "train", [], Path(f"{run.dir}.log"), None, run=run)

    def branch_jobs(self, run: Run) -> list[Job]:
        """A CPT run without its converted start: the conversion, or first the parent's first half."""
        s = self.s
        name = f"convert-{run.parent}"
        if name in self.jobs or name in self.failed:
            return []
        source = self.branch_source(run)
        if source is not None:
            cmd = [sys.executable, "-m", "msa_model.convert", "dense-to-msa", str(source), str(run.init)]
            # what the CPT runs branch from, for their report
            retrained = self.parent_dir(run.parent) in source.parents
            (s.work / "branch").mkdir(parents=True, exist_ok=True)
            (s.work / "branch" / f"{run.parent}.json").write_text(json.dumps(
                {"dense_run": run.parent, "step": s.mid, "retrained": retrained}) + "\n")
            # on the CPU, beside the lanes: no GPU of theirs is touched
            cpu = "" if self.gpus != [None] else None
            return [Job(name, "convert", cmd, s.work / "branch" / f"{run.parent}.log", cpu, run=run)]
        parent = s.runs[run.parent]
        pname = f"parent-{run.parent}"
        # the dense run went past mid-way without its checkpoint there (imported from another machine)
        gone = s.done(parent) or (latest_step(parent.dir) > s.mid and parent.name not in self.jobs)
        if gone and pname not in self.jobs and pname not in self.failed and \
                self.budget.left() - self.stop_margin > s.preset["start_cost"]:
            d = self.parent_dir(run.parent)
            overrides = merged(parent.overrides, ["checkpoint.interval=0", "checkpoint.keep=1",
                                                  f"trainer.stop_at_step={s.mid}"])
            cmd = [sys.executable, "train.py", *overrides, f"run_dir={d}"]
            return [Job(pname, "parent", cmd, Path(f"{d}.log"), None, run=parent)]
        return []

    def eval_job(self, run: Run) -> Job:
        p, out = self.s.preset, self.s.eval_dir(run)
        # the preset's lengths for its context, scaled to this study's
        scaled = sorted({max(256, n * self.args.seq_length // p["seq"]) for n in p["lengths"]})
        lengths = self.args.eval_lengths or ",".join(str(n) for n in scaled)
        samples = self.args.eval_samples or p["samples"]
        cmd = [sys.executable, "-m", "msa_model.eval", str(run.dir), "--out", str(out), "--lengths", lengths,
               "--samples", str(samples), "--loss-sequences", str(p["loss_sequences"]), "--label", run.name]
        if value_of(run.overrides, "data.blend") not in (None, "null"):
            # haystacks and held-out text: a run on prepared datasets has no corpus directory of its own
            cmd += ["--corpus", self.args.corpus]
        tasks = value_of(run.overrides, "data.retrieval_tasks")
        if tasks:
            # a run trained on chosen tasks is scored on them (the report averages over the tasks)
            cmd += ["--tasks", tasks.strip("[]")]
        return Job(f"eval-{run.name}", "eval", cmd, self.s.work / "eval" / f"{run.name}.log", None, run=run)

    def fill(self) -> None:
        for job in self.next_jobs():
            if job.kind == "train":
                if self.data_ready(job.run) is None:
                    continue
                gpu = self.free_gpu()
                if gpu is False:
                    return
                job = self.train_job(job.run, gpu)
                self.call_steps.setdefault(job.name, (job.started_step, job.started_step))
                self.start(job)
            elif job.kind == "parent":
                if self.data_ready(job.run) is None:
                    continue
                gpu = self.free_gpu()
                if gpu is False:
                    return
                job.gpu = gpu
                self.parent_dir(job.run.name).mkdir(parents=True, exist_ok=True)
                self.start(job)
            elif job.kind == "eval":
                gpu = self.free_gpu()
                if gpu is False:
                    return
                job.gpu = gpu
                self.start(job)
            else:
                self.start(job)  # conversions run on the CPU, beside the lanes

    # --- what ended ----------------------------------------------------------------------------

    def reap(self) -> None:
        for name, job in list(self.jobs.items()):
            rc = job.proc.poll()
            if rc is None:
                if job.kind == "train":
                    self.call_steps[name] = (self.call_steps[name][0], self.progress(job))
                continue
            del self.jobs[name]
            if job.kind == "train":
                self.call_steps[name] = (self.call_steps[name][0], self.progress(job))
            if rc != 0 and not job.stopped:
                tail = job.log.read_text()[-2500:] if job.log.is_file() else ""
                self.failed[name] = tail
                say(f"{name}: {job.kind} FAILED (exit {rc}); the last lines of {job.log}:\n{tail}")
                continue
            if job.kind == "train" and latest_step(job.run.dir) >= job.run.steps or \
                    job.kind == "train" and self.finished_line(job.run):
                (job.run.dir / "done.json").write_text(json.dumps({"steps": job.run.steps}) + "\n")
                say(f"{name}: finished ({job.run.steps} steps)")
            elif job.kind == "convert" and rc == 0:
                say(f"{name}: converted")
                self.drop_branch_checkpoint(job.run)
            elif job.stopped:
                say(f"{name}: {self.stopped_line(job)}")
            else:
                say(f"{name}: {job.kind} done")

    def stopped_line(self, job: Job) -> str:
        """What a job stopped at the budget's end (or a Ctrl-C) keeps: a run's or a re-trained
        parent's last checkpoint, an eval's scored cells (its partial.json), a conversion nothing."""
        if job.kind == "train":
            return f"stopped at step {latest_step(job.run.dir)}"
        if job.kind == "parent":
            return f"stopped at step {latest_step(self.parent_dir(job.run.name))}"
        if job.kind == "eval":
            return "stopped; the next call goes on from the retrieval it scored"
        return "stopped; the next call starts it again"

    def finished_line(self, run: Run) -> bool:
        log = run.dir / "train.log"
        n = run.steps
        return log.is_file() and (f"finished at step {n} of {n}" in log.read_text()
                                  or f"is already at step {n} of {n}" in log.read_text())

    def progress(self, job: Job) -> int:
        recs = read_metrics(job.run.dir)
        return recs[-1]["step"] if recs else job.started_step

    def drop_branch_checkpoint(self, run: Run) -> None:
        """Once converted, the dense run's mid-way checkpoint (unless it is its latest) goes."""
        source = self.branch_source(run)
        if source is not None and (source.parent / "latest").read_text().strip() != source.name:
            shutil.rmtree(source, ignore_errors=True)
        shutil.rmtree(self.parent_dir(run.parent), ignore_errors=True)

    def cleanup(self) -> None:
        """Checkpoints of finished runs that nothing needs any more (disk)."""
        if self.args.keep_checkpoints:
            return
        s = self.s
        for run in s.runs.values():
            ck = run.dir / "checkpoints"
            if not s.done(run) or not ck.is_dir() or run.name in self.jobs or f"eval-{run.name}" in self.jobs:
                continue
            if run.arm.eval and not (s.eval_dir(run) / "results.json").is_file():
                continue
            if any(r.parent == run.name and not s.done(r) and not self.converted(r)
                   for r in s.runs.values()):
                continue
            shutil.rmtree(ck, ignore_errors=True)

    def measure_checkpoints(self) -> None:
        """The largest checkpoint seen so far: what one more stop save needs on disk."""
        for run in self.s.runs.values():
            ck = run.dir / "checkpoints"
            for step in ck.glob("step_*") if ck.is_dir() else []:
                if step not in self.measured and (step / "manifest.json").is_file():
                    self.measured.add(step)
                    self.ckpt_bytes = max(self.ckpt_bytes, dir_bytes(step))

    def stop_all(self) -> None:
        """The budget's end: checkpoint what the free disk holds (most unsaved steps first), kill the rest."""
        trains = [j for j in self.jobs.values() if j.kind == "train"]
        for job in self.jobs.values():
            job.stopped = True
            if job.kind != "train":
                job.proc.kill()
        free = shutil.disk_usage(self.s.work).free - 2 * 2**30 if self.args.stop_save == "auto" else 0
        for job in sorted(trains, key=lambda j: self.progress(j) - latest_step(j.run.dir), reverse=True):
            if free >= self.ckpt_bytes:
                job.proc.send_signal(signal.SIGTERM)
                free -= self.ckpt_bytes
                say(f"{job.name}: SIGTERM at step {self.progress(job)} (it saves and exits)")
            else:
                job.proc.kill()
                say(f"{job.name}: killed at step {self.progress(job)}: no disk room for its checkpoint "
                    f"({self.ckpt_bytes / 2**30:.1f} GiB); it restarts from step {latest_step(job.run.dir)}")
        deadline = time.monotonic() + max(10.0, self.budget.left() - 5)
        while self.jobs and time.monotonic() < deadline:
            self.reap()
            time.sleep(1)
        for name, job in list(self.jobs.items()):
            say(f"{name}: still saving at the budget's end; killed")
            job.proc.kill()
            job.proc.wait()
            del self.jobs[name]

    def loop(self) -> bool:
        """Run until everything is done or the budget ends; True when everything is done."""
        s = self.s
        while True:
            self.reap()
            self.cleanup()
            if self.budget.left() < self.stop_margin:
                if self.jobs:
                    self.stop_all()
                break
            self.measure_checkpoints()
            self.fill()
            if not self.jobs and not self.next_jobs():
                break
            time.sleep(self.args.poll)
        self.cleanup()
        missing = [r.name for r in s.runs.values() if not s.done(r)]
        missing += [f"eval-{r.name}" for r in s.runs.values() if r.arm.eval
                    and not (s.eval_dir(r) / "results.json").is_file()]
        return not missing and not self.failed


def default_micro(preset: dict, seq_length: int, gbs: int) -> int:
    """The preset's tokens a micro-batch at this context: at a shorter one a micro-batch of the
    preset's sequences is a fraction of the work per launch (2K with micro-batch 2: lanes of
    `small` bound by issuing work, six of them 77K tokens/s together on an H200), so more
    sequences; the largest divisor of gbs not above that."""
    want = max(1, preset["micro"] * preset["seq"] // max(1, seq_length))
    return max(d for d in range(1, min(want, gbs) + 1) if gbs % d == 0)


def import_runs(study: Study, path: Path) -> None:
    """The finished runs of another call's runs.tar.gz (Study checked that it exists) that this
    work dir has not finished."""
    try:
        tar = tarfile.open(path)
        # every header read first: an archive cut short is refused before any run is taken from it
        members = {m.name: m for m in tar.getmembers() if m.isfile()}
    except (tarfile.TarError, EOFError) as e:
        raise InputError(f"--import {path}: not a whole runs.tar.gz ({str(e).splitlines()[0].rstrip(':')})") from None
    with tar:
        for run in study.runs.values():
            done = members.get(f"{run.name}/done.json")
            if done is None or study.done(run):
                continue
            recorded = members.get(f"{run.name}/driver.json")
            settings = json.loads(tar.extractfile(recorded).read())["settings"] if recorded else None
            if settings != study.signature(run.overrides):
                raise InputError(f"--import {path}: {run.name} there was run with other settings "
                                 f"({', '.join(sorted(set(settings) ^ set(study.signature(run.overrides)))[:6])})")
            shutil.rmtree(run.dir, ignore_errors=True)
            run.dir.mkdir(parents=True)
            for name, m in members.items():
                if name.startswith(f"{run.name}/"):
                    (run.dir / name.split("/", 1)[1]).write_bytes(tar.extractfile(m).read())
                elif name.startswith(f"eval/{run.name}/"):
                    dest = study.eval_dir(run) / name.rsplit("/", 1)[1]
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    dest.write_bytes(tar.extractfile(m).read())
            if f"{run.name}.log" in members:
                Path(f"{run.dir}.log").write_bytes(tar.extractfile(members[f"{run.name}.log"]).read())
            say(f"{run.name}: imported (finished elsewhere)")


def write_outputs(study: Study, sched: Scheduler, budget: Budget) -> Path:
    out = study.work / "report"
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(study)
    summary["common_overrides"] = merged(study.common, study.args.override)
    moved = {n: b - a for n, (a, b) in sched.call_steps.items()}
    call = {"seconds": budget.used(), "tokens": sum(moved.values()) * study.step_tokens,
            "runs": sum(1 for v in moved.values() if v > 0), "failed": sorted(sched.failed)}
    summary["this_call"] = call
    (out / "quality.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "quality.md").write_text(markdown(summary, study, call))
    try:
        plot(summary, study, out / "loss_curves.png")
    except ImportError:
        say("matplotlib is missing: no loss_curves.png")
    archive(study, out / "runs.tar.gz")
    if LOG is not None and Path(LOG).is_file():
        shutil.copy(LOG, out / "driver.log")
    if study.args.out:
        dest = Path(study.args.out)
        dest.mkdir(parents=True, exist_ok=True)
        for f in out.iterdir():
            if not f.name.startswith("."):  # a temporary file a stopped call left
                # whole or not at all: what --out holds is what goes to another machine
                shutil.copy(f, dest / f".{f.name}.tmp")
                os.replace(dest / f".{f.name}.tmp", dest / f.name)
    return out


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="runs/quality", help="runs, checkpoints, evals and the report (kept between calls)")
    p.add_argument("--out", default=None, help="copy the report files here at the end of every call")
    p.add_argument("--budget", type=float, default=540, help="seconds this call may use")
    p.add_argument("--preset", choices=sorted(PRESETS), default="small")
    p.add_argument("--tokens", type=float, default=30e6, help="training tokens per run (whole steps, an even number)")
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 of every arm (trainer.seed)")
    p.add_argument("--vary-data", action="store_true",
                   help="each seed also its own data order (data.seed = the seed; default: one order for all)")
    p.add_argument("--arms", default="dense,pt,cpt", help="built-in arms to run (see above)")
    p.add_argument("--arm", action="append", default=[], metavar='"NAME=BASE KEY=VALUE ..."',
                   help="an arm defined by overrides (repeatable)")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="a train.py override for every run (repeatable); --data.KEY=VALUE is the same for data.*")
    p.add_argument("--lanes", type=int, default=None, help="runs side by side on each GPU (small: 6, tiny: 2)")
    p.add_argument("--gpus", default="", help="GPUs for the lanes, e.g. 0 or 0,1 (default: 0 for small, CPU for tiny)")
    p.add_argument("--seq-length", type=int, default=None,
                   help="context of every run (model.seq_length; default: the preset's); the default eval lengths "
                        "scale with it")
    p.add_argument("--micro", type=int, default=None,
                   help="micro-batch size (default: the preset's tokens a micro-batch, small 16K, at --seq-length, "
                        "within --gbs)")
    p.add_argument("--gbs", type=int, default=None, help="global batch size in sequences (default: the preset's)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak lr of every arm (CPT: the dense run's schedule)")
    p.add_argument("--min-lr", type=float, default=3e-4)
    p.add_argument("--warmup-share", type=float, default=0.05, help="indexer warmup of MSA arms, share of --tokens")
    p.add_argument("--index-clip-grad", default="1.0", help="the CPT arm's optim.index_clip_grad (null: joint clip)")
    p.add_argument("--retrieval-share", type=float, default=0.0, help="data.retrieval_share of every run")
    p.add_argument("--retrieval-arm-share", type=float, default=0.5, help="data.retrieval_share of the *-retr arms")
    p.add_argument("--retrieval-tasks", default=None,
                   help="data.retrieval_tasks of the *-retr arms, comma-separated (e.g. kvrecall), and the tasks "
                        "their evals score (default: passkey,multikey,vartrack)")
    p.add_argument("--retrieval-arm-max-bytes", type=int, default=None,
                   help="their corpus cap (default: 20 MB for small, the preset's for tiny)")
    p.add_argument("--corpus", default=sysconfig.get_paths()["purelib"],
                   help="data.source, and the evals' haystacks (default: site-packages)")
    p.add_argument("--probe-every", type=int, default=None,
                   help="the *-retr arms' retrieval probe (trainer.probe_tasks: their tasks at the full context, "
                        "teacher-forced, the same examples for every run) every N steps, a multiple of the log "
                        "interval (default: about 10 probes a run; 0: off)")
    p.add_argument("--probe-samples", type=int, default=32, help="examples per task of each probe")
    p.add_argument("--eval", default="", help="also evaluate these arms' runs (the *-retr arms always are)")
    p.add_argument("--eval-lengths", default=None, help="eval lengths, comma-separated (default: the preset's)")
    p.add_argument("--eval-samples", type=int, default=None,
                   help="retrieval examples per (task, length, depth) of the evals (default: the preset's; small: "
                   "20, 100 a task and length over the 5 depths, whose standard error at 50%% accuracy is 5 "
                   "points: telling two arms 5 points apart wants about 100, 500 a task and length)")
    p.add_argument("--eval-seconds", type=float, default=240, help="do not start an eval with less budget left")
    p.add_argument("--final-window", type=int, default=None, help="logged intervals averaged for the final loss")
    p.add_argument("--import", dest="import_", default=None, metavar="RUNS_TAR_GZ",
                   help="take the finished runs of an earlier call's runs.tar.gz")
    p.add_argument("--keep-checkpoints", action="store_true", help="keep finished runs' checkpoints")
    p.add_argument("--stop-save", choices=["auto", "none"], default="auto",
                   help="at the budget's end: save the runs the free disk holds (auto) or none (a fresh machine "
                        "next time: the report is all that is kept)")
    p.add_argument("--poll", type=float, default=2.0, help=argparse.SUPPRESS)
    p.add_argument("--dry-run", action="store_true", help="print the runs and their train.py overrides only")
    args, extra = p.parse_known_args(argv)
    for item in extra:
        # --data.blend=PATH or --data.blend PATH: a data.* override for every run
        if item.startswith("--data.") and "=" in item:
            args.override.append(item[2:])
        elif item.startswith("--data."):
            args.override.append(item[2:] + "=")
        elif args.override and args.override[-1].endswith("=") and args.override[-1].startswith("data."):
            args.override[-1] += item
        else:
            p.error(f"unrecognized argument {item!r}")
    preset = PRESETS[args.preset]
    args.lanes = args.lanes or (6 if args.preset == "small" else 2)
    args.retrieval_arm_max_bytes = args.retrieval_arm_max_bytes or min(20_000_000, preset["max_bytes"])
    args.gpus = args.gpus or preset["gpus"]
    args.gbs = args.gbs or preset["gbs"]
    args.seq_length = args.seq_length or preset["seq"]
    if min(args.seeds, args.lanes, args.seq_length, args.gbs, 1 if args.micro is None else args.micro,
           args.probe_samples) < 1:
        p.error("--seeds, --lanes, --seq-length, --gbs, --micro and --probe-samples must be >= 1")
    if args.probe_every is not None and (args.probe_every < 0 or args.probe_every % preset["log"]):
        p.error(f"--probe-every {args.probe_every}: 0 (off) or a positive multiple of the log interval ({preset['log']})")
    args.micro = args.micro or default_micro(preset, args.seq_length, args.gbs)
    bad = [o for o in args.override if "=" not in o]
    if bad:
        p.error(f"--override takes KEY=VALUE, got {bad}")
    # found before the runs, not when the evals start or the report is copied at the budget's end
    if args.eval_lengths is not None:
        try:
            lengths = [int(float(x)) for x in args.eval_lengths.split(",") if x]
        except ValueError:
            lengths = []
        if not lengths or min(lengths) < 256:
            p.error(f"--eval-lengths {args.eval_lengths!r}: comma-separated token counts, each >= 256")
    in_the_way = [f"--{name} {path}" for name, path in (("work", args.work), ("out", args.out))
                  if path and Path(path).exists() and not Path(path).is_dir()]
    if in_the_way:
        p.error(f"{', '.join(in_the_way)}: a file is in the way (a directory is needed)")
    if any(key_of(o) == "model.seq_length" for o in args.override):
        # the study counts its steps and tokens in the context
        p.error("set the context with --seq-length, not --override model.seq_length")
    return args


def check_overrides(study: Study) -> None:
    """Every run's overrides compose as train.py composes them: a misspelled key, preset or recipe,
    or a value of the wrong type is refused here, in train.py's words, before anything is written
    (each run would otherwise fail at its start, and the study with them)."""
    from launch.slurm import composed
    from msa_model.config import ConfigError

    for run in study.runs.values():
        try:
            composed([*run.overrides, f"run_dir={run.dir}"])
        except ConfigError as e:
            raise InputError(f"{run.name}: {e}") from None


def main(argv=None) -> int:
    global LOG
    args = parse(argv)
    try:
        study = Study(args)
        check_overrides(study)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    budget = Budget(args.budget)
    say(f"plan: {len(study.runs)} runs ({', '.join(study.arms)} x {args.seeds} seeds), {study.steps} steps x "
        f"{study.step_tokens:,} tokens = {study.steps * study.step_tokens / 1e6:.2f}M tokens a run; "
        + (f"CPT from step {study.mid}; " if any(a.base == "cpt" for a in study.arms.values()) else "")
        + f"indexer warmup {study.warmup_tokens:,} tokens; {args.lanes} lane(s) on "
        f"{'GPU ' + args.gpus if args.gpus else 'the CPU'}; budget {args.budget:.0f} s")
    if args.dry_run:
        for run in study.runs.values():
            print(f"{run.name}: train.py {' '.join(run.overrides)} run_dir={run.dir}")
        return 0
    study.work.mkdir(parents=True, exist_ok=True)
    LOG = str(study.work / "driver.log")
    try:
        for run in study.runs.values():
            study.check_settings(run)
        if args.import_:
            import_runs(study, Path(args.import_))
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sched = Scheduler(study, budget)
    say(f"{shutil.disk_usage(study.work).free / 2**30:.0f} GiB free in {study.work} (a checkpoint: about "
        f"{study.preset['ckpt_gib']} GiB)")
    interrupted = False
    try:
        done = sched.loop()
    except KeyboardInterrupt:
        # as at the budget's end: the runs save (the terminal's Ctrl-C reached them too) and the
        # report is written; a second Ctrl-C kills them unsaved
        say("interrupted: the training runs save and stop (a second Ctrl-C kills them)")
        sched.stop_all()
        done, interrupted = False, True
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        for job in list(sched.jobs.values()):  # an exception in the driver leaves no process behind
            job.proc.kill()
    out = write_outputs(study, sched, budget)
    say((out / "quality.md").read_text())
    if sched.failed:
        say(f"failed: {', '.join(sorted(sched.failed))}")
        return 1
    say("all runs done; report in " + str(out) if done else "not finished: run the same command again to go on")
    return 130 if interrupted else 0 if done else 3


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
