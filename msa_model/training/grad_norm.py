"""The index branch's gradient norm apart from the rest, and optional separate clipping.

The index projections learn only from the indexer KL, whose gradients can be a large part of the
global norm during warmup; one global norm hides that, and one global clip lets the KL shrink
the language-model update. megatron-core already keeps parameters tagged with a registered
`grad_norm_group` out of the main norm (it does so for multi-token prediction); the index
parameters get their own group, `msa_index`, and `GroupNormOptimizer` (megatron's
ChainedOptimizer with its own `step`) computes both norms on the optimizer's reduced main grads
(distributed-optimizer shards, tensor-parallel duplicates counted once) and clips either

    jointly (optim.index_clip_grad = None, the default): every gradient by clip_grad / total norm,
        exactly the behaviour of one global norm, or
    separately: the rest by clip_grad / its norm, the index branch by index_clip_grad / its norm.

`step()` returns megatron's (success, grad_norm, zeros) with grad_norm the norm of all
parameters before clipping, and leaves `grad_norms_by_group` = {"msa_index": norm} (megatron's
attribute for group norms) for the trainer to log.
"""

from __future__ import annotations

import math

import torch
from megatron.core.optimizer import optimizer as megatron_optimizer
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32, get_grad_norm_fp32
from megatron.core.optimizer.optimizer import ChainedOptimizer

INDEX_GROUP = "msa_index"
_INDEX_MODULES = ("index_q_proj", "index_k_proj", "index_q_layernorm", "index_k_layernorm")


def register_index_group() -> None:
    """Add `msa_index` to megatron's registry of separately normed parameter groups."""
    groups = megatron_optimizer.SEPARATE_GRAD_NORM_GROUPS
    if INDEX_GROUP not in groups:
        megatron_optimizer.SEPARATE_GRAD_NORM_GROUPS = (*groups, INDEX_GROUP)


def tag_index_parameters(model_chunks) -> int:
    """Tag every index-branch parameter with the `msa_index` group (before the optimizer is built:
    its main-parameter copies inherit the tag). Returns the number of tagged tensors."""
    from msa_model.model.attention import msa_layers

    register_index_group()
    n = 0
    for layer in msa_layers(model_chunks):
        for name in _INDEX_MODULES:
            module = getattr(layer, name, None)
            if module is None:
                continue
            for p in module.parameters():
                setattr(p, megatron_optimizer.GRAD_NORM_GROUP_ATTR, INDEX_GROUP)
                n += 1
    return n


def _group_norm(optimizers, group):
    """Norm over the optimizers' main grads of `group` (None: every untagged parameter)."""
    squares = 0.0
    for opt in optimizers:
        norm = get_grad_norm_fp32(opt.get_grads_for_grad_norm(group),
                                  grad_stats_parallel_group=opt.get_grad_stats_parallel_group())
        squares += float(norm) ** 2
    return math.sqrt(squares)


class GroupNormOptimizer(ChainedOptimizer):
    """megatron's ChainedOptimizer whose step reports the index branch's norm apart and clips it
    jointly with the rest or on its own (see the module docstring)."""

    def __init__(self, chained, clip_grad: float, index_clip_grad: float | None):
        super().__init__(list(getattr(chained, "chained_optimizers", [chained])))
        self.clip_grad, self.index_clip_grad = clip_grad, index_clip_grad
        self.grad_norms_by_group = {}

    @torch.no_grad()
    def step(self):
        self.grad_norms_by_group = {}
        if self.prepare_grads():
            return False, None, None
        optimizers = [o for o in self.chained_optimizers if not getattr(o, "is_stub_optimizer", False)]
        rest = _group_norm(optimizers, None)
        index = _group_norm(optimizers, INDEX_GROUP)
        total = math.sqrt(rest ** 2 + index ** 2)
        self.grad_norms_by_group = {INDEX_GROUP: index}
        for opt in optimizers:
            params = opt.get_parameters()
            tagged = [p for p in params if getattr(p, megatron_optimizer.GRAD_NORM_GROUP_ATTR, None) == INDEX_GROUP]
            others = [p for p in params if getattr(p, megatron_optimizer.GRAD_NORM_GROUP_ATTR, None) != INDEX_GROUP]
            if self.index_clip_grad is None:
                if self.clip_grad > 0:
                    clip_grad_by_total_norm_fp32(params, self.clip_grad, total)
            else:
                if self.clip_grad > 0 and others:
                    clip_grad_by_total_norm_fp32(others, self.clip_grad, rest)
                if tagged:
                    clip_grad_by_total_norm_fp32(tagged, self.index_clip_grad, index)
        return self.step_with_ready_grads(), total, None
