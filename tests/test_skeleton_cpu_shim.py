"""The CPU shim: CUDA requests land on the CPU, megatron's RNG tracker keeps distinct streams,
and a megatron linear layer + DDP + distributed optimizer step works over gloo. Run in a
subprocess because the shim is process-wide by design."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from skeleton_helpers import REPO, _env

SCRIPT = textwrap.dedent("""
    import torch
    from msa_model.platform import cpu_shim
    assert cpu_shim.install() and cpu_shim.install()  # idempotent

    # device redirection and identity .cuda()
    t = torch.empty(3, device="cuda")
    assert t.device.type == "cpu"
    assert torch.zeros(2, device=torch.device("cuda", 0)).device.type == "cpu"
    x = torch.ones(2)
    assert x.cuda() is x and x.to("cuda").device.type == "cpu"
    assert torch.empty(1, device=torch.cuda.current_device()).device.type == "cpu"
    assert x.type() == "torch.cuda.FloatTensor" and x.bfloat16().type() == "torch.cuda.BFloat16Tensor"
    assert x.long().type() == "torch.LongTensor"
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()

    # megatron's RNG tracker: named streams differ from each other and are reproducible
    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(1, 1)
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    def draws():
        model_parallel_cuda_manual_seed(7)
        with get_cuda_rng_tracker().fork():
            a = torch.rand(4)
        with get_cuda_rng_tracker().fork("expert-parallel-rng"):
            b = torch.rand(4)
        return a, b
    a1, b1 = draws()
    a2, b2 = draws()
    assert torch.equal(a1, a2) and torch.equal(b1, b2) and not torch.equal(a1, b1)

    # a megatron layer under DDP + distributed optimizer takes a step on CPU
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.transformer_config import TransformerConfig
    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True,
                            gradient_accumulation_fusion=False)
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = ColumnParallelLinear(8, 8, config=cfg, init_method=torch.nn.init.normal_, bias=False)
        def forward(self, x):
            return self.lin(x)[0]
    model = DistributedDataParallel(cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True), Net())
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=0.1, use_distributed_optimizer=True, clip_grad=1.0), [model])
    before = model.module.lin.weight.detach().clone()
    model.zero_grad_buffer(); opt.zero_grad()
    model(torch.randn(4, 8)).square().mean().backward()
    model.finish_grad_sync()
    ok, grad_norm, _ = opt.step()
    assert ok and grad_norm > 0 and not torch.equal(before, model.module.lin.weight)
    assert model.module.lin.weight.device.type == "cpu"
    print("SHIM-OK")
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the shim is a no-op when CUDA is present")
def test_cpu_shim_makes_megatron_run_on_cpu():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0 and "SHIM-OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_cpu_shim_is_a_no_op_with_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from msa_model.platform import cpu_shim

    assert cpu_shim.install() is False and not cpu_shim.is_installed()
