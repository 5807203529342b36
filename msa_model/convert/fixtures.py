"""Tiny random Hugging Face models of every supported family, built with transformers' own classes.

For tests and smoke runs of the converter without downloads. Each exercises its family's
particulars: Llama with tied embeddings and Llama-3 RoPE scaling, Qwen2 with q/k/v biases,
Qwen3 with QK norm and a head dim unlike hidden/heads, Qwen3-MoE with a leading dense layer and
`norm_topk_prob=false`, Mixtral with renormalised top-k routing. Norm weights and biases are
perturbed away from their 1/0 initialisation so that a dropped or swapped tensor shows.
"""

from __future__ import annotations

from pathlib import Path

import torch

_COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1)

TINY = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=True,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=32))),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_parameters=dict(rope_type="default", rope_theta=1e6))),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=24)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[0],
        norm_topk_prob=False)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
}


def tiny_hf_model(family: str, seed: int = 0, **overrides):
    """A random transformers model of `family` (a key of TINY), fp32, eval mode."""
    import transformers

    config_cls, model_cls, extra = TINY[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{**_COMMON, **extra, **overrides})
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def save_tiny_hf(family: str, out: str | Path, seed: int = 0, max_shard_size: str | None = None, **overrides) -> Path:
    """Save `tiny_hf_model(family)` with save_pretrained (sharded when max_shard_size is given)."""
    model = tiny_hf_model(family, seed, **overrides)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(out), **kwargs)
    return Path(out)
