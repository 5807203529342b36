"""A check shared by the GPU tests: a step issues its work without waiting on the device."""

from __future__ import annotations

import torch


def assert_no_host_sync(step) -> None:
    """Run `step` once to compile kernels and fill the allocator's cache, then again under CUDA's
    sync debug mode, which turns any host synchronisation into an error."""
    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
