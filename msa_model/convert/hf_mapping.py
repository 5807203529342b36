"""Tensor names and layouts: Hugging Face <-> our GPTModel's (unsharded, TP=1) state dict.

Each `Rule` ties one megatron tensor to the HF tensors it is made of:
- `copy`: the same tensor under another name;
- `qkv`:  megatron's fused QKV interleaves per GQA group: for group g its G query heads, then its
          key head, then its value head, each D rows ([G*D + D + D] rows per group);
          HF keeps q_proj [Hq*D, H], k_proj [Hkv*D, H], v_proj [Hkv*D, H] (biases likewise);
- `glu`:  megatron's SwiGLU fc1 is [gate; up] stacked along the output dim ([2F, H]).
Both directions are exact reshapes and concatenations, so hf -> ours -> hf is bit-identical.

The index branch of MSA is exported under HF-style names (see README, "Converting dense
checkpoints"): `model.layers.N.self_attn.index_q_proj.weight` [Hkv*Di, H],
`index_k_proj.weight` [Di, H], `index_q_norm.weight` [Di], `index_k_norm.weight` [Di].

Legend: H = hidden size, Hq = query heads, Hkv = kv heads (GQA groups), G = Hq / Hkv,
D = head dim, Di = index head dim, F = MLP hidden size, E = experts, V = vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from msa_model.config import moe_layers, msa_layers_of
from msa_model.convert import minimax_m3 as m3
from msa_model.convert.hf_families import Family
from msa_model.convert.hf_io import ConversionError

INDEX_TENSORS = {  # megatron attribute -> HF attribute (under model.layers.N.self_attn)
    "index_q_proj.weight": "index_q_proj.weight",
    "index_k_proj.weight": "index_k_proj.weight",
    "index_q_layernorm.weight": "index_q_norm.weight",
    "index_k_layernorm.weight": "index_k_norm.weight",
}


@dataclass(frozen=True)
class Rule:
    mcore: str
    hf: tuple[str, ...]
    kind: str = "copy"  # copy | qkv | glu


def rules(model, fam: Family, with_index: bool) -> list[Rule]:
    """Every tensor of a `model` (ModelConfig) model and its HF source, in a fixed order."""
    if fam.name == "minimax_m3":
        return m3.rules(model, with_index)
    moe, msa = moe_layers(model), msa_layers_of(model)
    out = [Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",))]
    for i in range(model.num_layers):
        hf, mc = f"model.layers.{i}", f"decoder.layers.{i}"
        attn, sa = f"{hf}.self_attn", f"{mc}.self_attention"
        out.append(Rule(f"{mc}.input_layernorm.weight", (f"{hf}.input_layernorm.weight",)))
        out.append(Rule(f"{sa}.linear_qkv.weight", tuple(f"{attn}.{p}_proj.weight" for p in "qkv"), "qkv"))
        if model.qkv_bias:
            out.append(Rule(f"{sa}.linear_qkv.bias", tuple(f"{attn}.{p}_proj.bias" for p in "qkv"), "qkv"))
        if model.qk_layernorm:
            out.append(Rule(f"{sa}.q_layernorm.weight", (f"{attn}.q_norm.weight",)))
            out.append(Rule(f"{sa}.k_layernorm.weight", (f"{attn}.k_norm.weight",)))
        out.append(Rule(f"{sa}.linear_proj.weight", (f"{attn}.o_proj.weight",)))
        if with_index and msa[i]:
            for mname, hname in INDEX_TENSORS.items():
                if "layernorm" in mname and not model.qk_layernorm:
                    continue
                out.append(Rule(f"{sa}.{mname}", (f"{attn}.{hname}",)))
        out.append(Rule(f"{mc}.pre_mlp_layernorm.weight", (f"{hf}.post_attention_layernorm.weight",)))
        if moe[i]:
            moe = f"{hf}.{fam.moe_module}"
            gate, up, down = fam.expert_names
            out.append(Rule(f"{mc}.mlp.router.weight", (f"{moe}.gate.weight",)))
            for e in range(model.num_experts):
                ex, mx = f"{moe}.experts.{e}", f"{mc}.mlp.experts.local_experts.{e}"
                out.append(Rule(f"{mx}.linear_fc1.weight", (f"{ex}.{gate}.weight", f"{ex}.{up}.weight"), "glu"))
                out.append(Rule(f"{mx}.linear_fc2.weight", (f"{ex}.{down}.weight",)))
        else:
            out.append(Rule(f"{mc}.mlp.linear_fc1.weight", (f"{hf}.mlp.gate_proj.weight", f"{hf}.mlp.up_proj.weight"), "glu"))
            out.append(Rule(f"{mc}.mlp.linear_fc2.weight", (f"{hf}.mlp.down_proj.weight",)))
    out.append(Rule("decoder.final_layernorm.weight", ("model.norm.weight",)))
    if not model.tie_embeddings:
        out.append(Rule("output_layer.weight", ("lm_head.weight",)))
    return out


def hf_shapes(model, fam: Family, with_index: bool) -> dict[str, tuple[int, ...]]:
    """The shape every HF tensor must have for `model` (unpadded vocab)."""
    if fam.name == "minimax_m3":
        return m3.shapes(model, with_index)
    m = model
    h, d, hq, g, v = m.hidden_size, m.head_dim, m.num_attention_heads, m.num_query_groups, m.vocab_size
    di = m.msa.index_head_dim
    shapes: dict[str, tuple[int, ...]] = {}
    for rule in rules(model, fam, with_index):
        for name in rule.hf:
            leaf = name.rsplit(".", 2)[-2] + "." + name.rsplit(".", 1)[-1]
            if name in ("model.embed_tokens.weight", "lm_head.weight"):
                shape = (v, h)
            elif leaf in ("q_proj.weight", "o_proj.weight"):
                shape = (hq * d, h) if leaf.startswith("q") else (h, hq * d)
            elif leaf in ("k_proj.weight", "v_proj.weight"):
                shape = (g * d, h)
            elif leaf == "q_proj.bias":
                shape = (hq * d,)
            elif leaf in ("k_proj.bias", "v_proj.bias"):
                shape = (g * d,)
            elif leaf in ("q_norm.weight", "k_norm.weight"):
                shape = (d,)
            elif leaf == "index_q_proj.weight":
                shape = (g * di, h)
            elif leaf == "index_k_proj.weight":
                shape = (di, h)
            elif leaf in ("index_q_norm.weight", "index_k_norm.weight"):
                shape = (di,)
            elif leaf == "gate.weight":
                shape = (m.num_experts, h)
            elif ".experts." in name:
                f = m.moe_ffn_hidden_size
                shape = (h, f) if leaf.startswith(fam.expert_names[2]) else (f, h)
            elif ".mlp." in name:
                f = m.ffn_hidden_size
                shape = (h, f) if leaf.startswith("down_proj") else (f, h)
            else:  # norms
                shape = (h,)
            shapes[name] = shape
    return shapes


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
