"""The plan of a quality study (scripts/quality_experiment.py): its presets, its arms (a base
recipe plus train.py overrides, compared with a reference arm) and its runs (arms x seeds), each
run's overrides, and the file layout under --work that says what is done."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from data.retrieval import DEFAULT_TASKS, TASKS as RETRIEVAL_TASKS

PRESETS = {
    # one H200: 8K context, 8 x 8K tokens a step
    "small": {"model": "small", "seq": 8192, "micro": 2, "gbs": 8, "log": 10, "diag": 50, "warmup_steps": 10,
              "max_bytes": 200_000_000, "lengths": [2048, 8192, 32768], "samples": 20, "loss_sequences": 4,
              "final_window": 5, "ckpt_gib": 8.5, "stop_margin": 120, "start_cost": 150, "gpus": "0"},
    # CPU check of the whole pipeline
    "tiny": {"model": "tiny", "seq": 512, "micro": 2, "gbs": 4, "log": 2, "diag": 2, "warmup_steps": 1,
             "max_bytes": 4_000_000, "lengths": [256, 512], "samples": 1, "loss_sequences": 2,
             "final_window": 2, "ckpt_gib": 0.1, "stop_margin": 20, "start_cost": 10, "gpus": None},
}
# left out of a run's settings signature: paths under --work, checkpointing (which does not
# change what a run trains, so a dense run made without a CPT arm serves one made with it) and the
# evaluations (the retrieval probe, validation: they read the model, not the training stream)
UNSIGNED = ("run_dir", "data.cache_dir", "init_from", "checkpoint.", "trainer.probe_", "trainer.eval_")
class InputError(ValueError):
    """Bad options; the message names the option."""


@dataclass
class Arm:
    name: str
    base: str  # dense | pt | cpt
    overrides: list[str] = field(default_factory=list)
    ref: str | None = "dense"  # the arm it is compared with (same seed); a cpt arm branches from it
    eval: bool = False


@dataclass
class Run:
    name: str
    arm: Arm
    seed: int
    steps: int
    overrides: list[str]
    dir: Path
    parent: str | None = None  # cpt: the reference run whose mid-way checkpoint it starts from
    init: Path | None = None  # cpt: the converted checkpoint


def parse_arm(text: str, known: dict[str, Arm]) -> Arm:
    """"NAME=BASE KEY=VALUE ... [vs=ARM]" -> an Arm built on BASE (a base or an arm defined before)."""
    parts = text.split()
    if not parts or "=" not in parts[0]:
        raise InputError(f"--arm {text!r}: write NAME=BASE followed by train.py overrides KEY=VALUE")
    name, base = parts[0].split("=", 1)
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name) or name in known:
        raise InputError(f"--arm {text!r}: {name!r} is taken or not a plain name (letters, digits, '_', '.', '-')")
    if base not in known:
        raise InputError(f"--arm {text!r}: unknown base {base!r} (known: {', '.join(known)})")
    parent = known[base]
    ref, overrides = parent.ref, list(parent.overrides)
    for item in parts[1:]:
        if "=" not in item:
            raise InputError(f"--arm {text!r}: {item!r} is not KEY=VALUE")
        if item.startswith("vs="):
            ref = item[3:]
        else:
            overrides.append(item)
    attention = value_of(overrides, "model.attention") or ("dense" if parent.base == "dense" else "msa")
    inert = [o for o in overrides if key_of(o).startswith("model.msa.")]
    if attention == "dense" and inert:
        # its runs would train the reference's model again: a paired difference of noise
        raise InputError(f"--arm {text!r}: {', '.join(inert)} change nothing with dense attention (base {base!r})")
    return Arm(name, parent.base, overrides, ref, parent.eval)


def builtin_arms(args) -> dict[str, Arm]:
    retr = [f"data.retrieval_share={args.retrieval_arm_share}", f"data.max_bytes={args.retrieval_arm_max_bytes}"]
    if args.retrieval_tasks:
        tasks = [t for t in args.retrieval_tasks.split(",") if t]
        bad = [t for t in tasks if t not in RETRIEVAL_TASKS]
        if bad or not tasks:
            raise InputError(f"--retrieval-tasks: unknown {bad or 'none given'} (known: {', '.join(RETRIEVAL_TASKS)})")
        retr.append(f"data.retrieval_tasks=[{','.join(tasks)}]")
    else:
        tasks = list(DEFAULT_TASKS)
    if args.probe_every != 0:
        # its interval (trainer.eval_interval) depends on the run's steps: Study._run adds it
        retr += [f"trainer.probe_tasks=[{','.join(tasks)}]", f"trainer.probe_samples={args.probe_samples}"]
    return {"dense": Arm("dense", "dense", [], None), "pt": Arm("pt", "pt"), "cpt": Arm("cpt", "cpt"),
            "dense-retr": Arm("dense-retr", "dense", retr, None, eval=True),
            "pt-retr": Arm("pt-retr", "pt", retr, "dense-retr", eval=True)}


def key_of(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def merged(*lists: list[str]) -> list[str]:
    """Overrides in order, a later value of a key replacing an earlier one in place."""
    out: dict[str, str] = {}
    for items in lists:
        for item in items:
            out[key_of(item)] = item
    return list(out.values())


def value_of(overrides: list[str], key: str) -> str | None:
    for item in reversed(overrides):
        if key_of(item) == key and "=" in item:
            return item.split("=", 1)[1]
    return None


class Study:
    """The plan (arms x seeds), its file layout under --work and what is done there."""

    def __init__(self, args):
        self.args = args
        p = self.preset = PRESETS[args.preset]
        self.work = Path(args.work).resolve()
        self.step_tokens = args.gbs * args.seq_length
        steps = max(4, round(args.tokens / self.step_tokens))
        self.steps = steps + steps % 2
        self.mid = self.steps // 2
        self.warmup_tokens = max(2 * self.step_tokens,
                                 round(args.warmup_share * self.steps) * self.step_tokens)
        self.common = [
            f"model={p['model']}", f"parallel.micro_batch_size={args.micro}", f"parallel.global_batch_size={args.gbs}",
            f"logging.log_interval={p['log']}", "logging.wandb_mode=disabled", "logging.progress_bar=false",
            "logging.tensorboard=false", "checkpoint.interval=0", "checkpoint.keep=1",
            f"data.source={args.corpus}", f"data.max_bytes={p['max_bytes']}", f"data.cache_dir={self.work / 'data'}",
            f"data.retrieval_share={args.retrieval_share}", f"optim.lr={args.lr}", f"optim.min_lr={args.min_lr}",
            f"optim.warmup_steps={p['warmup_steps']}"] + (
            [f"model.seq_length={args.seq_length}"] if args.seq_length != p["seq"] else [])
        self.msa = [f"trainer.indexer_warmup_tokens={self.warmup_tokens}",
                    f"logging.msa_diagnostics_interval={p['diag']}"]
        # before --work is made: a mistyped archive leaves nothing behind
        if args.import_ and not Path(args.import_).is_file():
            raise InputError(f"--import {args.import_}: no such file")
        known = builtin_arms(args)
        chosen = [a for a in args.arms.split(",") if a]
        bad = [a for a in chosen if a not in known]
        if bad:
            raise InputError(f"--arms: unknown {bad} (built in: {', '.join(known)}; define others with --arm)")
        self.arms = {a: known[a] for a in chosen}
        for text in args.arm:
            arm = parse_arm(text, {**known, **self.arms})
            self.arms[arm.name] = arm
        for name in args.eval.split(",") if args.eval else []:
            if name not in self.arms:
                raise InputError(f"--eval: {name!r} is not an arm of this study ({', '.join(self.arms)})")
            self.arms[name].eval = True
        for arm in list(self.arms.values()):
            if arm.ref is not None and arm.ref not in self.arms:
                if arm.ref in known and known[arm.ref].base == "dense":
                    self.arms[arm.ref] = known[arm.ref]  # a reference arm comes along
                else:
                    raise InputError(f"arm {arm.name}: its reference {arm.ref!r} is not an arm of this study")
            if arm.base == "cpt" and self.arms[arm.ref].base != "dense":
                raise InputError(f"arm {arm.name}: a cpt arm branches from a dense arm, not {arm.ref!r}")
        # references first (CPT needs their mid-way checkpoints)
        order = sorted(self.arms.values(), key=lambda a: (a.base != "dense", list(self.arms).index(a.name)))
        self.runs: dict[str, Run] = {}
        for seed in range(args.seeds):
            for arm in order:
                run = self._run(arm, seed)
                self.runs[run.name] = run

    def _run(self, arm: Arm, seed: int) -> Run:
        name = f"{arm.name}-s{seed}"
        base = [f"recipe={arm.base}", f"trainer.seed={seed}"] + ([f"data.seed={seed}"] if self.args.vary_data else [])
        steps, parent, init = self.steps, None, None
        if arm.base == "dense":
            if any(a.base == "cpt" and a.ref == arm.name for a in self.arms.values()):
                # the CPT branch point; the save after it keeps it until it is converted
                base += [f"checkpoint.interval={self.mid}", "checkpoint.keep=2"]
        elif arm.base == "pt":
            base += self.msa
        else:
            steps, parent = self.steps - self.mid, f"{arm.ref}-s{seed}"
            init = self.work / "branch" / parent
            decay = value_of(self.args.override, "optim.decay_steps") or str(self.steps)
            base += [*self.msa, f"init_from={init}", "init_from_data_position=true",
                     f"optim.schedule_start_step={self.mid}", f"optim.decay_steps={decay}",
                     f"optim.index_clip_grad={self.args.index_clip_grad}"]
        if not arm.eval:
            base.append("checkpoint.save_at_end=false")
        overrides = merged(self.common, self.args.override, base, arm.overrides, [f"trainer.max_steps={steps}"])
        if value_of(overrides, "trainer.probe_tasks") and value_of(overrides, "trainer.eval_interval") is None:
            overrides.append(f"trainer.eval_interval={self.probe_every(steps)}")
        return Run(name, arm, seed, steps, overrides, self.work / name, parent, init)

    def probe_every(self, steps: int) -> int:
        """Steps between a run's retrieval probes: --probe-every, else about ten a run, a multiple
        of the log interval (trainer.eval_interval must be)."""
        log_every = self.preset["log"]
        return self.args.probe_every or max(log_every, round(steps / 10 / log_every) * log_every)

    # --- state on disk -------------------------------------------------------------------------

    def signature(self, overrides: list[str]) -> list[str]:
        return sorted(o.replace(str(self.work), "<work>") for o in overrides if not key_of(o).startswith(UNSIGNED))

    def data_signature(self, run: Run) -> str:
        keys = [o for o in run.overrides if key_of(o).startswith("data.") or key_of(o) == "model.seq_length"]
        return hashlib.sha256("\n".join(sorted(keys)).encode()).hexdigest()[:12]

    def done(self, run: Run) -> bool:
        return (run.dir / "done.json").is_file()

    def check_settings(self, run: Run) -> None:
        """Refuse a run directory started with other settings (another --tokens, arm definition...)."""
        path = run.dir / "driver.json"
        if not path.is_file():
            return
        # an earlier call's signature may hold keys signed then and unsigned now (the evaluations'):
        # compared without them, its runs go on
        had = sorted(o for o in json.loads(path.read_text())["settings"] if not key_of(o).startswith(UNSIGNED))
        now = self.signature(run.overrides)
        if had != now:
            diff = sorted(set(had) ^ set(now))
            raise InputError(f"{run.dir} was started with other settings ({', '.join(diff[:6])}); give another "
                             "--work or remove it")

    def eval_dir(self, run: Run) -> Path:
        return self.work / "eval" / run.name
