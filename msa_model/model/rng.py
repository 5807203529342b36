"""A random stream of its own for parameters a dense model does not have.

An MSA model and a dense one built with the same seed should start from the same backbone, so that
a quality comparison of the two at equal seeds is paired from the first step (the index branch
does not feed the backbone). megatron draws each layer's weights from shared streams in build
order: the index projections, made inside every attention layer, would move every later weight.
`own_stream` makes their draws from streams derived from the current ones and leaves those where
they were.
"""

from __future__ import annotations

import contextlib
import hashlib

import torch
from megatron.core.tensor_parallel import get_cuda_rng_tracker

from msa_model.platform import cpu_shim


def _seed(state: torch.Tensor, salt: str) -> int:
    """A seed from a generator state and a name: other ranks' (other tensor-parallel shards') states
    give other seeds, as megatron's streams do; the same state and name, the same seed."""
    digest = hashlib.sha256(state.cpu().numpy().tobytes() + salt.encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _device_state(seed: int) -> torch.Tensor:
    """The state of the device generator (the CPU's under the CPU shim) seeded with `seed`."""
    torch.cuda.manual_seed(seed)
    return torch.cuda.get_rng_state()


@contextlib.contextmanager
def own_stream(salt: str):
    """Draws inside come from streams derived from the current ones and `salt` (the CPU generator,
    the device's, and each named state of megatron's tracker); after the block every stream is
    back where it was, as if nothing had been drawn."""
    tracker = get_cuda_rng_tracker()
    device = torch.cuda.is_available() or cpu_shim.is_installed()
    cpu_state = torch.get_rng_state()
    device_state = torch.cuda.get_rng_state() if device else None
    tracked = tracker.get_states()
    try:
        torch.set_rng_state(torch.Generator().manual_seed(_seed(cpu_state, salt)).get_state())
        if device:
            tracker.set_states({name: _device_state(_seed(state, f"{salt}/{name}")) for name, state in tracked.items()})
            torch.cuda.set_rng_state(_device_state(_seed(device_state, salt)))
        yield
    finally:
        tracker.set_states(tracked)
        if device:
            torch.cuda.set_rng_state(device_state)
        torch.set_rng_state(cpu_state)
