"""Make megatron-core run on a machine without a GPU (CPU tensors, gloo collectives).

megatron-core assumes CUDA in a handful of places. Each item below is one of them and the
smallest stand-in that lets a GPTModel with MoE layers train, checkpoint and run under
DP/TP/PP/EP over gloo. Nothing here changes numerics: it only answers "which device" and
"which stream" questions.

| megatron-core does                                      | on CPU we                                     |
|---------------------------------------------------------|-----------------------------------------------|
| RNG tracker uses torch.cuda.get_rng_state/manual_seed   | alias the CUDA RNG calls to the CPU generator |
| `torch.cuda.current_device()` as a device (~150 places) | return "cpu"                                  |
| `device="cuda"`, `.cuda()` (optimizer, clip_grads, DDP) | a process-wide TorchFunctionMode maps cuda to cpu, `.cuda()` to identity |
| `pin_memory=True` tensor factories (CP RoPE slicing)    | the same mode drops the flag                  |
| `param.type() == "torch.cuda.FloatTensor"` checks       | the same mode reports `torch.cuda.*Tensor` for float tensors |
| CUDA streams/events/synchronize (MoE dispatch, DDP, p2p) | no-op stand-ins                               |
| alltoall dispatcher wants numpy split sizes (converted only for CUDA tensors) | convert CPU split tensors with `.numpy()` |
| TP x EP: the dispatcher all-gathers a different token count per rank | pad each to the largest (gloo: equal sizes) |

`install()` is idempotent and a no-op when CUDA is available, so calling it unconditionally
at start-up is correct on both kinds of machine.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch.overrides import TorchFunctionMode

log = logging.getLogger(__name__)

_INSTALLED = False

_CUDA_TENSOR_TYPES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


def _to_cpu(device):
    return torch.device("cpu") if _is_cuda(device) else device


class _CudaToCpuMode(TorchFunctionMode):
    """Redirect CUDA device requests to the CPU for every torch call in this process."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # megatron compares type strings to decide what counts as a (cuda) float param
            dtype = args[0].dtype
            if dtype in _CUDA_TENSOR_TYPES:
                return _CUDA_TENSOR_TYPES[dtype]
        if "device" in kwargs:
            kwargs["device"] = _to_cpu(kwargs["device"])
        if kwargs.get("pin_memory"):
            # e.g. the context-parallel RoPE slice builds its index tensor in pinned memory
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to:
            args = tuple(_to_cpu(a) for a in args)
        return func(*args, **kwargs)


class _NullEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


class _NullStream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, event=None):
        return event if event is not None else _NullEvent()

    def synchronize(self):
        pass

    def query(self):
        return True

    def __eq__(self, other):
        return isinstance(other, _NullStream)

    def __hash__(self):
        return 0


_DEFAULT_STREAM = _NullStream()


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: "cpu"
    cuda.synchronize = lambda *a, **k: None
    cuda.Stream = _NullStream
    cuda.Event = _NullEvent
    cuda.current_stream = lambda *a, **k: _DEFAULT_STREAM
    cuda.default_stream = lambda *a, **k: _DEFAULT_STREAM
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.set_device = lambda *a, **k: None
    # the "cuda" RNG of megatron's tracker becomes the CPU generator; the tracker still keeps
    # separate named states (data-parallel, model-parallel, expert) and swaps them in and out
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    cuda.manual_seed = lambda seed: torch.manual_seed(seed)
    torch.Tensor.record_stream = lambda self, *a, **k: None


def _patch_megatron() -> None:
    from megatron.core.tensor_parallel import mappings
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer.moe import token_dispatcher

    mcore_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mcore_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)

    original = token_dispatcher.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        # the upstream helper converts to numpy only for CUDA tensors; all2all needs lists
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu

    gather = mappings._gather_along_first_dim

    def gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        # the alltoall dispatcher under expert tensor parallelism (TP and EP) gathers each rank's
        # tokens, a different count on each rank (forward, and the backward of its reduce-scatter)
        if output_split_sizes is None or len(set(output_split_sizes)) == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        rows = max(output_split_sizes)
        padded = input_.new_zeros((rows, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = gather(padded, group).split(rows)
        return torch.cat([part[:n] for part, n in zip(parts, output_split_sizes)])

    mappings._gather_along_first_dim = gather_along_first_dim


def install() -> bool:
    """Install the CPU stand-ins once per process. Returns True when they are active."""
    global _INSTALLED
    if torch.cuda.is_available():
        return False
    if _INSTALLED:
        return True
    _patch_torch_cuda()
    _patch_megatron()
    # entered for the lifetime of the process on purpose: megatron creates cuda tensors
    # from deep inside its optimizer and DDP code, there is no narrower scope to wrap
    _CudaToCpuMode().__enter__()
    _INSTALLED = True
    log.debug("cpu shim installed: megatron-core runs on CPU")
    return True


def is_installed() -> bool:
    return _INSTALLED
