"""CUDA_DEVICE_MAX_CONNECTIONS for tensor parallelism on GPUs (msa_model/training/distributed.py
`cuda_connections`), chosen from the parallel layout and trainer.device, before CUDA starts."""

from __future__ import annotations

import pytest

from msa_model.config import ParallelConfig
from msa_model.training.distributed import cuda_connections


@pytest.mark.parametrize("tp, sequence_parallel, device", [(2, True, "cuda"), (2, False, "cuda"), (4, True, "auto")])
def test_tensor_parallel_runs_on_gpus_get_one_connection(tp, sequence_parallel, device):
    env = {}
    lines = cuda_connections(ParallelConfig(tp=tp, sequence_parallel=sequence_parallel), device, env)
    assert env == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert len(lines) == 1 and lines[0].startswith(f"CUDA_DEVICE_MAX_CONNECTIONS=1 (parallel.tp={tp})")


@pytest.mark.parametrize("tp, device", [(1, "cuda"), (1, "auto"), (2, "cpu")])
def test_without_tensor_parallelism_on_gpus_nothing_is_set(tp, device):
    env = {}
    assert cuda_connections(ParallelConfig(tp=tp, sequence_parallel=tp > 1), device, env) == []
    assert env == {}


def test_a_value_of_the_user_stays():
    env = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert cuda_connections(ParallelConfig(tp=2, sequence_parallel=True), "cuda", env) == []
    env = {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}
    (line,) = cuda_connections(ParallelConfig(tp=2, sequence_parallel=True), "cuda", env)
    assert env == {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}
    assert line.startswith("warning: CUDA_DEVICE_MAX_CONNECTIONS=8 from the environment; with parallel.tp=2")
