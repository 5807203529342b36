"""dry_run=true: the resolved config, parameter counts of the model built on the meta device, the
parallel layout and a per-GPU memory estimate, without allocating weights or touching data.

The model is built unsharded (TP = PP = EP = CP = 1) in a one-rank process group, so the counts
are those of the whole model whatever layout the config names; the layout only feeds the
memory estimate.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from msa_model.training.estimate import format_estimate, memory_estimate
from msa_model.model.gpt import count_parameters, model_vocab_size, padded_vocab_size


def built_parameter_counts(cfg: DictConfig, vocab_size: int) -> dict[str, int]:
    """Total and active (per token) parameters of the model built on the meta device.

    Active counts every weight a token touches: all non-expert weights (embeddings, output layer
    and shared experts included) plus `moe_router_topk` of the routed experts of each MoE layer.
    """
    from megatron.core import parallel_state

    from msa_model.model.gpt import build_model
    from msa_model.training.distributed import init_distributed, shutdown

    unsharded = copy.deepcopy(cfg.parallel)
    unsharded.tp = unsharded.pp = unsharded.ep = unsharded.cp = 1
    unsharded.sequence_parallel = False
    owns_group = not torch.distributed.is_initialized()
    if owns_group:
        init_distributed(unsharded, "cpu", cfg.trainer.seed)
    try:
        assert parallel_state.get_tensor_model_parallel_world_size() == 1
        # nothing to initialise on the meta device (megatron would run every expert's init op)
        with torch.device("meta"):
            model = build_model(cfg.model, unsharded, vocab_size, on_cpu=True, init_weights=False)
        total = routed = 0
        for name, p in model.named_parameters():
            total += p.numel()
            if ".mlp.experts." in name:
                routed += p.numel()
    finally:
        if owns_group:
            shutdown()
    m = cfg.model
    active = total - routed + (routed * m.moe_router_topk // m.num_experts if m.num_experts else 0)
    return {"total": total, "active": active}


def _human(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def dry_run_report(cfg: DictConfig, world_size: int) -> str:
    """What dry_run=true prints: config, `total_params=`/`active_params=`, layout, memory."""
    from msa_model.training.data_setup import checkpoint_run_tokenizer, document_mask_line, step_dir_of
    from msa_model.training.distributed import parallel_layout

    vocab = checkpoint_run_tokenizer(cfg, step_dir_of(cfg.init_from)).vocab_size
    built = built_parameter_counts(cfg, vocab)
    analytic = count_parameters(cfg.model, vocab)
    layout_world = world_size
    lines = ["# resolved config", OmegaConf.to_yaml(cfg, resolve=True), "# parameters (model built on the meta device)"]
    lines.append(f"total_params={built['total']}")
    lines.append(f"active_params={built['active']}")
    lines.append(f"index_branch_params={analytic['index_branch']}  embedding_params={analytic['embedding']}  "
                 f"(total {_human(built['total'])}, active {_human(built['active'])})")
    rows = model_vocab_size(cfg.model, vocab)
    lines.append(f"vocab={rows} padded to {padded_vocab_size(rows, cfg.model, cfg.parallel.tp)} (tokenizer: {vocab})")
    lines.append(f"# parallel layout on {layout_world} rank{'s' if layout_world != 1 else ''}")
    lines += [f"{k}={v}" for k, v in parallel_layout(cfg.parallel, layout_world).items()]
    tokens_per_step = cfg.parallel.global_batch_size * cfg.model.seq_length
    lines.append(f"tokens_per_step={tokens_per_step}  (x {cfg.trainer.max_steps} steps = "
                 f"{tokens_per_step * cfg.trainer.max_steps:,} tokens)")
    lines.append(document_mask_line(cfg))
    lines.append("# per-GPU memory estimate (GiB, most loaded pipeline stage; msa_model/training/estimate.py)")
    estimate = memory_estimate(cfg, vocab, layout_world)
    lines += format_estimate(estimate)
    advice = memory_advice(cfg, vocab, estimate["total"])
    if advice:
        lines.append(advice)
    return "\n".join(lines)


CONFIGS = Path(__file__).resolve().parents[2] / "configs"
# the target GPU when neither launch.gpu_memory_gib nor a local GPU says: an H100 80GB
DEFAULT_GPU_MEMORY_GIB = 80.0


def target_gpu_memory(cfg) -> tuple[float, str]:
    """(GiB of one GPU the launch targets, where that number comes from)."""
    if cfg.launch.gpu_memory_gib:
        return float(cfg.launch.gpu_memory_gib), "launch.gpu_memory_gib"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return props.total_memory / 2**30, f"this machine's {props.name}; launch.gpu_memory_gib sets another"
    return DEFAULT_GPU_MEMORY_GIB, "an H100 80GB by default; launch.gpu_memory_gib=141 for an H200"


def _with_layout(cfg: DictConfig, path: Path) -> DictConfig | None:
    """`cfg` with the parallel preset at `path` applied as `parallel=<name>` would, or None when the
    preset also changes the model (a layout for another context length)."""
    text = path.read_text()
    node = OmegaConf.create(text)
    if not text.lstrip().startswith("# @package _global_"):
        node = OmegaConf.create({"parallel": node})
    candidate = OmegaConf.merge(cfg, node)
    if OmegaConf.to_container(candidate.model, resolve=True) != OmegaConf.to_container(cfg.model, resolve=True):
        return None
    return candidate


def _recipes_with(model: str, layout: str) -> list[str]:
    """The recipes that run `model` on the parallel preset `layout` (their defaults override both)."""
    out = []
    for path in sorted((CONFIGS / "recipe").glob("*.yaml")):
        entries = OmegaConf.load(path).get("defaults") or []
        chosen = {k: v for e in entries if OmegaConf.is_dict(e) for k, v in e.items()}
        if chosen.get("override /model") == model and chosen.get("override /parallel") == layout:
            out.append(path.stem)
    return out


def smallest_fitting_layout(cfg: DictConfig, vocab: int, gpu_gib: float) -> tuple[str, DictConfig, dict] | None:
    """(name, config, estimate) of the parallel preset in configs/parallel/ on the fewest GPUs
    whose estimate for this model fits in `gpu_gib` and whose layout validates; None if none."""
    from msa_model.config import ConfigError, validate

    best = None
    for path in sorted((CONFIGS / "parallel").glob("*.yaml")):
        candidate = _with_layout(cfg, path)
        if candidate is None:
            continue
        world = candidate.launch.nodes * candidate.launch.ranks_per_node
        try:
            validate(candidate, world, gpu=True)
        except ConfigError:
            continue
        est = memory_estimate(candidate, vocab, world)
        if est["total"] <= gpu_gib and (best is None or world < best[2]["world"]):
            best = (path.stem, candidate, est)
    return best


def memory_advice(cfg: DictConfig, vocab: int, total_gib: float) -> str | None:
    """One warning line when the per-GPU estimate exceeds the target GPU's memory: what the target
    is and the smallest shipped layout of this model that fits (and the recipes that use it)."""
    gpu_gib, source = target_gpu_memory(cfg)
    if total_gib <= gpu_gib:
        return None
    head = (f"warning: memory_per_gpu_gib={total_gib:.1f} exceeds the {gpu_gib:.0f} GiB of the target GPU ({source})"
            f" on this layout")
    found = smallest_fitting_layout(cfg, vocab, gpu_gib)
    if found is None:
        # only the levers this config has left
        levers = ["raise parallel.tp/pp/ep/cp (with launch.nodes x launch.ranks_per_node GPUs)"]
        if cfg.model.recompute != "full":
            levers.append("set model.recompute=full")
        if cfg.parallel.micro_batch_size > 1:
            levers.append("lower parallel.micro_batch_size")
        return (f"{head}; no layout in configs/parallel/ fits this model: " + ", ".join(levers[:-1])
                + (" or " if len(levers) > 1 else "") + levers[-1])
    name, c, est = found
    p = c.parallel
    recipes = _recipes_with(cfg.model.name, name)
    carried = f", as recipe={'|'.join(recipes)} run it" if recipes else ""
    return (f"{head}; it fits with parallel={name} ({est['world']} GPUs: tp {p.tp}, pp {p.pp}, ep {p.ep}, cp {p.cp}, "
            f"dp {est['dp']}; {est['total']:.1f} GiB per GPU){carried}")
