"""dry_run=true: the resolved config, parameter counts of the model built on the meta device, the
parallel layout and a per-GPU memory estimate, without allocating weights or touching data.

The model is built unsharded (TP = PP = EP = CP = 1) in a one-rank process group, so the counts
are those of the whole model whatever layout the config names; the layout only feeds the
memory estimate.
"""

from __future__ import annotations

import copy

import torch
from omegaconf import DictConfig, OmegaConf

from msa_model.estimate import format_estimate, memory_estimate
from msa_model.model import count_parameters, model_vocab_size, padded_vocab_size


def built_parameter_counts(cfg: DictConfig, vocab_size: int) -> dict[str, int]:
    """Total and active (per token) parameters of the model built on the meta device.

    Active counts every weight a token touches: all non-expert weights (embeddings, output layer
    and shared experts included) plus `moe_router_topk` of the routed experts of each MoE layer.
    """
    from megatron.core import parallel_state

    from msa_model.model import build_model
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


def document_mask_line(cfg) -> str:
    """One line saying whether packed documents are masked (data.document_mask), for the dry run
    and the run's first log line."""
    if cfg.data.document_mask:
        return ("documents: masked (data.document_mask=true): each packed document, ended by its "
                "end-of-document token, attends, selects blocks and trains the indexer KL within itself")
    return ("documents: not masked (data.document_mask=false): tokens attend to the documents packed "
            "before theirs in a sequence")


def _human(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def dry_run_report(cfg: DictConfig, world_size: int) -> str:
    """What dry_run=true prints: config, `total_params=`/`active_params=`, layout, memory."""
    from msa_model.training.data_setup import checkpoint_run_tokenizer, step_dir_of
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
    lines.append(f"# parallel layout on {layout_world} ranks")
    lines += [f"{k}={v}" for k, v in parallel_layout(cfg.parallel, layout_world).items()]
    tokens_per_step = cfg.parallel.global_batch_size * cfg.model.seq_length
    lines.append(f"tokens_per_step={tokens_per_step}  (x {cfg.trainer.max_steps} steps = "
                 f"{tokens_per_step * cfg.trainer.max_steps:,} tokens)")
    lines.append(document_mask_line(cfg))
    lines.append("# per-GPU memory estimate (GiB, most loaded pipeline stage; msa_model/estimate.py)")
    lines += format_estimate(memory_estimate(cfg, vocab, layout_world))
    return "\n".join(lines)
