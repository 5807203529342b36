"""An MSA model and a dense one built with the same seed share every backbone weight: the index
branch draws from a stream of its own (msa_model.model.rng), so a quality study's pair of arms at
one seed starts from one model. The index branch's own draws are reproducible and differ by layer."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_rank():
    from msa_model.config import ParallelConfig
    from msa_model.training.distributed import init_distributed, shutdown

    init_distributed(ParallelConfig(), "cpu", 1234)
    yield
    shutdown()


def _weights(attention: str, seed: int, qk_layernorm: bool = True) -> dict[str, torch.Tensor]:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from omegaconf import OmegaConf

    from msa_model.config import ModelConfig, ParallelConfig
    from msa_model.model.gpt import build_model

    cfg = OmegaConf.structured(ModelConfig(
        num_layers=3, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2, head_dim=16,
        seq_length=128, num_experts=4, moe_ffn_hidden_size=32, first_dense_layers=1, attention=attention,
        qk_layernorm=qk_layernorm))
    torch.manual_seed(seed)  # as the trainer seeds before it builds the model
    model_parallel_cuda_manual_seed(seed)
    model = build_model(cfg, ParallelConfig(), vocab_size=256, on_cpu=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("qk_layernorm", [True, False])
def test_the_backbone_is_the_dense_models_at_the_same_seed(one_rank, qk_layernorm):
    dense, msa = _weights("dense", 7, qk_layernorm), _weights("msa", 7, qk_layernorm)
    index = sorted(k for k in msa if k not in dense)
    assert index and all(".index_" in k for k in index), index
    assert sorted(k for k in dense if k not in msa) == []
    differ = [k for k in dense if not torch.equal(dense[k], msa[k])]
    assert differ == [], differ
    # another seed: another backbone (the comparison above could not pass by building constants)
    other = _weights("dense", 8, qk_layernorm)
    assert not torch.equal(other["decoder.layers.0.self_attention.linear_qkv.weight"],
                           dense["decoder.layers.0.self_attention.linear_qkv.weight"])


def test_the_index_branch_draws_are_reproducible_and_differ_by_layer(one_rank):
    a, b, c = _weights("msa", 7), _weights("msa", 7), _weights("msa", 8)
    names = [k for k in a if k.endswith("index_q_proj.weight")]
    assert len(names) == 3
    for k in names:
        assert torch.equal(a[k], b[k]) and not torch.equal(a[k], c[k]), k
        assert a[k].std() > 0
    assert not torch.equal(a[names[0]], a[names[1]])
    # not a copy of the draws the backbone makes next (the stream is derived, not replayed)
    fc1 = a["decoder.layers.0.mlp.linear_fc1.weight"].flatten()
    iq = a[names[0]].flatten()
    assert not torch.equal(iq[:64], fc1[:64])
