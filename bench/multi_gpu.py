"""Every multi-GPU measurement of issue 38 from one command on one machine of N GPUs: real `train.py`
jobs under torchrun, resumable, within a time budget, and a report.

    PYTHONPATH=. python bench/multi_gpu.py --out $OUT --work /tmp/multi_gpu --budget 540 \
        [--gpus N] [--parts parity,preempt,cp,scaling] [--steps 20] [--layouts tp2,ep2,...] \
        [--import EARLIER/multi_gpu.json] [--dry-run] [--cpu]

On a machine of 2, 4 or 8 GPUs (nvidia-h200-x2 / -x4 / -x8), from the repository root, megatron-core
and hydra installed from `.whl/`; the same command again continues in the same --work (each call
does what --budget seconds allow, skips what is done and rewrites the report in --out):

    # 2 GPUs: about 6 min parity, 3.5 preempt, 5 cp, 6 scaling (estimates: --dry-run prints them)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && \
        python3 bench/multi_gpu.py --gpus 2 --out $OUT --work /tmp/multi_gpu --budget 540
    # 4 GPUs (adds TP2 x EP2, TP2 x PP2, PP2 x EP2, CP 4, EP 2 in the drill, scaling to 4)
    ... python3 bench/multi_gpu.py --gpus 4 --out $OUT --work /tmp/multi_gpu --budget 540
    # 8 GPUs (adds TP2 x PP2 x EP2 x DP2, EP 8, PP 2 in the drill, scaling to 8): about 5, 3, 3, 9.5 min
    ... python3 bench/multi_gpu.py --gpus 8 --out $OUT --work /tmp/multi_gpu --budget 540
    # a machine that lost --work (a fresh one) continues from the last report's finished jobs:
    ... python3 bench/multi_gpu.py --gpus 8 --out $OUT --work /tmp/multi_gpu --budget 540 --import prev/multi_gpu.json
    # what would run: every job's command and the estimated minutes per part, nothing started
    python3 bench/multi_gpu.py --gpus 8 --dry-run

Parts, in this order (the most valuable numbers first; --parts picks a subset):
  parity   msa_109b_proxy, MSA-PT sparse phase (recipe=pt trainer.indexer_warmup_tokens=0), 8K, 4
           sequences a step, --steps steps: one GPU's weights after one step (`init` saves them,
           deterministic) loaded through init_from (which reshards) by the one-GPU reference and by
           each layout as the 109B recipes shard it: TP 2 + sequence parallel, EP 2 (DP 2), PP 2,
           DP 2; with 4 GPUs TP2 x EP2, TP2 x PP2, PP2 x EP2; with 8 TP2 x PP2 x EP2 x DP2 (the 8K
           recipe's shape) and EP 8. A second one-GPU run (`1gpu_repeat`) measures how far two runs
           of one layout already drift apart. Per layout: lm loss per step against the one-GPU run
           (largest absolute and relative difference), KL and grad norm differences, tokens/s per
           GPU, peak memory (rank 0's max_memory_allocated, and each GPU's nvidia-smi maximum).
  preempt  `small` on all N GPUs (TP 2 + SP; with 4 GPUs also EP 2; with 8 also PP 2), trainer.
           deterministic=true, trained on a blend of two datasets prepared from slices of this
           machine's site-packages (`python -m data.prepare --tokenizer byte`, data.blend, data.split
           98/2) with the validation loss every 4 steps and the indexer warmup ending after the
           resume. The drill: the job is started as launch/slurm.py starts torchrun (USR1 and TERM
           ignored by torchrun, which leaves them to the trainers); once a periodic checkpoint
           exists and step 6 is logged, SIGUSR1 goes to the launcher and every process it started,
           as SLURM delivers `scancel --signal=USR1` to every process of a step (torchrun starts
           each rank in a session of its own: a signal to its process group would not reach them,
           and without the `trap` USR1 would kill torchrun and leave the ranks training); every
           rank finishes its step and saves, the launcher exits 0, and `<run_dir>/launch.sh` (the
           relaunch command the run wrote) resumes it. Checks: the stop line, `latest` naming the
           stop save, a shard file of every rank in it, "resumed from" in the relaunch's log, and
           every logged number of every step (losses, KL, aux loss, grad norms, lr, keys/query,
           validation losses) equal bit for bit to an uninterrupted run's.
  cp       `small`, data.document_mask=true, MSA-PT: loss parity CP 1 vs CP 2 (and 4) at 32K from one
           init's weights; throughput of CP 2 (and 4) at 256K and 512K with full recompute, then
           CP 1 at both lengths for the speed-up.
  scaling  `small`, dense vs MSA-PT, tokens/s per GPU at 32K and 128K on 1, 2, 4 .. N GPUs: data
           parallel (one 64K-token share of the global batch a GPU) and context parallel (CP = the
           GPU count, the one-GPU batch); efficiency of each doubling = tok/s/GPU at 2n / at n.

Jobs: each is its own process session (torchrun or `python train.py` for one GPU), on GPUs no other
job holds (jobs start in the order above as GPUs free up; a job waits for those it needs, e.g. the
layouts for `init`), with a timeout and its log in --work/logs. A failed job is recorded with its
last error line and the driver goes on (jobs that need it are recorded as failed too). A job is not
started when its estimated time (a per-job estimate scaled by how long the finished jobs took
against theirs) does not fit in the budget left; the report lists it as skipped. A job whose
result file exists in --work/results (with the same command) is skipped; a part whose jobs all
have results writes --work/parts/<part>.json and is skipped as a whole afterwards (--retry-failed
runs failed jobs again). Checkpoints are deleted once their part is done (--keep-checkpoints).

Report, every call: OUT/multi_gpu.json (every job: command, status, wall time, per-step metrics;
each part's analysis; the machine), OUT/multi_gpu.md (tables for bench/RESULTS.md and HISTORY.md
with the exact commands), OUT/driver.log and OUT/logs.tar.gz (every job's log).

--cpu (or MSA_MULTI_GPU_CPU=1) runs every part on this machine's CPU instead: a 2-layer `tiny`,
256-token samples (CP up to 2K), a few steps, --gpus gloo processes (default 2): the driver's logic,
the reports, the resume and the preemption drill without a GPU (tests/test_multi_gpu_driver.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import sysconfig
import tarfile
import threading
import time
from pathlib import Path

from msa_model.training.metrics_file import read_metrics

sys.path.insert(0, str(Path(__file__).resolve().parent))
from multi_gpu_plan import (CPU, GPU, LAYOUTS, PARTS, REPO, InputError, Job, Plan, last_error,  # noqa: E402
                            progress_lines, say, shell, signal_tree, summarise)
from multi_gpu_report import analyse, machine, markdown  # noqa: E402


class Driver:
    """Runs the plan's jobs on the machine's GPUs (or CPU slots) within the budget; results, logs and
    part files in --work."""

    def __init__(self, args, plan: Plan):
        self.args, self.plan, self.z = args, plan, plan.z
        self.work = plan.work
        self.results_dir, self.parts_dir, self.logs = self.work / "results", self.work / "parts", self.work / "logs"
        for d in (self.results_dir, self.parts_dir, self.logs):
            d.mkdir(parents=True, exist_ok=True)
        self.start = time.monotonic()
        self.end = self.start + args.budget
        self.jobs = {j.name: j for j in plan.jobs}
        self.running: dict[str, Job] = {}
        self.skipped: dict[str, str] = {}  # job -> why it did not start in this call
        self.ran: list[str] = []
        self.scale_samples: list[float] = []
        self.free = list(range(args.gpus))
        self.mem: dict[str, dict[int, float]] = {}  # job -> GPU -> max MiB used (nvidia-smi)
        self.lock = threading.Lock()  # self.mem, written by the sampling thread
        self.sampling = threading.Event()
        self.complete_parts: set[str] = set()
        self._results: dict[str, dict | None] = {}
        self.remake: set[str] = set()  # done, but their outputs are gone and a job to run needs them

    # results on disk (read once, then kept)
    def result(self, name: str) -> dict | None:
        if name not in self._results:
            path = self.results_dir / f"{self.jobs[name].file}.json"
            self._results[name] = json.loads(path.read_text()) if path.is_file() else None
        return self._results[name]

    def write_result(self, job: Job, result: dict) -> None:
        path = self.results_dir / f"{job.file}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1))
        os.replace(tmp, path)
        self._results[job.name] = result

    def drop_result(self, job: Job) -> None:
        (self.results_dir / f"{job.file}.json").unlink(missing_ok=True)
        self._results[job.name] = None

    def done(self, job: Job) -> bool:
        r = self.result(job.name)
        return r is not None and r.get("signature") == job.signature(self.work) and job.name not in self.remake

    def usable(self, name: str) -> bool | None:
        """A dependency: True when done and its outputs exist, False when it failed, None: not yet."""
        job = self.jobs[name]
        r = self.result(name)
        if r is None or r.get("signature") != job.signature(self.work) or name in self.running:
            return None
        if r["status"] != "ok":
            return False
        return all(p.exists() for p in job.outputs) or None

    def scale(self) -> float:
        """How long jobs take against their estimates, so far (1 until a job has finished)."""
        return min(3.0, max(0.5, statistics.median(self.scale_samples))) if self.scale_samples else 1.0

    def left(self) -> float:
        return self.end - time.monotonic()

    def import_results(self, path: Path) -> None:
        if not path.is_file():
            raise InputError(f"--import {path}: no such file")
        earlier = json.loads(path.read_text()).get("jobs", {})
        for job in self.plan.jobs:
            r = earlier.get(job.name)
            if r and r.get("status") == "ok" and r.get("signature") == job.signature(self.work) and not self.done(job):
                self.write_result(job, {**r, "imported": str(path)})
                say(f"{job.name}: imported from {path}")

    # the loop
    def pending(self) -> list[Job]:
        return [j for j in self.plan.jobs if j.name not in self.running and not self.done(j)
                and j.name not in self.skipped and j.part not in self.complete_parts]

    def needs_remake(self, job: Job) -> bool:
        """A job done but whose outputs are gone while a job still to run needs them."""
        return (self.done(job) and self.result(job.name)["status"] == "ok" and job.name not in self.running
                and not all(p.exists() for p in job.outputs)
                and any(job.name in j.deps and not self.done(j) and j.name not in self.skipped for j in self.plan.jobs))

    def run(self) -> None:
        if self.args.retry_failed:
            for job in self.plan.jobs:
                r = self.result(job.name)
                if r is not None and r["status"] != "ok":
                    self.drop_result(job)
        self.complete_parts = {p for p in self.args.parts if self.part_complete(p)}
        for p in sorted(self.complete_parts):
            say(f"{p}: done in an earlier call ({self.parts_dir / (p + '.json')}); skipped")
        if not self.z.cpu:
            threading.Thread(target=self.sample_memory, daemon=True).start()
        try:
            while True:
                self.reap()
                for job in self.plan.jobs:
                    if self.needs_remake(job):
                        say(f"{job.name}: its files are gone ({', '.join(str(p) for p in job.outputs)}) and a job "
                            "still to run needs them: it runs again")
                        self.remake.add(job.name)
                if self.left() <= 0:
                    for job in list(self.running.values()):
                        self.kill(job, "the budget's end")
                    break
                self.finish_parts()
                self.start_jobs()
                if not self.running:
                    break
                for job in list(self.running.values()):
                    self.track(job)
                    if job.watch:
                        job.watch(job)
                time.sleep(0.2 if self.z.cpu else 1.0)
        finally:
            for job in list(self.running.values()):
                self.kill(job, "the driver's exit")
            self.sampling.set()
        self.finish_parts()
        for job in self.pending():
            waits = [d for d in job.deps if not self.usable(d)]
            self.skipped[job.name] = f"waits for {', '.join(waits)}" if waits else "not reached"

    def finish_parts(self) -> None:
        for part in self.args.parts:
            if part not in self.complete_parts and part not in self.plan.skipped_parts and self.all_ended(part):
                self.finish_part(part)
                self.complete_parts.add(part)

    def start_jobs(self) -> None:
        """In order: a job whose dependencies are not ready is passed over; the first that waits for
        GPUs stops the scan (no later job jumps ahead of it)."""
        for job in self.pending():
            deps = [self.usable(d) for d in job.deps]
            if any(d is False for d in deps):
                failed = [d for d, ok in zip(job.deps, deps) if ok is False]
                self.record(job, {"status": "failed", "error": f"needs {', '.join(failed)}, which failed",
                                  "rc": None, "wall_s": 0})
                continue
            if any(d is None for d in deps):
                continue
            need = job.estimate_s * self.scale() + (3 if self.z.cpu else 15)
            if need > self.left():
                self.skipped[job.name] = f"needs about {need:.0f} s, {max(0, self.left()):.0f} s left"
                say(f"{job.name}: not started ({self.skipped[job.name]})")
                continue
            if job.world > len(self.free):
                return
            if self.args.serial and job.world and any(j.world for j in self.running.values()):
                return
            self.launch(job)

    def env(self, job: Job) -> dict:
        env = dict(os.environ)
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(key, None)
        cores = os.cpu_count() or 1
        threads = 1 if self.z.cpu else max(1, cores // max(self.args.gpus, 1))
        env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(threads))
        env.setdefault("NCCL_DEBUG", "WARN")
        env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        if not self.z.cpu and job.world:
            # nvidia-smi's numbering (the memory samples); the GPUs this driver was given, if it was
            env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.device_id(g) for g in job.gpus)
        return env

    def device_id(self, slot: int) -> str:
        given = os.environ.get("CUDA_VISIBLE_DEVICES")
        return given.split(",")[slot] if given else str(slot)

    def launch(self, job: Job) -> None:
        if not job.reproducible:
            for other in self.plan.jobs:
                if job.name in other.deps and self.result(other.name) is not None:
                    self.drop_result(other)
                    say(f"{other.name}: its result goes (it came from an earlier run of {job.name})")
        job.gpus = [self.free.pop(0) for _ in range(job.world)]
        if job.fresh and job.run_dir is not None:
            shutil.rmtree(job.run_dir, ignore_errors=True)
        if job.run_dir is not None:
            job.run_dir.parent.mkdir(parents=True, exist_ok=True)
        log = self.logs / f"{job.file}.log"
        job.note = {}
        with open(log, "w") as f:
            f.write(f"# {shell(job.argv(), job.gpus if not self.z.cpu else None)}\n")
            f.flush()
            job.proc = subprocess.Popen(job.argv(), cwd=REPO, env=self.env(job), stdout=f, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        job.started = time.monotonic()
        job.timeout_s = max(4 * job.estimate_s, 120 if self.z.cpu else 300)
        self.running[job.name] = job
        where = f" on GPU {','.join(map(str, job.gpus))}" if job.world and not self.z.cpu else \
            f" ({job.world} processes)" if job.world else " (CPU)"
        say(f"{job.name}: started{where}, about {job.estimate_s * self.scale():.0f} s")

    def track(self, job: Job) -> None:
        """Remember every process of a job: a rank left behind by a launcher that died must not keep
        its GPU from the next job."""
        import psutil

        try:
            for proc in psutil.Process(job.proc.pid).children(recursive=True):
                job.note.setdefault("_pids", {})[proc.pid] = proc.create_time()
        except psutil.NoSuchProcess:
            pass

    def end_leftovers(self, job: Job) -> int:
        import psutil

        left = 0
        for pid, created in job.note.pop("_pids", {}).items():
            try:
                proc = psutil.Process(pid)
                if proc.create_time() == created and proc.status() != psutil.STATUS_ZOMBIE:
                    proc.kill()
                    left += 1
            except psutil.NoSuchProcess:
                pass
        return left

    def kill(self, job: Job, why: str) -> None:
        signal_tree(job.proc.pid, signal.SIGKILL)
        job.proc.wait()
        self.end_leftovers(job)
        self.running.pop(job.name, None)
        self.free = sorted(self.free + job.gpus)
        self.skipped[job.name] = f"killed at {why} after {time.monotonic() - job.started:.0f} s"
        say(f"{job.name}: {self.skipped[job.name]}; it starts again in the next call")

    def reap(self) -> None:
        for job in list(self.running.values()):
            rc = job.proc.poll()
            wall = time.monotonic() - job.started
            if rc is None and wall > job.timeout_s:
                signal_tree(job.proc.pid, signal.SIGKILL)
                job.proc.wait()
                rc = "timeout"
            elif rc is None:
                continue
            del self.running[job.name]
            left = self.end_leftovers(job)
            if left:
                say(f"{job.name}: {left} of its processes outlived its launcher; killed")
                job.note["processes_left"] = left
            self.free = sorted(self.free + job.gpus)
            self.finish(job, rc, wall)

    def finish(self, job: Job, rc, wall: float) -> None:
        log = self.logs / f"{job.file}.log"
        text = log.read_text(errors="replace") if log.is_file() else ""
        # a job without a run directory (data preparation) logs no steps
        records = read_metrics(job.run_dir) if job.run_dir else []
        result = {"status": "ok" if rc == 0 else "failed", "rc": rc, "wall_s": round(wall, 1), "log": str(log),
                  "records": records, "summary": summarise(records, job.world)}
        if rc == "timeout":
            result["error"] = f"timeout after {job.timeout_s:.0f} s; last line: {last_error(text)}"
        elif rc != 0:
            result["error"] = last_error(text)
        elif job.check is not None:
            problems = job.check(job, result)
            if problems:
                result.update(status="failed", error="; ".join(problems))
        with self.lock:
            mem = self.mem.pop(job.name, {})
        if mem:
            result["gpu_mem_used_gib"] = {str(g): round(v / 1024, 2) for g, v in sorted(mem.items())}
        if result["status"] == "ok":
            self.scale_samples.append(wall / job.estimate_s)
        self.record(job, result)

    def record(self, job: Job, result: dict) -> None:
        result = {"name": job.name, "signature": job.signature(self.work), "world": job.world, "gpus": job.gpus,
                  "command": shell(job.argv(), job.gpus if job.world and not self.z.cpu else None),
                  "estimate_s": round(job.estimate_s, 1), "note": dict(job.note), **result}
        self.write_result(job, result)
        self.remake.discard(job.name)
        self.ran.append(job.name)
        s = result.get("summary", {})
        extra = f"; {s['tokens_per_s_per_gpu']:,.0f} tok/s per GPU" if s.get("tokens_per_s_per_gpu") else ""
        say(f"{job.name}: {result['status']} in {result['wall_s']} s{extra}"
            + (f": {result['error']}" if result.get("error") else ""))

    def sample_memory(self) -> None:
        """Each running job's largest nvidia-smi memory.used on each of its GPUs, every 2 s."""
        while not self.sampling.wait(2.0):
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=20).stdout
            except (OSError, subprocess.TimeoutExpired):
                return
            used = {int(i): float(m) for i, m in (line.split(",") for line in out.strip().splitlines() if "," in line)}
            with self.lock:
                for job in list(self.running.values()):
                    seen = self.mem.setdefault(job.name, {})
                    for g in job.gpus:
                        index = self.device_id(g)
                        if index.isdigit() and int(index) in used:
                            seen[g] = max(seen.get(g, 0.0), used[int(index)])

    # parts
    def part_jobs(self, part: str) -> list[Job]:
        return [j for j in self.plan.jobs if j.part == part]

    def all_ended(self, part: str) -> bool:
        return all(self.done(j) for j in self.part_jobs(part))

    def part_complete(self, part: str) -> bool:
        path = self.parts_dir / f"{part}.json"
        if not path.is_file():
            return False
        saved = json.loads(path.read_text())
        want = {j.name: j.signature(self.work) for j in self.part_jobs(part)}
        if saved.get("signatures") != want:
            return False
        return all(self.done(j) for j in self.part_jobs(part))

    def finish_part(self, part: str) -> None:
        jobs = self.part_jobs(part)
        (self.parts_dir / f"{part}.json").write_text(json.dumps(
            {"signatures": {j.name: j.signature(self.work) for j in jobs},
             "analysis": analyse(part, self.results(), self.plan)}, indent=1))
        say(f"{part}: every job has its result ({self.parts_dir / (part + '.json')})")
        if not self.args.keep_checkpoints:
            for job in jobs:
                if job.run_dir is not None:
                    shutil.rmtree(job.run_dir / "checkpoints", ignore_errors=True)

    def results(self) -> dict[str, dict]:
        return {j.name: r for j in self.plan.jobs if (r := self.result(j.name)) is not None}


def write_report(driver: Driver, plan: Plan, argv: list[str]) -> tuple[Path, Path]:
    results = driver.results()
    parts = {}
    for part in plan.args.parts:
        if part in plan.skipped_parts:
            continue
        saved = driver.parts_dir / f"{part}.json"
        parts[part] = json.loads(saved.read_text())["analysis"] if part in driver.complete_parts else \
            analyse(part, results, plan)
    report = {"machine": machine(plan.n, plan.z.cpu), "command": " ".join(["python3 bench/multi_gpu.py", *argv]),
              "call": {"seconds": time.monotonic() - driver.start, "budget": plan.args.budget, "ran": driver.ran,
                       "skipped": driver.skipped},
              "parts": parts, "parts_skipped": plan.skipped_parts, "jobs": results}
    out = Path(plan.args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "multi_gpu.json").write_text(json.dumps(report, indent=1))
    (out / "multi_gpu.md").write_text(markdown(report, plan))
    with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
        for log in sorted(driver.logs.glob("*.log")):
            tar.add(log, arcname=log.name)
    if (plan.work / "driver.log").is_file():
        shutil.copy(plan.work / "driver.log", out / "driver.log")
    return out / "multi_gpu.json", out / "multi_gpu.md"


def simulate(plan: Plan, n: int) -> dict[str, float]:
    """Minutes per part with the driver's start rule (in order, no jumping a job that waits for GPUs)
    on the estimates: when each part's last job would end, and its GPU-minutes."""
    free, t, ends, running, done = n, 0.0, {}, [], set()
    todo = list(plan.jobs)
    while todo or running:
        for job in list(todo):
            if not all(d in done for d in job.deps):
                continue
            if job.world > free:
                break
            free -= job.world
            running.append((t + job.estimate_s, job))
            todo.remove(job)
        if not running:
            break
        running.sort(key=lambda x: x[0])
        t, job = running.pop(0)
        free += job.world
        done.add(job.name)
        ends[job.part] = t
    return ends


def dry_run(plan: Plan) -> None:
    ends = simulate(plan, plan.n)
    previous = 0.0
    for part in plan.args.parts:
        jobs = [j for j in plan.jobs if j.part == part]
        if part in plan.skipped_parts:
            print(f"# {part}: not run ({plan.skipped_parts[part]})")
            continue
        gpu_min = sum(j.estimate_s * max(j.world, 0) for j in jobs) / 60
        print(f"# {part}: {len(jobs)} jobs, about {(ends.get(part, previous) - previous) / 60:.1f} min more "
              f"(ends at {ends.get(part, previous) / 60:.1f} min; {gpu_min:.1f} GPU-minutes)")
        previous = max(previous, ends.get(part, previous))
        for j in jobs:
            print(f"{j.name}  [{j.world} GPU, ~{j.estimate_s:.0f} s]  {shell(j.argv())}")
    print(f"# all: about {previous / 60:.1f} min on {plan.n} {'processes' if plan.z.cpu else 'GPUs'} "
          "(estimates; a call scales them by how long its finished jobs took)")


def visible_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0


def parse(argv: list[str]):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=None,
                   help="GPUs to use (default: every visible one; --cpu: 2 processes)")
    p.add_argument("--out", default=None, help="where the report goes (default: WORK/report)")
    p.add_argument("--work", default="/tmp/multi_gpu", help="runs, results and logs, kept between calls")
    p.add_argument("--budget", type=float, default=540, help="seconds this call may use")
    p.add_argument("--parts", default=",".join(PARTS), help=f"a subset of {','.join(PARTS)} (run in that order)")
    p.add_argument("--steps", type=int, default=None, help="steps of the parity runs (default 20; --cpu 3)")
    p.add_argument("--layouts", default=None, help=f"parity layouts (default: all that fit): {','.join(LAYOUTS)}")
    p.add_argument("--cp-lengths", default=None, help="CP throughput lengths (default 262144,524288)")
    p.add_argument("--scaling-lengths", default=None, help="scaling lengths (default 32768,131072)")
    p.add_argument("--corpus", default=sysconfig.get_paths()["purelib"],
                   help="the site-packages the drill's data come from")
    p.add_argument("--import", dest="import_", default=None, metavar="MULTI_GPU_JSON",
                   help="take the finished jobs of an earlier report (a machine that lost --work)")
    p.add_argument("--retry-failed", action="store_true", help="run failed jobs again")
    p.add_argument("--keep-checkpoints", action="store_true", help="keep checkpoints of finished parts")
    p.add_argument("--serial", action="store_true", help="one GPU job at a time (no jobs side by side)")
    p.add_argument("--dry-run", action="store_true", help="print the jobs, their commands and estimated minutes")
    p.add_argument("--cpu", action="store_true", default=os.environ.get("MSA_MULTI_GPU_CPU") == "1",
                   help="run everything on the CPU with a tiny model (also MSA_MULTI_GPU_CPU=1)")
    a = p.parse_args(argv)
    a.parts = [x for x in a.parts.split(",") if x]
    bad = [x for x in a.parts if x not in PARTS]
    if bad:
        p.error(f"--parts: unknown {bad} (known: {', '.join(PARTS)})")
    a.parts = [x for x in PARTS if x in a.parts]
    a.layouts = [x for x in a.layouts.split(",") if x] if a.layouts else None
    for name in ("cp_lengths", "scaling_lengths"):
        value = getattr(a, name)
        if value:
            try:
                setattr(a, name, tuple(int(x) for x in value.split(",")))
            except ValueError:
                p.error(f"--{name.replace('_', '-')}: comma-separated whole numbers, got {value!r}")
    sizes = CPU if a.cpu else GPU
    a.steps = a.steps or sizes.steps
    if a.gpus is None:
        a.gpus = 2 if a.cpu else (8 if a.dry_run else visible_gpus())
    if not a.dry_run and not a.cpu and a.gpus > visible_gpus():
        p.error(f"--gpus {a.gpus}: this machine shows {visible_gpus()} GPU(s) (--cpu runs on the CPU)")
    if a.gpus < 1 or a.steps < 2:
        p.error("--gpus must be >= 1 and --steps >= 2")
    a.out = a.out or str(Path(a.work) / "report")
    return a, sizes


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args, sizes = parse(argv)
    try:
        plan = Plan(args, sizes)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        dry_run(plan)
        return 0
    plan.work.mkdir(parents=True, exist_ok=True)
    progress_lines(plan.work / "driver.log")
    driver = Driver(args, plan)
    try:
        if args.import_:
            driver.import_results(Path(args.import_))
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    say(f"{len(plan.jobs)} jobs ({', '.join(args.parts)}) on {args.gpus} {'processes (CPU)' if sizes.cpu else 'GPUs'}; "
        f"budget {args.budget:.0f} s; work {plan.work}")
    driver.run()
    json_path, md_path = write_report(driver, plan, argv)
    left = [j.name for j in plan.jobs if not driver.done(j)]
    failed = [n for n, r in driver.results().items() if r["status"] != "ok"]
    say(f"report: {md_path} and {json_path}; " + (f"{len(left)} job(s) left for the next call: the same command "
                                                  "continues" if left else "every job has its result")
        + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 3 if left else (1 if failed else 0)


if __name__ == "__main__":
    sys.exit(main())
