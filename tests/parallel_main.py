"""A few training steps at one parallel layout, recording what must not depend on the layout.

    python tests/parallel_main.py OUT_DIR [--save-init=DIR] key=value ...   (or under torchrun)
    python tests/parallel_main.py --jobs JOBS.json                          (several runs, below)

Builds the run exactly as train.py does (same model, optimizer, data, indexer warmup), runs
trainer.max_steps steps and writes OUT_DIR/rank<r>.pt with, per step, the logged metrics (rank
0) and every parameter's gradient just before the optimizer step, full-shape (tensor-parallel
shards gathered) and named as in an unsplit model (pipeline layers and expert-parallel experts
renumbered globally), and the MSA diagnostics of every step. Every rank writes its copy, so replicas can be checked against each other.

Initial weights depend on the pipeline layout (each stage draws from its own RNG stream), so a
reference run saves them with --save-init and other layouts start from them with init_from=DIR
(a dist_checkpointing load, resharded to the layout).

With --jobs, one process imports torch, megatron and the trainer once and then runs each job of
the file in turn (a JSON list of {"out", "nproc", "args", "save_init"}): it forks the job's ranks
as fresh processes (RANK, WORLD_SIZE, MASTER_ADDR/PORT set as torchrun would; no variables for a
one-process job) and waits for them. Every rank writes its output to OUT/rank<r>.log and the job's
exit codes to OUT/exit.json; a job whose rank fails or hangs has its other ranks killed and does
not stop the jobs after it. Starting each layout's ranks this way costs no imports: one start-up
for all layouts instead of one per rank and layout.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import signal
import socket
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _compose(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    from msa_model.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
        return compose("train", overrides=overrides)


def _gather_distributed_optimizer_grads(ddp) -> None:
    """The distributed optimizer leaves each rank only its reduced shard of every grad bucket:
    all-gather the shards so every main_grad is the full reduced gradient (what the optimizer
    reads of its own shard is unchanged)."""
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    for group in ddp.bucket_groups + ddp.expert_parallel_bucket_groups:
        size = group.intra_distributed_optimizer_instance_size
        if size == 1:
            continue
        for bucket in group.buckets:
            mine = shard_buffer(bucket.grad_data, size)[group.intra_distributed_optimizer_instance_rank].clone()
            dist.all_gather_into_tensor(bucket.grad_data, mine, group=group.intra_distributed_optimizer_instance_group)


def _global_name(name: str, layer_offsets: dict[int, int], expert_offset: int) -> str:
    name = name.removeprefix("module.")
    m = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
    if m:
        name = f"decoder.layers.{layer_offsets[int(m.group(1))]}.{m.group(2)}"
    m = re.match(r"(.*\.local_experts\.)(\d+)(\..*)", name)
    if m:
        name = f"{m.group(1)}{int(m.group(2)) + expert_offset}{m.group(3)}"
    return name


def full_grads(ddp) -> dict[str, torch.Tensor]:
    """name -> full-shape fp32 gradient; collective over the (expert) tensor-parallel group."""
    from megatron.core import parallel_state as ps

    model = ddp.module
    layer_offsets = {i: layer.layer_number - 1 for i, layer in enumerate(model.decoder.layers)}
    n_local = model.config.num_moe_experts // ps.get_expert_model_parallel_world_size() if model.config.num_moe_experts else 0
    expert_offset = ps.get_expert_model_parallel_rank() * n_local
    out = {}
    for name, p in model.named_parameters():
        g = p.main_grad.detach().float().clone()
        if getattr(p, "tensor_model_parallel", False):
            expert = not getattr(p, "allreduce", True)
            group = ps.get_expert_tensor_parallel_group() if expert else ps.get_tensor_model_parallel_group()
            parts = [torch.empty_like(g) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, g.contiguous(), group=group)
            if model.config.gated_linear_unit and name.endswith("linear_fc1.weight"):
                # each shard is [gate rows; up rows]: regroup to [all gates; all ups]
                halves = [part.chunk(2, dim=0) for part in parts]
                parts = [h[0] for h in halves] + [h[1] for h in halves]
            g = torch.cat(parts, dim=p.partition_dim)
        out[_global_name(name, layer_offsets, expert_offset)] = g
    return out


def main(out_dir: Path, overrides: list[str], save_init: str | None) -> None:
    from omegaconf import OmegaConf

    from msa_model.config import validate
    from msa_model.training import checkpoint as ckpt
    from msa_model.training.distributed import init_distributed, launch_env, shutdown
    from msa_model.training.diagnostics import MSADiagnostics
    from msa_model.training.indexer_warmup import IndexerWarmup
    from msa_model.training.data_setup import build_data, checkpoint_run_tokenizer
    from msa_model.training.run import _build_model, _build_optimizer
    from msa_model.training.trainer import Trainer

    cfg = _compose(overrides)
    OmegaConf.resolve(cfg)
    _, world_size, _ = launch_env()
    validate(cfg, world_size)
    env = init_distributed(cfg.parallel, cfg.trainer.device, cfg.trainer.seed)
    try:
        tokenizer = checkpoint_run_tokenizer(cfg)
        chunks = _build_model(cfg, env, tokenizer)
        train_data, valid_data = build_data(cfg, tokenizer)
        optimizer, scheduler = _build_optimizer(cfg, chunks)
        chunks[0].config.grad_scale_func = optimizer.scale_loss
        warmup = IndexerWarmup(cfg.trainer.indexer_warmup_tokens, cfg.model.msa)
        trainer = Trainer(cfg.trainer, cfg.parallel, cfg.model, model_chunks=chunks, optimizer=optimizer,
                          scheduler=scheduler, data=train_data, valid_data=valid_data, device=env.device,
                          callbacks=[warmup,
                                     MSADiagnostics(1, cfg.model.msa, cfg.model.num_layers, cfg.model.seq_length,
                                                    out_dir, is_main=False)])
        if cfg.init_from:
            ckpt.load_model_weights(chunks, cfg.init_from)
        if save_init:
            from megatron.core import dist_checkpointing

            Path(save_init).mkdir(parents=True, exist_ok=True)
            dist_checkpointing.save({"model": chunks[0].module.sharded_state_dict()}, save_init)

        steps, step_fn = [], optimizer.step

        def step_and_record():
            _gather_distributed_optimizer_grads(chunks[0])
            steps.append({"grads": full_grads(chunks[0])})
            return step_fn()

        optimizer.step = step_and_record
        for chunk in chunks:
            chunk.train()
        trainer._call("on_train_start")
        for _ in range(cfg.trainer.max_steps):
            trainer._call("on_step_start")
            metrics = trainer.train_step()
            if valid_data is not None:
                metrics.update(trainer.evaluate())
            trainer._call("on_step_end", metrics)
            steps[-1]["metrics"] = metrics | {"phase": warmup.phase}
            trainer.state.step += 1
            trainer.state.tokens += cfg.parallel.global_batch_size * cfg.model.seq_length
        out_dir.mkdir(parents=True, exist_ok=True)
        torch.save(steps, out_dir / f"rank{dist.get_rank()}.pt")
    finally:
        shutdown()


def _rank(job: dict, rank: int, port: int) -> int:
    """One rank of a job, in a forked process: its environment, its log, its exit code."""
    out = Path(job["out"])
    out.mkdir(parents=True, exist_ok=True)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)
    if job["nproc"] > 1:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(job["nproc"]),
                          LOCAL_WORLD_SIZE=str(job["nproc"]), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    log = os.open(out / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    try:
        main(out, job["args"], job.get("save_init"))
        return 0
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        # what an interpreter's exit runs: multiprocessing's finalizers stop the process that
        # dist_checkpointing's save started (os._exit alone would leave it behind)
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_jobs(jobs: list[dict], timeout: float = 300) -> None:
    # what a rank imports, imported once here: the forked ranks start with it
    import megatron.core.dist_checkpointing  # noqa: F401
    import msa_model.model.gpt  # noqa: F401
    import msa_model.training.run  # noqa: F401
    import msa_model.training.trainer  # noqa: F401
    from msa_model.training import checkpoint, data_setup, diagnostics, distributed, indexer_warmup  # noqa: F401

    for job in jobs:
        port = _free_port()
        sys.stdout.flush()
        sys.stderr.flush()
        pids = []
        for rank in range(job["nproc"]):
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    code = _rank(job, rank, port)
                finally:
                    os._exit(code)
            pids.append(pid)
        codes, deadline, timed_out = {}, time.monotonic() + timeout, False
        while len(codes) < len(pids):
            for pid in pids:
                if pid not in codes:
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done:
                        codes[pid] = os.waitstatus_to_exitcode(status)
            # a failed rank leaves the others waiting in a collective: they go too
            timed_out = time.monotonic() > deadline
            if any(codes.values()) or timed_out:
                for pid in pids:
                    if pid not in codes:
                        os.kill(pid, signal.SIGKILL)
                        codes[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            time.sleep(0.05)
        Path(job["out"]).mkdir(parents=True, exist_ok=True)
        (Path(job["out"]) / "exit.json").write_text(json.dumps({"codes": [codes[p] for p in pids],
                                                                "timed_out": timed_out}))
        print(f"{job['out']}: exit codes {[codes[p] for p in pids]}{' (timed out)' if timed_out else ''}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "--jobs":
        run_jobs(json.loads(Path(sys.argv[2]).read_text()))
        sys.exit(0)
    flags = [a for a in sys.argv[2:] if a.startswith("--save-init=")]
    main(Path(sys.argv[1]), [a for a in sys.argv[2:] if a not in flags],
         flags[0].split("=", 1)[1] if flags else None)
