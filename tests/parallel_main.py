"""A few training steps at one parallel layout, recording what must not depend on the layout.

    python tests/parallel_main.py OUT_DIR [--save-init=DIR] key=value ...   (or under torchrun)

Builds the run exactly as train.py does (same model, optimizer, data, indexer warmup), runs
trainer.max_steps steps and writes OUT_DIR/rank<r>.pt with, per step, the logged metrics (rank
0) and every parameter's gradient just before the optimizer step, full-shape (tensor-parallel
shards gathered) and named as in an unsplit model (pipeline layers and expert-parallel experts
renumbered globally), and the MSA diagnostics of every step. Every rank writes its copy, so replicas can be checked against each other.

Initial weights depend on the pipeline layout (each stage draws from its own RNG stream), so a
reference run saves them with --save-init and other layouts start from them with init_from=DIR
(a dist_checkpointing load, resharded to the layout).
"""

from __future__ import annotations

import re
import sys
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
    from msa_model.training.run import _build_model, _build_optimizer, _retrieval_probe
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
                          probe=_retrieval_probe(cfg, tokenizer),
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


if __name__ == "__main__":
    flags = [a for a in sys.argv[2:] if a.startswith("--save-init=")]
    main(Path(sys.argv[1]), [a for a in sys.argv[2:] if a not in flags],
         flags[0].split("=", 1)[1] if flags else None)
