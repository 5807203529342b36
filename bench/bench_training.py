"""Training throughput end to end: the dense baseline, MSA in its sparse phase and MSA in the indexer
warmup, each a real `train.py` run of a few steps at each context length.

    PYTHONPATH=. python bench/bench_training.py --out $OUT [--preset small] [--lengths 8192,32768]
        [--variants dense,pt,warmup] [--recompute none] [--gpus 0,1] [-- key=value ...]

Every job is its own process (`python train.py model=PRESET recipe=... model.seq_length=T`, micro-
batch 1 unless --micro-tokens, `logging.time_modules=true`), so peak memory and an out-of-memory belong to one run. With
several --gpus, jobs run side by side, one per GPU. Per job the numbers are medians over the steps
after the first two (Triton compilation, cuDNN plans): tokens/s, model TFLOP/s per GPU
(msa_model/training/flops.py), step time split into attention / MLP blocks / rest (module_timer.py), the
range of the timed steps' times (the table's step column: median (min-max)), and
the peak of `max_memory_allocated` over all steps. Writes OUT/training.json and prints a markdown
table with MSA / dense ratios per length.

--recompute takes one setting for every job or `auto`: none where the dense baseline fits, else
full for both variants (per --recompute-from, the first length that needs it).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from msa_model.training.metrics_file import read_metrics

REPO = Path(__file__).resolve().parents[1]
# bf16 dense matrix peak of an H100/H200 SXM (datasheet), the denominator of MFU
PEAK_TFLOPS = 989.4
# the per-step numbers a job's result gives the median of
TIMED = ("tokens_per_s", "tflops_per_gpu", "step_ms", "attention_ms", "moe_ms", "keys_per_query", "lm_loss", "kl_loss")

VARIANTS = {  # name -> recipe overrides
    "dense": ["recipe=dense"],
    "pt": ["recipe=pt", "trainer.indexer_warmup_tokens=0"],
    # the sparse phase with the block selection's scores on the fp8 tensor cores
    "pt_fp8": ["recipe=pt", "trainer.indexer_warmup_tokens=0", "model.msa.index_precision=fp8"],
    # the sparse phase with the KL's teacher computed by its own forward kernels (the default takes
    # it from the attention's backward: msa_model/ops/msa_attention/late_teacher.py)
    "pt_kl_forward": ["recipe=pt", "trainer.indexer_warmup_tokens=0", "model.msa.kl_teacher=forward"],
    "warmup": ["recipe=pt"],  # every step inside the indexer warmup (set per job below)
    # the sparse phase with each layer's sparse core replayed as a CUDA graph
    "pt_graph": ["recipe=pt", "trainer.indexer_warmup_tokens=0", "model.msa.cuda_graph=true",
                 "model.msa.cuda_graph_scope=core"],
    # ... and with each layer's whole attention block (projections, index branch, core) as one graph
    "pt_graph_block": ["recipe=pt", "trainer.indexer_warmup_tokens=0", "model.msa.cuda_graph=true",
                       "model.msa.cuda_graph_scope=attention"],
}


def job_args(variant: str, T: int, steps: int, tokens_per_step: int, recompute: str, preset: str,
             run_dir: Path, cache: Path, extra: list[str], micro_tokens: int = 0) -> list[str]:
    batch = max(1, tokens_per_step // T)
    micro = max(1, min(batch, micro_tokens // T))
    args = [f"model={preset}", *VARIANTS[variant], f"model.seq_length={T}", f"parallel.micro_batch_size={micro}",
            f"parallel.global_batch_size={batch}", f"trainer.max_steps={steps}", "optim.warmup_steps=1",
            "logging.log_interval=1", "logging.wandb_mode=disabled", "logging.tensorboard=false",
            "logging.progress_bar=false", "logging.time_modules=true", "checkpoint.interval=0",
            "checkpoint.save_at_end=false", f"model.recompute={recompute}", f"run_dir={run_dir}",
            f"data.cache_dir={cache}", "resume=never"]
    if variant == "warmup":
        # warmup until one token before the run's end: every step is a warmup step
        args.append(f"trainer.indexer_warmup_tokens={steps * batch * T - 1}")
    return args + extra


def step_medians(records: list[dict], keys: tuple[str, ...]) -> dict:
    """The step count, the median of each of `keys` over the steps after the first two (Triton
    compilation, cuDNN plans; fewer when the run logged fewer), the timed steps' count and step-time
    range (a masked dense step costs what each batch's documents leave: its median moves with the
    steps timed) and the peak memory over all steps."""
    out = {"steps": len(records)}
    timed = records[2:] or records[1:] or records
    out["timed_steps"] = len(timed)
    for key in keys:
        values = [r[key] for r in timed if r.get(key) is not None]
        if values:
            out[key] = statistics.median(values)
            if key == "step_ms":
                out["step_ms_range"] = [min(values), max(values)]
    peaks = [r["peak_mem_gib"] for r in records if "peak_mem_gib" in r]
    if peaks:
        out["peak_mem_gib"] = max(peaks)
    return out


def summarise(run_dir: Path, returncode: int, log: str) -> dict:
    out = {"returncode": returncode, **step_medians(read_metrics(run_dir), TIMED)}
    if returncode != 0:
        out["error"] = "out of memory" if "out of memory" in log else log.strip().splitlines()[-1:] or ["?"]
    if "step_ms" in out:
        out["rest_ms"] = out["step_ms"] - out.get("attention_ms", 0.0) - out.get("moe_ms", 0.0)
    return out


def run_jobs(jobs: list[dict], gpus: list[str], timeout: int, out: Path) -> None:
    """Run every job, one per GPU at a time; OUT/training.json is rewritten after each, so a
    call cut short keeps what finished."""
    lock = threading.Lock()
    todo: queue.Queue = queue.Queue()
    for job in jobs:
        todo.put(job)

    def worker(gpu: str):
        while True:
            try:
                job = todo.get_nowait()
            except queue.Empty:
                return
            env = dict(os.environ, CUDA_VISIBLE_DEVICES=gpu, PYTHONUNBUFFERED="1")
            start = time.time()
            try:
                proc = subprocess.run([sys.executable, "train.py", *job["args"]], cwd=REPO, env=env,
                                      capture_output=True, text=True, timeout=timeout)
                rc, log = proc.returncode, proc.stdout + proc.stderr
            except subprocess.TimeoutExpired as e:
                rc, log = -1, f"timeout after {timeout} s\n{e.stdout or ''}"
            Path(job["run_dir"]).mkdir(parents=True, exist_ok=True)
            (Path(job["run_dir"]) / "bench.log").write_text(log if isinstance(log, str) else str(log))
            job["result"] = summarise(Path(job["run_dir"]), rc, log if isinstance(log, str) else "")
            job["result"]["wall_s"] = round(time.time() - start, 1)
            job["result"]["gpu"] = gpu
            with lock:
                (out / "training.json").write_text(json.dumps([j for j in jobs if "result" in j], indent=1))
                print(f"[gpu {gpu}] {job['variant']} T={job['T']} recompute={job['recompute']}: "
                      f"{json.dumps(job['result'])}", flush=True)

    threads = [threading.Thread(target=worker, args=(g,)) for g in gpus]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _k(T: int) -> str:
    return f"{T // 1024}K" if T % 1024 == 0 else str(T)


def _step_cell(result: dict) -> str:
    """The median step time, with the timed steps' range where they differ: `863 (798-946)`."""
    cell = f"{result.get('step_ms', 0):.0f}"
    lo, hi = result.get("step_ms_range", (None, None))
    if lo is not None and round(lo) != round(hi):
        cell += f" ({lo:.0f}-{hi:.0f})"
    return cell


def table(jobs: list[dict]) -> str:
    jobs = [j for j in jobs if "result" in j]
    lines = ["| T | variant | recompute | tok/s | TFLOP/s/GPU | MFU | step ms | attention ms | MLP ms | rest ms | "
             "peak GiB | vs dense |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    dense = {j["T"]: j["result"] for j in jobs if j["variant"] == "dense"}
    for j in sorted(jobs, key=lambda j: (j["T"], list(VARIANTS).index(j["variant"]))):
        r = j["result"]
        if "tokens_per_s" not in r or r.get("returncode"):
            lines.append(f"| {_k(j['T'])} | {j['variant']} | {j['recompute']} | {r.get('error', 'failed')} "
                         "| | | | | | | | |")
            continue
        base = dense.get(j["T"], {}).get("tokens_per_s")
        ratio = f"{r['tokens_per_s'] / base:.2f}x" if base and j["variant"] != "dense" else ""
        lines.append(
            f"| {_k(j['T'])} | {j['variant']} | {j['recompute']} | {r['tokens_per_s']:,.0f} | "
            f"{r.get('tflops_per_gpu', 0):.1f} | {r.get('tflops_per_gpu', 0) / PEAK_TFLOPS:.1%} | "
            f"{_step_cell(r)} | {r.get('attention_ms', 0):.0f} | {r.get('moe_ms', 0):.0f} | "
            f"{r.get('rest_ms', 0):.0f} | {r.get('peak_mem_gib', float('nan')):.1f} | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out")
    ap.add_argument("--table", help="print the table of an existing training.json and exit")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--lengths", default="8192,32768,65536,131072,262144")
    ap.add_argument("--variants", default="dense,pt,warmup")
    ap.add_argument("--recompute", default="none", help="none | selective | full | auto")
    ap.add_argument("--recompute-from", type=int, default=262144, help="with auto: first length run with full")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--tokens-per-step", type=int, default=32768, help="global batch = this / T (at least 1)")
    ap.add_argument("--micro-tokens", type=int, default=0,
                    help="micro-batch = this / T sequences (at least 1; default: one sequence per micro-batch)")
    ap.add_argument("--gpus", default="0")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per job")
    ap.add_argument("extra", nargs="*", help="more train.py overrides for every job")
    a = ap.parse_args()
    if a.table:
        print(table(json.loads(Path(a.table).read_text())))
        return
    if not a.out:
        ap.error("--out is required")
    out = Path(a.out)
    cache = out / "data-cache"
    jobs = []
    for T in [int(x) for x in a.lengths.split(",")]:
        for variant in a.variants.split(","):
            recompute = a.recompute if a.recompute != "auto" else ("full" if T >= a.recompute_from else "none")
            run_dir = out / f"{variant}-{T}-{recompute}"
            jobs.append({"variant": variant, "T": T, "recompute": recompute, "run_dir": str(run_dir),
                         "args": job_args(variant, T, a.steps, a.tokens_per_step, recompute, a.preset, run_dir,
                                          cache, a.extra, a.micro_tokens)})
    # longest first: the slow jobs start early and the short ones fill the gaps
    jobs.sort(key=lambda j: -j["T"])
    out.mkdir(parents=True, exist_ok=True)
    run_jobs(jobs, a.gpus.split(","), a.timeout, out)
    print(table(jobs))


if __name__ == "__main__":
    main()
