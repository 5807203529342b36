"""What bench/multi_gpu.py runs: each part's jobs (train.py overrides, parallel layouts, the sizes of a
GPU machine and of the CPU check), how long each should take, and the preemption drill's hooks (the
signal, and the checks of the stop save and of the relaunch)."""

from __future__ import annotations

import logging
import os
import re
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from msa_model.training.metrics_file import read_metrics

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from bench_training import step_medians  # noqa: E402
from check_deterministic import COMPARED  # noqa: E402  (the per-step numbers a deterministic resume keeps)

PARTS = ("parity", "preempt", "cp", "scaling")
# every logged number a resumed run must repeat bit for bit, validation included
DRILL_KEYS = (*COMPARED, "valid/lm_loss", "valid/kl_loss")
_progress = logging.getLogger("multi_gpu")
say = _progress.info


def progress_lines(path: Path | None) -> None:
    """Progress lines with the time of day on stdout, and in `path` (the work directory's driver.log)."""
    _progress.handlers.clear()
    _progress.setLevel(logging.INFO)
    _progress.propagate = False
    for handler in [logging.StreamHandler(sys.stdout), *([logging.FileHandler(path)] if path else [])]:
        handler.setFormatter(logging.Formatter("[%(asctime)s] %(message)s", "%H:%M:%S"))
        _progress.addHandler(handler)


def merged(*lists: list[str]) -> list[str]:
    """Overrides in order, a later value of a key replacing an earlier one."""
    out = {item.split("=", 1)[0]: item for items in lists for item in items}
    return list(out.values())


@dataclass(frozen=True)
class Sizes:
    """The models, lengths, batches and steps of every part: one set for GPUs, one for the CPU check."""

    cpu: bool
    model: dict  # part -> the overrides that choose its model
    parity_seq: int
    parity_batch: int
    parity_micro: int
    steps: int  # parity steps (parity and CP parity)
    cp_parity_seq: int
    cp_lengths: tuple[int, ...]
    speed_steps: int
    drill_seq: int
    drill_batch: int
    drill_micro: int
    drill_steps: int
    drill_interval: int  # checkpoint and validation interval
    drill_signal_after: int  # SIGUSR1 once this step is logged (a checkpoint exists by then)
    drill_warmup_steps: int  # the indexer warmup ends after this step (after the resume)
    slice_bytes: int  # each prepared dataset: site-packages' .py files up to about this much
    drill_split: str  # data.split (train, validation, test): a validation share of every dataset
    scaling_lengths: tuple[int, ...]
    scaling_tokens: int  # per GPU per step (data parallel), the one-GPU step (context parallel)
    scaling_steps: int
    rate: Callable[[str, str, int], float]  # (model, variant, T) -> guessed tokens/s of one GPU
    start_s: float  # start-up of a one-process job
    torchrun_s: float  # more for torchrun, and per rank
    save_s: dict  # model -> seconds to save (or load) a checkpoint


def _gpu_rate(model: str, variant: str, T: int) -> float:
    """Tokens/s of one H200, from bench/RESULTS.md (documents masked; 256K+ with full recompute)."""
    if model == "msa_109b_proxy":
        return 70e3 if variant == "pt" else 60e3
    table = {"pt": {8192: 47e3, 32768: 90e3, 131072: 120e3, 262144: 47e3, 524288: 36e3},
             "dense": {8192: 90e3, 32768: 60e3, 131072: 40e3, 262144: 15e3, 524288: 8e3}}[variant]
    return table[min(table, key=lambda t: abs(t - T))]


# a 2-layer tiny, a few tenths of a second a step on one core; both layers MoE, so that every
# pipeline stage holds experts (which expert parallelism with pipeline stages needs: config.validate)
CPU_MODEL = ["model=tiny", "model.num_layers=2", "model.first_dense_layers=0", "model.hidden_size=128",
             "model.ffn_hidden_size=256", "model.moe_ffn_hidden_size=128", "model.msa.block_size=16"]

GPU = Sizes(cpu=False, model={"parity": ["model=msa_109b_proxy"], "cp": ["model=small"], "preempt": ["model=small"],
                              "scaling": ["model=small"]},
            parity_seq=8192, parity_batch=4, parity_micro=1, steps=20, cp_parity_seq=32768,
            cp_lengths=(262144, 524288), speed_steps=5, drill_seq=8192, drill_batch=8, drill_micro=1,
            drill_steps=16, drill_interval=4, drill_signal_after=6, drill_warmup_steps=10,
            slice_bytes=12_000_000, drill_split="[98,2,0]", scaling_lengths=(32768, 131072), scaling_tokens=65536,
            scaling_steps=6,
            rate=_gpu_rate, start_s=20, torchrun_s=10, save_s={"msa_109b_proxy": 30, "small": 15})
CPU = Sizes(cpu=True, model={p: CPU_MODEL for p in PARTS}, parity_seq=256, parity_batch=4, parity_micro=2, steps=3,
            cp_parity_seq=512, cp_lengths=(1024, 2048), speed_steps=2, drill_seq=256, drill_batch=4, drill_micro=2,
            drill_steps=10, drill_interval=2, drill_signal_after=3, drill_warmup_steps=5, slice_bytes=300_000,
            drill_split="[80,20,0]",
            scaling_lengths=(256, 512), scaling_tokens=1024, scaling_steps=3,
            rate=lambda model, variant, T: 2500.0, start_s=7, torchrun_s=4, save_s={"tiny": 1})

COMMON = ["logging.log_interval=1", "logging.wandb_mode=disabled", "logging.tensorboard=false",
          "logging.progress_bar=false", "optim.warmup_steps=1", "checkpoint.interval=0", "checkpoint.save_at_end=false"]
MSA_PT = ["recipe=pt", "trainer.indexer_warmup_tokens=0"]


def model_name(overrides: list[str]) -> str:
    return next(o.split("=", 1)[1] for o in reversed(overrides) if o.startswith("model="))


@dataclass
class Job:
    name: str  # "<part>/<job>"
    world: int  # GPUs (processes); 0: a CPU command beside the GPU jobs
    overrides: list[str] = field(default_factory=list)  # train.py's (when `command` is None)
    command: list[str] | None = None  # anything else: data.prepare, a relaunch
    run_dir: Path | None = None
    estimate_s: float = 60.0
    deps: tuple[str, ...] = ()
    outputs: tuple[Path, ...] = ()  # what the jobs that need this one read: re-made when missing
    fresh: bool = True  # start from an empty run directory
    # its outputs are the same whenever it runs (a deterministic init, prepared data): the jobs that
    # used an earlier run's stay valid when it runs again
    reproducible: bool = False
    stoppable: bool = False  # torchrun started as launch/slurm.py starts it (USR1/TERM left to the trainers)
    watch: Callable | None = None  # watch(job) while it runs
    check: Callable | None = None  # check(job, result) -> problems, once it ended with exit 0
    # filled in while running
    proc: subprocess.Popen | None = None
    gpus: list[int] = field(default_factory=list)
    started: float = 0.0
    timeout_s: float = 0.0
    note: dict = field(default_factory=dict)

    @property
    def part(self) -> str:
        return self.name.split("/", 1)[0]

    @property
    def file(self) -> str:
        return self.name.replace("/", "__")

    def argv(self) -> list[str]:
        if self.command is not None:
            return self.command
        args = [*self.overrides, f"run_dir={self.run_dir}"]
        if self.world <= 1 and not self.stoppable:
            return [sys.executable, "train.py", *args]
        run = [sys.executable, "-m", "torch.distributed.run"]
        if self.stoppable:
            # launch/slurm.py's torchrun line: USR1 would kill torchrun and TERM would become a
            # TERM-then-KILL of its workers, so it ignores both and leaves them to the trainers
            return ["bash", "-c", 'trap "" USR1 TERM; exec "$@"', "launcher", *run,
                    "--signals-to-handle=SIGINT,SIGHUP,SIGQUIT", "--standalone", f"--nproc-per-node={self.world}",
                    "train.py", *args]
        return [*run, "--standalone", f"--nproc-per-node={self.world}", "train.py", *args]

    def signature(self, work: Path) -> str:
        """The command without the machine's paths: a result made with another command is not this job's."""
        text = " ".join(self.argv()).replace(str(work), "<work>").replace(sys.executable, "python")
        return re.sub(r"data\.cache_dir=\S+", "data.cache_dir=<cache>", text)


def summarise(records: list[dict], world: int) -> dict:
    """Medians over the steps after the first two (compilation, cuDNN plans), peak memory over all."""
    out = step_medians(records, ("tokens_per_s", "step_ms", "tflops_per_gpu"))
    if "tokens_per_s" in out:
        out["tokens_per_s_per_gpu"] = out["tokens_per_s"] / max(world, 1)
    return out


def last_error(text: str) -> str:
    """The line that says why a job failed: the trainer's own `error:` line, else an exception's."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for pattern in (r"\berror: ", r"out of memory", r"\w+Error\b", r"Traceback"):
        for i in range(len(lines) - 1, -1, -1):
            if re.search(pattern, lines[i]):
                # a message that lists its problems below it ("invalid configuration:\n  - ...")
                more = [m for m in lines[i + 1:i + 4] if m.startswith("- ")] if lines[i].endswith(":") else []
                return " ".join([lines[i], *more])[:600]
    return lines[-1][:400] if lines else "no output"


def signal_tree(pid: int, sig: int) -> int:
    """`sig` to a process and everything it started (torchrun starts each rank in a session of its
    own, so its process group is not enough), as SLURM signals every process of a job step. Returns
    how many processes got it."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    sent = 0
    for proc in procs:
        try:
            proc.send_signal(sig)
            sent += 1
        except psutil.NoSuchProcess:
            pass
    return sent


def shell(argv: list[str], gpus: list[int] | None = None) -> str:
    env = f"CUDA_VISIBLE_DEVICES={','.join(map(str, gpus))} " if gpus else ""
    return env + " ".join(shlex.quote(a) for a in argv).replace(sys.executable, "python3")


# parity layouts: name -> (GPUs, parallel overrides, least GPUs of the machine for it to run)
LAYOUTS = {
    "tp2": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"], 2),
    "ep2": (2, ["parallel.ep=2"], 2),
    "1gpu_repeat": (1, [], 2),
    "pp2": (2, ["parallel.pp=2"], 2),
    "dp2": (2, [], 2),
    "tp2_ep2": (4, ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=2"], 4),
    "tp2_pp2": (4, ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.pp=2"], 4),
    "pp2_ep2": (4, ["parallel.pp=2", "parallel.ep=2"], 4),
    "tp2_pp2_ep2": (8, ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.pp=2", "parallel.ep=2"], 8),
    "ep8": (8, ["parallel.ep=8"], 8),
}


def _tp(overrides: list[str]) -> int:
    return next((int(o.split("=")[1]) for o in overrides if o.startswith("parallel.tp=")), 1)


def layout_text(world: int, overrides: list[str]) -> str:
    """"TP 2 x DP 1 ..." from a job's parallel overrides and its world size."""
    dims = {k: 1 for k in ("tp", "pp", "cp", "ep")}
    for o in overrides:
        m = re.fullmatch(r"parallel\.(tp|pp|cp|ep)=(\d+)", o)
        if m:
            dims[m.group(1)] = int(m.group(2))
    dp = max(1, world // (dims["tp"] * dims["pp"] * dims["cp"]))
    parts = [f"{k.upper()} {v}" for k, v in dims.items() if v > 1] + ([f"DP {dp}"] if dp > 1 else [])
    sp = " + SP" if "parallel.sequence_parallel=true" in overrides else ""
    return (" x ".join(parts) or "1 GPU") + sp


class Plan:
    """Every job of the chosen parts, in priority order, and where their files go."""

    def __init__(self, args, sizes: Sizes):
        self.args, self.z, self.n = args, sizes, args.gpus
        self.work = Path(args.work).resolve()
        cache = os.environ.get("MSA_DATA_CACHE_DIR") if sizes.cpu else None
        self.cache = Path(cache) if cache else self.work / "data-cache"
        self.jobs: list[Job] = []
        self.skipped_parts: dict[str, str] = {}
        for part in args.parts:
            getattr(self, f"_{part}")()

    def common(self, part: str) -> list[str]:
        return [*self.z.model[part], *COMMON, f"data.cache_dir={self.cache}"]

    def run_dir(self, name: str) -> Path:
        return self.work / "runs" / name

    def estimate(self, model: str, variant: str, T: int, tokens_per_step: int, steps: int, world: int,
                 saves: int = 0, loads: int = 0, deterministic: bool = False) -> float:
        """Seconds: start-up, the steps at a guessed rate, checkpoint saves (and weight loads: a third)."""
        z = self.z
        rate = z.rate(model, variant, T) * max(world, 1) * (0.8 if world > 1 else 1.0) * (0.9 if deterministic else 1)
        start = z.start_s + (z.torchrun_s + world if world > 1 else 0)
        return start + steps * tokens_per_step / rate + (saves + loads / 3) * z.save_s.get(model, 15)

    def add(self, job: Job) -> Job:
        self.jobs.append(job)
        return job

    def train_job(self, name: str, world: int, overrides: list[str], estimate: float, **kw) -> Job:
        return self.add(Job(name, world, overrides, run_dir=self.run_dir(name), estimate_s=estimate, **kw))

    def init_job(self, name: str, base: list[str], variant: str, T: int, batch: int) -> Job:
        """One deterministic step of one GPU, saved: the weights every layout of the part starts from
        (deterministic, so that a machine that lost it makes the same again)."""
        model = model_name(base)
        overrides = merged(base, ["trainer.max_steps=1", "optim.warmup_steps=0", "trainer.deterministic=true",
                                  "checkpoint.save_at_end=true", f"model.make_vocab_size_divisible_by={128}"])
        job = self.train_job(name, 1, overrides, self.estimate(model, variant, T, batch * T, 1, 1, saves=1) + 20)
        job.outputs, job.reproducible = (job.run_dir / "checkpoints",), True
        return job

    def _parity(self) -> None:
        z, T = self.z, self.z.parity_seq
        base = merged(self.common("parity"), MSA_PT,
                      [f"model.seq_length={T}", f"parallel.micro_batch_size={z.parity_micro}",
                       f"parallel.global_batch_size={z.parity_batch}"])
        model = model_name(base)
        chosen = [name for name, (w, _, least) in LAYOUTS.items() if least <= self.n]
        if self.args.layouts:
            unknown = [name for name in self.args.layouts if name not in LAYOUTS]
            if unknown:
                raise InputError(f"--layouts: unknown {unknown} (known: {', '.join(LAYOUTS)})")
            chosen = [name for name in self.args.layouts if LAYOUTS[name][0] <= self.n]
        if self.n < 2:
            self.skipped_parts["parity"] = "needs at least 2 GPUs"
            return
        init = self.init_job("parity/init", base, "pt", T, z.parity_batch)
        steps = [f"trainer.max_steps={self.args.steps}", f"init_from={init.run_dir / 'checkpoints'}"]
        for name, world, parallel in [("1gpu", 1, [])] + [(n, LAYOUTS[n][0], LAYOUTS[n][1]) for n in chosen]:
            # the padded vocabulary (a multiple of make_vocab_size_divisible_by x TP) must not change
            vocab = f"model.make_vocab_size_divisible_by={128 // _tp(parallel)}"
            self.train_job(f"parity/{name}", world, merged(base, steps, [vocab], parallel),
                           self.estimate(model, "pt", T, z.parity_batch * T, self.args.steps, world, loads=1),
                           deps=(init.name,))

    def drill_layout(self) -> list[str]:
        out = ["parallel.tp=2", "parallel.sequence_parallel=true"]
        if self.n >= 4:
            out.append("parallel.ep=2")
        if self.n >= 8:
            out.append("parallel.pp=2")
        return out

    def _preempt(self) -> None:
        z, n = self.z, self.n
        if n < 2:
            self.skipped_parts["preempt"] = "needs at least 2 GPUs"
            return
        data = self.work / "prepared"
        slices = site_slices(Path(self.args.corpus), z.slice_bytes, 2)
        prefixes = []
        for i, dirs in enumerate(slices):
            prefix = data / f"site{i}"
            prefixes.append(prefix)
            workers = 1 if z.cpu else max(1, min(16, (os.cpu_count() or 1) // 2))
            cmd = [sys.executable, "-m", "data.prepare", *map(str, dirs), "--glob", "**/*.py", "--tokenizer", "byte",
                   "--output-prefix", str(prefix), "--workers", str(workers), "--overwrite"]
            self.add(Job(f"preempt/prepare{i}", 0, command=cmd, estimate_s=10 + z.slice_bytes / 5e6,
                         outputs=(Path(f"{prefix}.json"),), reproducible=True))
        T, batch, steps = z.drill_seq, z.drill_batch, z.drill_steps
        blend = f"data.blend=[[0.7,{prefixes[0]}],[0.3,{prefixes[1]}]]"
        settings = ["recipe=pt", f"model.seq_length={T}", f"parallel.micro_batch_size={z.drill_micro}",
                    f"parallel.global_batch_size={batch}", f"trainer.max_steps={steps}",
                    f"trainer.indexer_warmup_tokens={z.drill_warmup_steps * batch * T}", "trainer.deterministic=true",
                    blend, f"data.split={z.drill_split}", f"trainer.eval_interval={z.drill_interval}",
                    "trainer.eval_iters=2"]
        overrides = merged(self.common("preempt"), settings, self.drill_layout())
        model = model_name(overrides)
        prep = tuple(f"preempt/prepare{i}" for i in range(len(prefixes)))
        est = self.estimate(model, "pt", T, batch * T, steps, n, deterministic=True)
        stopped = merged(overrides, [f"checkpoint.interval={z.drill_interval}", "checkpoint.keep=2"])
        drill = self.train_job("preempt/stopped", n, stopped, est + 3 * z.save_s.get(model, 15), deps=prep,
                               stoppable=True, watch=self.signal_watch, check=self.stop_check)
        drill.outputs = (drill.run_dir / "launch.sh",)
        # the relaunch: the command the run wrote for it, in the same run directory
        self.add(Job("preempt/resumed", n, command=["bash", str(drill.run_dir / "launch.sh")], run_dir=drill.run_dir,
                     estimate_s=est + z.save_s.get(model, 15), deps=(drill.name,), fresh=False,
                     check=self.resume_check))
        self.train_job("preempt/uninterrupted", n, overrides, est, deps=prep)

    def signal_watch(self, job: Job) -> None:
        """SIGUSR1 to the launcher and every process it started once a checkpoint exists and the chosen
        step is logged."""
        if "signal_after_step" in job.note:
            return
        records = read_metrics(job.run_dir)
        latest = job.run_dir / "checkpoints" / "latest"
        if records and records[-1]["step"] >= self.z.drill_signal_after and latest.is_file():
            step = records[-1]["step"]
            sent = signal_tree(job.proc.pid, signal.SIGUSR1)
            job.note.update(signal_after_step=step, checkpoint_then=latest.read_text().strip(), signalled=sent)
            say(f"{job.name}: SIGUSR1 to the launcher and the {sent - 1} processes it started, after step {step} "
                f"(checkpoint {job.note['checkpoint_then']} exists)")

    def stop_check(self, job: Job, result: dict) -> list[str]:
        """Every rank saved at the stop: the stop line, `latest` names it, a shard file per rank."""
        note, problems = job.note, []
        if "signal_after_step" not in note:
            return ["the run ended before the signal could be sent (it trains too fast for the drill)"]
        log = Path(result["log"]).read_text(errors="replace")
        m = re.search(r"stopped by SIGUSR1 after step (\d+): checkpoint (\S+);", log)
        if not m:
            return ["no 'stopped by SIGUSR1' line: the trainers did not stop on the signal"]
        stop, ckpt = int(m.group(1)), Path(m.group(2))
        latest = (job.run_dir / "checkpoints" / "latest").read_text().strip()
        ranks = sorted({int(r) for r in (re.match(r"__(\d+)_", p.name).group(1) for p in ckpt.glob("__*_*.distcp"))})
        note.update(stop_step=stop, stop_checkpoint=ckpt.name, latest=latest, ranks_saved=ranks,
                    manifest=(ckpt / "manifest.json").is_file(), stop_line=m.group(0))
        if latest != ckpt.name:
            problems.append(f"latest names {latest}, not the stop save {ckpt.name}")
        if ranks != list(range(job.world)):
            problems.append(f"shard files of ranks {ranks} in {ckpt.name}, not of every rank 0..{job.world - 1}")
        if not note["manifest"]:
            problems.append(f"{ckpt.name} has no manifest.json (the save did not complete)")
        if not stop > note["signal_after_step"] - 1:
            problems.append(f"stopped after step {stop}, before the signal's step {note['signal_after_step']}")
        return problems

    def resume_check(self, job: Job, result: dict) -> list[str]:
        log = Path(result["log"]).read_text(errors="replace")
        m = re.search(r"resumed from (\S+) at step (\d+)", log)
        if not m:
            return ["the relaunch did not say 'resumed from ...': it did not continue the stopped run"]
        job.note.update(resumed_from=Path(m.group(1)).name, resumed_at=int(m.group(2)))
        if result["summary"].get("steps", 0) < self.z.drill_steps:
            return [f"the resumed run logged {result['summary'].get('steps', 0)} of {self.z.drill_steps} steps"]
        return []

    def _cp(self) -> None:
        z, n = self.z, self.n
        if n < 2:
            self.skipped_parts["cp"] = "needs at least 2 GPUs"
            return
        docs = ["data.document_mask=true"]
        T, batch = z.cp_parity_seq, 2
        base = merged(self.common("cp"), MSA_PT, docs, [f"model.seq_length={T}", "parallel.micro_batch_size=1",
                                                        f"parallel.global_batch_size={batch}"])
        model = model_name(base)
        init = self.init_job("cp/init", base, "pt", T, batch)
        cps = [c for c in (2, 4) if c <= n]
        start = [f"trainer.max_steps={self.args.steps}", f"init_from={init.run_dir / 'checkpoints'}",
                 "model.make_vocab_size_divisible_by=128"]
        for cp in [1, *cps]:
            self.train_job(f"cp/parity_cp{cp}", cp, merged(base, start, [f"parallel.cp={cp}"]),
                           self.estimate(model, "pt", T, batch * T, self.args.steps, cp, loads=1), deps=(init.name,))
        lengths = self.args.cp_lengths or z.cp_lengths
        for cp in [*cps, 1]:
            for L in lengths:
                speed = merged(self.common("cp"), MSA_PT, docs,
                               [f"model.seq_length={L}", "parallel.micro_batch_size=1", "parallel.global_batch_size=1",
                                "model.recompute=full", f"trainer.max_steps={z.speed_steps}", f"parallel.cp={cp}"])
                self.train_job(f"cp/speed_cp{cp}_{k_text(L)}", cp, speed,
                               self.estimate(model, "pt", L, L, z.speed_steps, cp))

    def _scaling(self) -> None:
        z = self.z
        worlds = [w for w in (1, 2, 4, 8, 16) if w <= self.n]
        lengths = self.args.scaling_lengths or z.scaling_lengths
        variants = {"dense": ["recipe=dense"], "pt": MSA_PT}
        for world in worlds:
            for mode in ("dp", "cp"):
                if world == 1 and mode == "cp":
                    continue  # the one-GPU run is both modes' start
                for T in lengths:
                    per_gpu = max(1, z.scaling_tokens // T)  # sequences a GPU a step (data parallel)
                    batch = per_gpu * world if mode == "dp" else per_gpu
                    tokens = batch * T
                    for variant, recipe in variants.items():
                        name = f"scaling/{variant}_{k_text(T)}_{'1gpu' if world == 1 else f'{mode}{world}'}"
                        shape = [f"model.seq_length={T}", "parallel.micro_batch_size=1",
                                 f"parallel.global_batch_size={batch}", f"trainer.max_steps={z.scaling_steps}"]
                        overrides = merged(self.common("scaling"), recipe, shape,
                                           [f"parallel.cp={world}"] if mode == "cp" else [])
                        est = self.estimate(model_name(overrides), variant, T, tokens, z.scaling_steps, world)
                        self.train_job(name, world, overrides, est)


def k_text(T: int) -> str:
    return f"{T // 1024}K" if T % 1024 == 0 and T >= 1024 else str(T)


class InputError(ValueError):
    """A bad option or input; the message names it."""


def site_slices(root: Path, cap: int, count: int) -> list[list[Path]]:
    """`count` groups of packages of `root` (sorted by name), each about `cap` bytes of .py files;
    packages over twice the cap (torch) are passed over."""
    if not root.is_dir():
        raise InputError(f"--corpus {root}: not a directory")
    slices, current, size = [], [], 0
    for pkg in sorted(p for p in root.iterdir() if p.is_dir() and re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", p.name)):
        total = 0
        for f in pkg.rglob("*.py"):
            total += f.stat().st_size if f.is_file() else 0
            if total > 2 * cap:
                break
        if total == 0 or total > 2 * cap:
            continue
        current.append(pkg)
        size += total
        if size >= cap:
            slices.append(current)
            current, size = [], 0
            if len(slices) == count:
                return slices
    raise InputError(f"--corpus {root}: not {count} x {cap:,} bytes of .py files in packages of at most "
                     f"{2 * cap:,} bytes each (found {len(slices)} groups)")


