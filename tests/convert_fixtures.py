"""Tiny random Hugging Face models of every supported family, built with transformers' own classes.

For the converter's tests, without downloads. Each exercises its family's particulars: Llama with
tied embeddings and Llama-3 RoPE scaling, Qwen2 with q/k/v biases, Qwen3 with QK norm and a head dim
unlike hidden/heads, Qwen3-MoE with a leading dense layer and `norm_topk_prob=false`, Mixtral with
renormalised top-k routing, Mistral without a sliding window, and MiniMax-M3 (M3_TINY) with every
option of msa_model.convert.minimax_m3. Norm weights and biases are perturbed away from their 1/0
initialisation so that a dropped or swapped tensor shows.
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
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None, head_dim=16)),
}

# MiniMax-M3 text model: MSA, full and MSA layers mixed, dense and MoE MLPs not in leading order,
# 2 forced local blocks of 16 tokens in a top-3, RoPE on 8 of 16 head channels with a wider
# index head (24), a clamp that bites (|x| <= 1 where x has std ~1), a non-default gate alpha
M3_TINY = dict(
    vocab_size=300, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=32, dense_intermediate_size=96, shared_intermediate_size=24, num_local_experts=4,
    num_experts_per_tok=2, routed_scaling_factor=2.0, swiglu_alpha=1.6, swiglu_limit=1.0,
    layer_types=["minimax_m3_sparse", "full_attention", "minimax_m3_sparse"],
    mlp_layer_types=["sparse", "dense", "sparse"], index_n_heads=2, index_head_dim=24, index_block_size=16,
    index_topk_blocks=3, index_local_blocks=2, rotary_dim=8, max_position_embeddings=512, initializer_range=0.1,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
    bos_token_id=1, eos_token_id=2,
)
# the vision-language wrapper (release layout on disk): a tiny vision tower to be skipped
M3_TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)


def tiny_hf_model(family: str, seed: int = 0, **overrides):
    """A random transformers model of `family` (a key of TINY), fp32, eval mode."""
    import transformers

    config_cls, model_cls, extra = TINY[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{**_COMMON, **extra, **overrides})
    model = getattr(transformers, model_cls)(config).eval()
    _perturb(model)
    return model


def _perturb(model, bias_std: float = 0.1) -> None:
    """Move norm weights, biases and the router's expert bias away from their 0/1 init."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * bias_std)


def tiny_m3_model(seed: int = 0, vision: bool = False, **overrides):
    """A random MiniMax-M3 transformers model (M3_TINY; with `vision`, the vision-language model
    whose save_pretrained writes the release layout), fp32, eval mode."""
    import transformers

    torch.manual_seed(seed)
    text = transformers.MiniMaxM3VLTextConfig(**{**M3_TINY, **overrides})
    if vision:
        config = transformers.MiniMaxM3VLConfig(text_config=text.to_dict(), vision_config=M3_TINY_VISION,
                                                projector_hidden_size=64)
        model = transformers.MiniMaxM3SparseForConditionalGeneration(config).eval()
    else:
        model = transformers.MiniMaxM3VLForCausalLM(text).eval()
    _perturb(model, bias_std=0.05)
    return model


def save_tiny_m3(out: str | Path, seed: int = 0, vision: bool = False, **overrides) -> Path:
    tiny_m3_model(seed, vision, **overrides).save_pretrained(str(out))
    return Path(out)


def save_tiny_hf(family: str, out: str | Path, seed: int = 0, max_shard_size: str | None = None, **overrides) -> Path:
    """Save `tiny_hf_model(family)` with save_pretrained (sharded when max_shard_size is given)."""
    model = tiny_hf_model(family, seed, **overrides)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(out), **kwargs)
    return Path(out)
