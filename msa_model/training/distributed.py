"""Process-group and megatron parallel-state set-up, apart from model code.

Launch modes, detected from the environment:
- single process (`python train.py`): a 1-rank group over an in-memory store, no torchrun;
- torchrun: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT;
- srun without torchrun: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID (MASTER_ADDR/PORT must be set).
Backend: nccl on CUDA, gloo on CPU (where msa_model.platform.cpu_shim is installed first).
"""

from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from msa_model.platform import cpu_shim

log = logging.getLogger(__name__)


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launch_env() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun or SLURM variables; (0, 1, 0) otherwise."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0))
    if int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in env:
        return int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0))
    return 0, 1, 0


def pick_device(preference: str, local_rank: int) -> torch.device:
    if preference == "cuda" or (preference == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("trainer.device=cuda but CUDA is not available")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


class ProcessGroupError(RuntimeError):
    """The default process group could not be started (rendezvous address or port)."""


def init_distributed(parallel_cfg, device_preference: str, seed: int) -> DistEnv:
    """Create the default process group and megatron's tp/pp/ep/cp/dp groups, and seed RNGs."""
    rank, world_size, local_rank = launch_env()
    device = pick_device(device_preference, local_rank)
    if device.type == "cpu":
        cpu_shim.install()
    backend = parallel_cfg.backend if parallel_cfg.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    if not dist.is_initialized():
        if world_size == 1 and "MASTER_ADDR" not in os.environ:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        else:
            try:
                dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size)
            except dist.DistNetworkError as e:
                # e.g. the port held by another process: said here, not swallowed by a launcher
                where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
                raise ProcessGroupError(f"rank {rank} of {world_size} could not start the process group at {where} "
                                        f"({str(e).splitlines()[0]}); is another job using that port?") from e

    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel_cfg.tp,
        pipeline_model_parallel_size=parallel_cfg.pp,
        context_parallel_size=parallel_cfg.cp,
        expert_model_parallel_size=parallel_cfg.ep,
    )
    # pipeline stages hold different layers: give them different streams, like megatron does
    stage_seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(stage_seed)
    np.random.seed(stage_seed)
    torch.manual_seed(stage_seed)
    model_parallel_cuda_manual_seed(stage_seed)
    return DistEnv(rank=rank, world_size=world_size, local_rank=local_rank, device=device, backend=backend)


def data_parallel_info() -> tuple[int, int]:
    """(dp_rank, dp_size) of this rank, context parallelism folded out."""
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()


def parallel_layout(parallel_cfg, world_size: int) -> dict[str, int]:
    p = parallel_cfg
    dp = world_size // (p.tp * p.pp * p.cp)
    return {"world_size": world_size, "tp": p.tp, "pp": p.pp, "cp": p.cp, "ep": p.ep, "dp": dp,
            "micro_batch_size": p.micro_batch_size, "global_batch_size": p.global_batch_size,
            "grad_accumulation": p.global_batch_size // (p.micro_batch_size * dp)}


def shutdown() -> None:
    from megatron.core import parallel_state

    if dist.is_initialized():
        dist.barrier()
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
