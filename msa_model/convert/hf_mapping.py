"""Tensor layouts: Hugging Face <-> our GPTModel's (unsharded, TP=1) state dict, for every family.

Each `Rule` ties one megatron tensor to the HF tensors it is made of (a family's `rules` lists
them for a model; msa_model.convert.family):
- `copy`: the same tensor under another name;
- `qkv`:  megatron's fused QKV interleaves per GQA group: for group g its G query heads, then its
          key head, then its value head, each D rows ([G*D + D + D] rows per group);
          HF keeps q_proj [Hq*D, H], k_proj [Hkv*D, H], v_proj [Hkv*D, H] (biases likewise);
- `glu`:  megatron's SwiGLU fc1 is [gate; up] stacked along the output dim ([2F, H]).
Both directions are exact reshapes and concatenations, so hf -> ours -> hf is bit-identical.

Legend: H = hidden size, Hq = query heads, Hkv = kv heads (GQA groups), G = Hq / Hkv,
D = head dim, F = MLP hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from msa_model.convert.hf_io import ConversionError


@dataclass(frozen=True)
class Rule:
    mcore: str
    hf: tuple[str, ...]
    kind: str = "copy"  # copy | qkv | glu


def decoder_rules(model, attention: Callable[[int, str, str], list[Rule]],
                  mlp: Callable[[int, str, str], list[Rule]]) -> list[Rule]:
    """The rules of a decoder whose Hugging Face names are `model.layers.N...`, in a fixed order: the
    embedding; per layer its input norm, `attention(i, hf, ours)` (the prefixes
    `model.layers.i.self_attn` and `decoder.layers.i.self_attention`), its pre-MLP norm and
    `mlp(i, hf, ours)` (`model.layers.i`, `decoder.layers.i`); the final norm and, untied, the
    output layer."""
    out = [Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",))]
    for i in range(model.num_layers):
        hf, mc = f"model.layers.{i}", f"decoder.layers.{i}"
        out.append(Rule(f"{mc}.input_layernorm.weight", (f"{hf}.input_layernorm.weight",)))
        out += attention(i, f"{hf}.self_attn", f"{mc}.self_attention")
        out.append(Rule(f"{mc}.pre_mlp_layernorm.weight", (f"{hf}.post_attention_layernorm.weight",)))
        out += mlp(i, hf, mc)
    out.append(Rule("decoder.final_layernorm.weight", ("model.norm.weight",)))
    if not model.tie_embeddings:
        out.append(Rule("output_layer.weight", ("lm_head.weight",)))
    return out


def fuse(rule: Rule, tensors: list[torch.Tensor], model) -> torch.Tensor:
    """The megatron tensor of `rule` from its HF tensors (in `rule.hf` order)."""
    if rule.kind == "copy":
        return tensors[0]
    if rule.kind == "glu":
        return torch.cat(tensors, dim=0)
    q, k, v = tensors
    g, d = model.num_query_groups, model.head_dim
    rest = q.shape[1:]
    q_G = q.reshape(g, -1, *rest)  # [Hkv, G*D, ...]: the query heads of each group are contiguous
    k_G, v_G = k.reshape(g, d, *rest), v.reshape(g, d, *rest)
    return torch.cat([q_G, k_G, v_G], dim=1).reshape(-1, *rest)


def split(rule: Rule, tensor: torch.Tensor, model) -> list[torch.Tensor]:
    """Inverse of `fuse`: the HF tensors of `rule` from the megatron tensor."""
    if rule.kind == "copy":
        return [tensor]
    if rule.kind == "glu":
        return list(torch.chunk(tensor, 2, dim=0))
    g, d, hq = model.num_query_groups, model.head_dim, model.num_attention_heads
    rest = tensor.shape[1:]
    per_group = tensor.reshape(g, -1, *rest)
    q, k, v = torch.split(per_group, [hq // g * d, d, d], dim=1)
    return [t.reshape(-1, *rest).contiguous() for t in (q, k, v)]


def check_hf_shapes(ckpt, expected: dict[str, tuple[int, ...]], where: str, optional=()) -> None:
    """Raise ConversionError naming the first tensor that is missing or has the wrong shape."""
    for name, shape in expected.items():
        if name not in ckpt:
            if name in optional:
                continue
            raise ConversionError(f"{where}: tensor {name!r} is missing (expected shape {list(shape)})")
        found = ckpt.shape(name)
        if tuple(found) != tuple(shape):
            raise ConversionError(f"{where}: tensor {name!r} has shape {list(found)}, expected {list(shape)} "
                                  "from config.json")
