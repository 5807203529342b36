"""The whole model on a GPU: a forward and backward of the bf16 MSA-MoE (grouped experts, local
token dispatch, MSA in both phases, each recompute setting) issues its work without one host
synchronisation. One would drain the device queue in every layer (megatron's all-to-all
dispatcher used to wait for its token counts in each MoE layer). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from gpu_sync import assert_no_host_sync

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "warmup"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_model_step_never_waits_on_the_device(megatron_one_gpu, sparse, recompute):
    from omegaconf import OmegaConf

    from msa_model.model.attention import set_msa_phase
    from msa_model.config import ModelConfig, ParallelConfig
    from msa_model.model.gpt import build_model

    m = OmegaConf.structured(ModelConfig(num_layers=2, hidden_size=256, ffn_hidden_size=512, num_attention_heads=8,
                                         num_query_groups=2, head_dim=64, seq_length=2048, num_experts=4,
                                         moe_ffn_hidden_size=256, first_dense_layers=1, params_dtype="bf16",
                                         recompute=recompute))
    m.msa.block_size, m.msa.topk, m.msa.index_head_dim = 64, 4, 64
    model = build_model(m, ParallelConfig(), 257, on_cpu=False).cuda()
    model.train()
    set_msa_phase(model, sparse)
    tokens = torch.randint(0, 257, (2, m.seq_length), device="cuda")
    positions = torch.arange(m.seq_length, device="cuda").expand(2, -1)

    def step():
        loss = model(tokens, positions, None, labels=tokens)
        loss.float().mean().backward()

    assert_no_host_sync(step)
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    get_moe_metrics_tracker().clear()
