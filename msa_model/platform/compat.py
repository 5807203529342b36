"""The private megatron-core and PyTorch APIs this project relies on, in one place.

Each entry is something a public API does not offer; each was checked with the versions in
`CHECKED_WITH` and is the first place to look after an upgrade.

| private API | used for | where |
|---|---|---|
| `torch.ops.aten._scaled_dot_product_cudnn_attention` and `_scaled_dot_product_flash_attention` (their output tuples: o, then the logsumexp) | the dense warmup's causal attention with the lse the KL needs (public SDPA returns no lse) | `causal_attention_with_lse` below |
| megatron optimizer `_set_main_param_and_optimizer_states` | loading a torch-Adam optimizer state: megatron 0.19's reshardable loader asks for a `step` it never passes along | `load_optimizer_state` below |
| megatron's Apex-free fallbacks `local_multi_tensor_l2_norm` / `local_multi_tensor_scale`, as the module globals of `megatron.core.optimizer.clip_grads` and `.optimizer` | the optimizer's gradient norm, clipping and parameter copies as torch foreach ops, without a device synchronisation per parameter | `use_foreach_multi_tensor_ops` below |
| megatron `GPTDataset.masks_and_position_ids_are_cacheable` | a loss mask of its own for every sample: megatron 0.19 zeroes its cached one in place where the first sample's labels are padding | `fresh_loss_masks` below |
| `torch.cuda.*` stand-ins, `megatron.core.tensor_parallel.random._get_cuda_rng_state` / `_set_cuda_rng_state`, `megatron.core.transformer.moe.token_dispatcher.maybe_move_tensor_to_cpu` | megatron-core on CPU (gloo) | `msa_model/platform/cpu_shim.py` (its table says why each one) |
"""

from __future__ import annotations

import logging
from importlib import metadata

import torch

log = logging.getLogger(__name__)

# what the private APIs above were checked with (GPU machine: torch 2.11; CPU: torch 2.13)
CHECKED_WITH = {"megatron-core": ("0.19.2",), "torch": ("2.11", "2.13")}


def untested_versions() -> list[str]:
    """'package X (checked with Y)' for every installed package in CHECKED_WITH whose version
    was not checked."""
    out = []
    for package, checked in CHECKED_WITH.items():
        try:
            version = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
        if not any(version == c or version.startswith(c + ".") or version.startswith(c + "+") for c in checked):
            out.append(f"{package} {version} (checked with {', '.join(checked)})")
    return out


def warn_untested_versions() -> None:
    found = untested_versions()
    if found:
        log.warning("private APIs of %s are used (msa_model/platform/compat.py); check them if anything breaks",
                    "; ".join(found))


# the cuDNN kernel is preferred (faster than flash at GQA 64/4: bench/RESULTS.md, "Figures behind
# code choices"); a build or shape it refuses falls back to flash attention for the rest of the process
CUDNN_ATTENTION = {"ok": True}


def causal_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                              cudnn: bool = True):
    """Causal GQA attention on CUDA: o [B, T, Hq, D] and lse float32 [B, T, Hq] (natural log).
    cuDNN where it works, unless `cudnn` is False (a shape not worth a cuDNN graph build yet:
    msa_model/ops/dense_attention/plan.py, `CudnnShapes`); flash attention otherwise."""
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    # under torch.use_deterministic_algorithms flash attention's backward is deterministic;
    # cuDNN's is not known to be (torch's own SDPA dispatch leaves it out then too)
    if cudnn and CUDNN_ATTENTION["ok"] and not torch.are_deterministic_algorithms_enabled():
        try:
            out = torch.ops.aten._scaled_dot_product_cudnn_attention(qt, kt, vt, None, True, 0.0, True, False,
                                                                     scale=scale)
            lse = out[1].reshape(q.shape[0], q.shape[2], q.shape[1])
            return out[0].transpose(1, 2), lse.transpose(1, 2)
        except RuntimeError:
            CUDNN_ATTENTION["ok"] = False
    out = torch.ops.aten._scaled_dot_product_flash_attention(qt, kt, vt, 0.0, True, False, scale=scale)
    return out[0].transpose(1, 2), out[1].transpose(1, 2)


def load_optimizer_state(optimizer, state: dict) -> None:
    """optimizer.load_state_dict, working around megatron 0.19's fully_reshardable loader with torch
    Adam: it restores the per-parameter `step` on its own, then asks the checkpoint for every
    tensor of a parameter's state, `step` included, which it never passes along (KeyError).
    A None `step` is skipped."""
    patched = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        setter = getattr(opt, "_set_main_param_and_optimizer_states", None)
        if setter is None:
            continue
        opt._set_main_param_and_optimizer_states = (
            lambda model_param, tensors, _set=setter: _set(model_param, {"step": None, **tensors}))
        patched.append(opt)
    try:
        # fp32 main params are written in place; outside no_grad autograd would track the copy
        with torch.no_grad():
            optimizer.load_state_dict(state)
    finally:
        for opt in patched:
            del opt._set_main_param_and_optimizer_states


def _foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """megatron's multi_tensor_l2norm (the norm of all tensors of tensor_lists[0] as one vector,
    fp32 [1] on their device) in torch's foreach kernels, without leaving the device."""
    if per_tensor:
        raise NotImplementedError("per-tensor norms are not used by megatron's optimizer here")
    if not tensor_lists[0]:
        return torch.zeros(1, dtype=torch.float32, device=noop_flag.device if noop_flag is not None else "cpu"), None
    norms = torch._foreach_norm([t.float() for t in tensor_lists[0]])
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None


def _foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """megatron's multi_tensor_scale: dst = src * scale for the pairs of tensor_lists [src, dst]."""
    src, dst = tensor_lists
    if not dst:
        return
    if scale == 1.0:
        torch._foreach_copy_(dst, src)
    elif all(a is b for a, b in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def use_foreach_multi_tensor_ops() -> bool:
    """Without Transformer Engine or Apex megatron's optimizer falls back to multi-tensor ops of its
    own that run a kernel or two per parameter, and whose norm copies each parameter's norm to the
    host (`torch.tensor` of a list of device scalars: one synchronisation per parameter, hundreds
    a step). Replace those fallbacks, where they are in use, by torch's foreach kernels (the same
    results up to the order of fp32 sums). Returns whether anything was replaced."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    replaced = False
    for module, name, local, ours in ((clip_grads, "l2_norm_impl", utils.local_multi_tensor_l2_norm, _foreach_l2_norm),
                                      (clip_grads, "multi_tensor_scale_impl", utils.local_multi_tensor_scale,
                                       _foreach_scale),
                                      (optimizer, "multi_tensor_scale_impl", utils.local_multi_tensor_scale,
                                       _foreach_scale)):
        if getattr(module, name, None) is local:
            setattr(module, name, ours)
            replaced = True
    return replaced


def fresh_loss_masks(dataset) -> None:
    """Have `dataset` (a megatron GPTDataset, a BlendedDataset of them, or None) compute each
    sample's loss mask and position ids (a tensor of ones and a range: cheap) instead of reusing
    the first sample's. megatron 0.19 caches the first sample's mask when it depends on the length
    only, then zeroes that very tensor where the first sample's labels are the pad id: every later
    sample of the dataset takes no loss at the first one's padded positions (the retrieval
    windows' filler, data/datasets.py)."""
    for part in getattr(dataset, "datasets", [dataset] if dataset is not None else []):
        part.masks_and_position_ids_are_cacheable = False
