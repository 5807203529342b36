"""trainer.deterministic=true: the same bits from the same config, run to run and across a stop and
resume (for debugging, and for checking that a resumed run continues exactly), at some cost in
speed; Megatron-LM's --deterministic-mode does the same for its own kernels.

What it sets, before CUDA and NCCL start:
- torch.use_deterministic_algorithms(True) (strict: an op without a deterministic implementation
  raises, naming itself), cuDNN deterministic and not benchmarking;
- CUBLAS_WORKSPACE_CONFIG=:4096:8 (cuBLAS reductions in a fixed order), unless already set to a
  deterministic value;
- NCCL_ALGO=Ring unless set (reductions across ranks in a fixed order for a fixed layout;
  Megatron-LM requires one of Tree, Ring, CollnetDirect, CollnetChain, ^NVLS).

What follows from torch's flag in this project's code: the indexer KL's sparse backward stores
its partial gradients and sums them in a fixed order instead of adding them with atomics
(msa_model/ops/indexer_kl/triton.py, `_Sums`), and dense attention takes torch's flash kernels
(deterministic backward in this mode) rather than cuDNN's (msa_model/platform/compat.py,
msa_model/ops/dense_attention). Every other kernel of the ops is deterministic as it is (no
atomics; the sparse attention reduces its partials in order), and so are the data order, the
RNG streams (restored on resume) and the optimizer.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

import torch

CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")
NCCL_DETERMINISTIC = ("Tree", "Ring", "CollnetDirect", "CollnetChain", "^NVLS")


def deterministic_mode(env: MutableMapping[str, str] | None = None) -> list[str]:
    """Switch this process to deterministic execution (see the module docstring); `env` is the
    environment to set (os.environ). Returns the lines that say what was set, for the log."""
    env = os.environ if env is None else env
    lines = []
    if env.get("CUBLAS_WORKSPACE_CONFIG") not in CUBLAS_DETERMINISTIC:
        env["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_DETERMINISTIC[0]
    if not env.get("NCCL_ALGO"):
        env["NCCL_ALGO"] = "Ring"
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    lines.append(f"deterministic mode: torch deterministic algorithms (strict), cuDNN deterministic, "
                 f"CUBLAS_WORKSPACE_CONFIG={env['CUBLAS_WORKSPACE_CONFIG']}, NCCL_ALGO={env['NCCL_ALGO']}; "
                 "the indexer KL's backward sums in a fixed order, dense attention runs flash attention")
    if env["NCCL_ALGO"] not in NCCL_DETERMINISTIC:
        lines.append(f"deterministic mode: NCCL_ALGO={env['NCCL_ALGO']} is not one of {', '.join(NCCL_DETERMINISTIC)}; "
                     "reductions across ranks may not be reproducible")
    return lines
