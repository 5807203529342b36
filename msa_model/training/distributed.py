"""Process-group and megatron parallel-state set-up, apart from model code.

Launch modes, detected from the environment:
- single process (`python train.py`): a 1-rank group over an in-memory store, no torchrun;
- torchrun: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT;
- srun without torchrun: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID (MASTER_ADDR/PORT must be set).
Backend: nccl on CUDA, gloo on CPU (where msa_model.platform.cpu_shim is installed first).
`parallel.timeout_minutes` bounds how long a rank waits for the others: to join the process group
(a rank that failed at start leaves the rest waiting that long, then each says how many came)
and in any one collective (Megatron-LM's --distributed-timeout-minutes).
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import random
import re
from collections.abc import MutableMapping
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


def cuda_connections(parallel_cfg, device_preference: str, env: MutableMapping[str, str] | None = None) -> list[str]:
    """CUDA_DEVICE_MAX_CONNECTIONS=1 in `env` (os.environ) for tensor parallelism that may run on
    GPUs (parallel.tp > 1, trainer.device auto or cuda), unless the variable is set already.
    megatron's tensor-parallel linear layers start their all-gather, reduce-scatter (sequence
    parallel) or all-reduce without waiting and count on one hardware queue per device to run it
    before the GEMM that should overlap it; with several queues the GEMM may go first. CUDA reads
    the variable once, when it starts: to be called before. Harmless on CPU. Returns the lines
    that say what was set, or that a value of the user's differs, for the log of a CUDA run."""
    env = os.environ if env is None else env
    if parallel_cfg.tp <= 1 or device_preference == "cpu":
        return []
    value = env.get("CUDA_DEVICE_MAX_CONNECTIONS")
    if not value:
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
        return [f"CUDA_DEVICE_MAX_CONNECTIONS=1 (parallel.tp={parallel_cfg.tp}): tensor-parallel communication "
                "is queued ahead of the computation it overlaps, as megatron expects"]
    if value != "1":
        return [f"warning: CUDA_DEVICE_MAX_CONNECTIONS={value} from the environment; with parallel.tp="
                f"{parallel_cfg.tp} megatron expects 1 (its tensor-parallel communication may not overlap "
                "the computation); unset it to let the trainer set 1"]
    return []


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
        minutes = parallel_cfg.timeout_minutes
        timeout = datetime.timedelta(minutes=minutes)
        if world_size == 1 and "MASTER_ADDR" not in os.environ:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
            waited = f"within {_span(timeout)} (parallel.timeout_minutes={minutes:g})"
            try:
                dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size,
                                        timeout=timeout)
            except dist.DistStoreError as e:
                # rank 0's store, waiting for the others: said here, not swallowed by a launcher
                came = re.search(r"(\d+)/(\d+) clients joined", str(e))
                joined = f"{came.group(1)} of {came.group(2)}" if came else "not all"
                raise ProcessGroupError(f"rank {rank} of {world_size}: {joined} ranks joined the process group "
                                        f"at {where} {waited}; the missing ranks' logs say why they did not "
                                        "start") from e
            except dist.DistNetworkError as e:
                if rank == 0:  # its own store could not listen
                    raise ProcessGroupError(f"rank {rank} of {world_size} could not start the process group at "
                                            f"{where} ({str(e).splitlines()[0]}); is another job using that "
                                            "port?") from e
                raise ProcessGroupError(f"rank {rank} of {world_size} could not reach rank 0's process group at "
                                        f"{where} {waited}: did rank 0 fail at start? ({str(e).splitlines()[0]})"
                                        ) from e

    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel_cfg.tp,
        pipeline_model_parallel_size=parallel_cfg.pp,
        context_parallel_size=parallel_cfg.cp,
        expert_model_parallel_size=parallel_cfg.ep,
        distributed_timeout_minutes=math.ceil(parallel_cfg.timeout_minutes),
    )
    # pipeline stages hold different layers: give them different streams, like megatron does
    stage_seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(stage_seed)
    np.random.seed(stage_seed)
    torch.manual_seed(stage_seed)
    model_parallel_cuda_manual_seed(stage_seed)
    return DistEnv(rank=rank, world_size=world_size, local_rank=local_rank, device=device, backend=backend)


def _span(t: datetime.timedelta) -> str:
    seconds = t.total_seconds()
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


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
