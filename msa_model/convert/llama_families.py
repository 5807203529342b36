"""The Llama-layout families (Llama, Qwen2, Qwen3, Qwen3-MoE, Mixtral, Mistral): one `LlamaFamily`
each, its particulars as fields (msa_model.convert.families lists them).

Every such family is GQA with SwiGLU MLPs, RMSNorm and rotary embeddings, which is exactly our
model's backbone. Tensors: `model.layers.N.self_attn.{q,k,v,o}_proj` (q/k/v biases where
`qkv_bias`), `{q,k}_norm` where `qk_norm`, `mlp.{gate,up,down}_proj` for a dense MLP and
`<moe_module>.gate` + `<moe_module>.experts.E.<expert_names>` for an MoE one.

The index branch of MSA is exported under HF-style names (see README, "Converting dense
checkpoints"): `model.layers.N.self_attn.index_q_proj.weight` [Hkv*Di, H],
`index_k_proj.weight` [Di, H], `index_q_norm.weight` [Di], `index_k_norm.weight` [Di]; its geometry
under config.json "msa" (ignored by transformers).

Router semantics: Mixtral and Qwen3-MoE with `norm_topk_prob=true` renormalise the top-k softmax
probabilities, which equals megatron's "top-k logits, then softmax"; Qwen3-MoE with
`norm_topk_prob=false` keeps the full-softmax probabilities of the chosen experts
(`moe_router_pre_softmax=true`).

Legend: H = hidden size, Hq = query heads, Hkv = kv heads (GQA groups), D = head dim,
Di = index head dim, F = MLP hidden size, E = experts, V = vocab.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any

from msa_model.config import PRODUCTION_BLOCK_SIZE, PRODUCTION_TOPK, ModelConfig, MSAConfig, moe_layers, msa_layers_of
from msa_model.convert.config_keys import Key, lookup, read_keys, rope_from_hf, rope_to_hf, write_keys
from msa_model.convert.family import Family
from msa_model.convert.hf_io import ConversionError
from msa_model.convert.hf_mapping import Rule, decoder_rules

# config.json key <-> ModelConfig field, read by hf-to-msa and written by msa-to-hf
# (msa_model.convert.config_keys); the rest of the translation is code below
LLAMA_KEYS = (
    Key("num_hidden_layers", "num_layers"),
    Key("hidden_size", "hidden_size"),
    Key("intermediate_size", "ffn_hidden_size"),
    Key("num_attention_heads", "num_attention_heads"),
    Key("num_key_value_heads", "num_query_groups", default=lambda f: f["num_attention_heads"]),
    Key("head_dim", "head_dim", default=lambda f: f["hidden_size"] // f["num_attention_heads"]),
    Key("rms_norm_eps", "norm_eps", float, 1e-6),
    Key("initializer_range", "init_method_std", float, 0.02),
    Key("tie_word_embeddings", "tie_embeddings", bool, False),
    Key("vocab_size", "vocab_size", to_hf=int),
)
QWEN3_MOE_KEYS = LLAMA_KEYS + (
    Key("num_experts", "num_experts", aliases=("num_local_experts",)),
    Key("num_experts_per_tok", "moe_router_topk"),
    Key("moe_intermediate_size", "moe_ffn_hidden_size"),
    # true: the chosen experts' probabilities renormalised, as megatron's top-k-then-softmax
    Key("norm_topk_prob", "moe_router_pre_softmax", operator.not_, False, to_hf=operator.not_),
    Key("router_aux_loss_coef", "moe_aux_loss_coeff", float, 1e-2),
)
MIXTRAL_KEYS = LLAMA_KEYS + (
    Key("num_local_experts", "num_experts", aliases=("num_experts",)),
    Key("num_experts_per_tok", "moe_router_topk"),
    # every MLP is experts: intermediate_size is their width (written over the dense one above)
    Key("intermediate_size", "moe_ffn_hidden_size"),
    Key("router_aux_loss_coef", "moe_aux_loss_coeff", float, 1e-2),
)
# the index branch of an exported model, under config.json "msa" (ignored by transformers)
MSA_KEYS = (
    Key("index_head_dim", "index_head_dim", default=lambda f: f["head_dim"]),
    Key("block_size", "block_size", default=PRODUCTION_BLOCK_SIZE),
    Key("topk", "topk", default=PRODUCTION_TOPK),
    Key("force_sink", "force_sink", bool, False),
    Key("local_blocks", "local_blocks", default=1),
)
INDEX_TENSORS = {  # megatron attribute -> HF attribute (under model.layers.N.self_attn)
    "index_q_proj.weight": "index_q_proj.weight",
    "index_k_proj.weight": "index_k_proj.weight",
    "index_q_layernorm.weight": "index_q_norm.weight",
    "index_k_layernorm.weight": "index_k_norm.weight",
}


@dataclass(frozen=True)
class LlamaFamily(Family):
    keys: tuple[Key, ...] = LLAMA_KEYS
    qkv_bias: bool = False
    qk_norm: bool = False
    moe: bool = False
    moe_module: str = "mlp"  # HF submodule holding the router (`gate`) and `experts`
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # gate, up, down
    # MoE after leading dense layers, as config.json `mlp_only_layers` (with `decoder_sparse_step` 1)
    leading_dense_layers: bool = False
    # config.json `attention_bias` (a bias on q/k/v/o) exists and is written false
    attention_bias_key: bool = False
    # config.json `sliding_window` set means a window (else only with `use_sliding_window`); written null
    sliding_window_key: bool = False

    def model_config(self, hf_config: dict, *, attention: str = "msa", seq_length: int = 4096,
                     name: str | None = None, where: str = "config.json") -> ModelConfig:
        c = hf_config
        fields = read_keys(self.keys, c, where)
        heads, kv_heads = fields["num_attention_heads"], fields["num_query_groups"]
        if heads % kv_heads != 0:
            raise ConversionError(f"{where}: not a GQA model: num_attention_heads ({heads}) is not a multiple of "
                                  f"num_key_value_heads ({kv_heads})")
        act = lookup(c, "hidden_act", "hidden_activation", default="silu")
        if act not in ("silu", "swish"):
            raise ConversionError(f"{where}: hidden_act={act!r} is not supported (SwiGLU with silu only)")
        if float(lookup(c, "partial_rotary_factor", default=1.0)) != 1.0:
            raise ConversionError(f"{where}: partial_rotary_factor != 1 is not supported")
        if c.get("use_sliding_window") or (self.sliding_window_key and c.get("sliding_window")):
            raise ConversionError(f"{where}: sliding-window attention is not supported")
        if c.get("mlp_bias"):
            raise ConversionError(f"{where}: mlp_bias=true is not supported")
        # a family whose q/k/v biases are its own (Qwen2) has no such key
        if not self.qkv_bias and c.get("attention_bias"):
            raise ConversionError(f"{where}: attention_bias=true (a bias on o_proj too) is not supported")
        theta, scaling = rope_from_hf(c, where)
        dtype = str(lookup(c, "dtype", "torch_dtype", default="float32")).replace("torch.", "")

        moe: dict[str, Any] = {"num_experts": 0, "first_dense_layers": fields["num_layers"]}
        if self.moe:
            moe = {"first_dense_layers": 0}
            if self.leading_dense_layers:
                dense_layers = sorted(int(i) for i in c.get("mlp_only_layers") or [])
                step = int(lookup(c, "decoder_sparse_step", default=1))
                if step != 1:
                    raise ConversionError(f"{where}: decoder_sparse_step={step} is not supported (MoE layers must "
                                          "be contiguous after the leading dense ones)")
                if dense_layers != list(range(len(dense_layers))):
                    raise ConversionError(f"{where}: mlp_only_layers={dense_layers} is not supported (only leading "
                                          "dense layers, e.g. [0, 1])")
                moe["first_dense_layers"] = len(dense_layers)

        return ModelConfig(
            name=name or f"{self.name}-converted",
            attention=attention,
            qk_layernorm=self.qk_norm,
            qkv_bias=self.qkv_bias,
            seq_length=seq_length,
            rotary_base=theta,
            rope_scaling=scaling,
            # the largest alignment that needs no padding at TP=1 (so TP=1 logits are exactly HF's)
            make_vocab_size_divisible_by=math.gcd(fields["vocab_size"], 128),
            params_dtype="bf16" if dtype == "bfloat16" else "fp32",
            msa=msa_from_hf(c, fields["head_dim"]),
            **fields,
            **moe,
        )

    def has_msa_geometry(self, hf_config: dict) -> bool:
        # an exported MSA model (config.json "msa")
        return bool(hf_config.get("msa"))

    def hf_config(self, model: ModelConfig, source: dict | None = None) -> dict:
        """The index branch, when present, is described under "msa" (ignored by transformers)."""
        m = model
        cfg = dict(source or {})
        for key in ("rope_theta", "rope_scaling", "torch_dtype", "num_experts", "num_local_experts"):
            cfg.pop(key, None)
        cfg.update(
            architectures=[self.architecture], model_type=self.model_type, **write_keys(self.keys, m),
            hidden_act="silu", rope_parameters=rope_to_hf(m.rotary_base, m.rope_scaling),
            dtype="bfloat16" if m.params_dtype == "bf16" else cfg.get("dtype", "float32"),
        )
        if self.attention_bias_key:
            cfg["attention_bias"] = False
        if self.sliding_window_key:
            cfg["sliding_window"] = None
        if self.leading_dense_layers:
            cfg["mlp_only_layers"] = list(range(m.first_dense_layers))
            cfg["decoder_sparse_step"] = 1
        if m.attention == "msa":
            cfg["msa"] = write_keys(MSA_KEYS, m.msa)
            if m.msa.local_blocks == 1:
                # the default, left out as in exports from before local blocks
                del cfg["msa"]["local_blocks"]
        else:
            cfg.pop("msa", None)
        return cfg

    def check_exportable(self, model: ModelConfig) -> None:
        problems = []
        if model.qkv_bias != self.qkv_bias:
            problems.append(f"qkv_bias={model.qkv_bias} but {self.name} has qkv bias={self.qkv_bias}")
        if model.qk_layernorm != self.qk_norm:
            problems.append(f"qk_layernorm={model.qk_layernorm} but {self.name} has QK norm={self.qk_norm}")
        if self.moe != (model.num_experts > 0):
            problems.append(f"num_experts={model.num_experts} but {self.name} is "
                            f"{'an MoE' if self.moe else 'a dense'} family")
        if self.moe and model.first_dense_layers and not self.leading_dense_layers:
            problems.append(f"first_dense_layers={model.first_dense_layers}: {self.name} has no dense layers")
        if model.moe_shared_expert_size:
            problems.append(f"moe_shared_expert_size={model.moe_shared_expert_size}: {self.name} has no shared expert")
        # a router whose config.json cannot say "keep the full-softmax probabilities" renormalises
        if self.moe and model.moe_router_pre_softmax and all(k.field != "moe_router_pre_softmax" for k in self.keys):
            problems.append(f"{self.name} renormalises top-k probabilities (moe_router_pre_softmax must be false)")
        problems += _options_beyond_llama(model)
        if problems:
            raise ConversionError(f"cannot export as {self.name}: " + "; ".join(problems))

    def rules(self, model: ModelConfig, with_index: bool) -> list[Rule]:
        moe, msa = moe_layers(model), msa_layers_of(model)

        def attention(i: int, attn: str, sa: str) -> list[Rule]:
            out = [Rule(f"{sa}.linear_qkv.weight", tuple(f"{attn}.{p}_proj.weight" for p in "qkv"), "qkv")]
            if model.qkv_bias:
                out.append(Rule(f"{sa}.linear_qkv.bias", tuple(f"{attn}.{p}_proj.bias" for p in "qkv"), "qkv"))
            if model.qk_layernorm:
                out.append(Rule(f"{sa}.q_layernorm.weight", (f"{attn}.q_norm.weight",)))
                out.append(Rule(f"{sa}.k_layernorm.weight", (f"{attn}.k_norm.weight",)))
            out.append(Rule(f"{sa}.linear_proj.weight", (f"{attn}.o_proj.weight",)))
            if with_index and msa[i]:
                out += [Rule(f"{sa}.{mname}", (f"{attn}.{hname}",)) for mname, hname in INDEX_TENSORS.items()
                        if model.qk_layernorm or "layernorm" not in mname]
            return out

        def mlp(i: int, hf: str, mc: str) -> list[Rule]:
            if not moe[i]:
                return [Rule(f"{mc}.mlp.linear_fc1.weight",
                             (f"{hf}.mlp.gate_proj.weight", f"{hf}.mlp.up_proj.weight"), "glu"),
                        Rule(f"{mc}.mlp.linear_fc2.weight", (f"{hf}.mlp.down_proj.weight",))]
            block = f"{hf}.{self.moe_module}"
            gate, up, down = self.expert_names
            out = [Rule(f"{mc}.mlp.router.weight", (f"{block}.gate.weight",))]
            for e in range(model.num_experts):
                ex, mx = f"{block}.experts.{e}", f"{mc}.mlp.experts.local_experts.{e}"
                out.append(Rule(f"{mx}.linear_fc1.weight", (f"{ex}.{gate}.weight", f"{ex}.{up}.weight"), "glu"))
                out.append(Rule(f"{mx}.linear_fc2.weight", (f"{ex}.{down}.weight",)))
            return out

        return decoder_rules(model, attention, mlp)

    def hf_shapes(self, model: ModelConfig, with_index: bool) -> dict[str, tuple[int, ...]]:
        m = model
        h, d, hq, g, v = m.hidden_size, m.head_dim, m.num_attention_heads, m.num_query_groups, m.vocab_size
        di = m.msa.index_head_dim
        shapes: dict[str, tuple[int, ...]] = {}
        for rule in self.rules(model, with_index):
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
                    shape = (h, f) if leaf.startswith(self.expert_names[2]) else (f, h)
                elif ".mlp." in name:
                    f = m.ffn_hidden_size
                    shape = (h, f) if leaf.startswith("down_proj") else (f, h)
                else:  # norms
                    shape = (h,)
                shapes[name] = shape
        return shapes


def msa_from_hf(cfg: dict, head_dim: int) -> MSAConfig:
    """The MSA geometry of an exported model (its config.json "msa" entry), else the production
    block size and top-k with Di = D."""
    return MSAConfig(**read_keys(MSA_KEYS, cfg.get("msa") or {}, 'config.json "msa"', head_dim=head_dim))


def _options_beyond_llama(m) -> list[str]:
    """Options of our model that the Llama-layout families cannot express."""
    return [text for bad, text in (
        (m.norm_zero_centered, "norm_zero_centered=true"),
        (m.activation != "swiglu" or m.glu_linear_offset != 0.0 or m.activation_clamp is not None,
         f"activation={m.activation} (offset {m.glu_linear_offset}, clamp {m.activation_clamp}); only swiglu"),
        (m.rotary_dim is not None and m.rotary_dim != m.head_dim, f"rotary_dim={m.rotary_dim} (partial RoPE)"),
        (m.moe_router_score_function != "softmax" or m.moe_router_expert_bias or m.moe_router_topk_scaling_factor,
         "a sigmoid router, expert bias or routed scaling factor"),
        (bool(m.attention_types) and "full" in m.attention_types, "full-attention layers in an MSA model"),
        (bool(m.mlp_types), "mlp_types (per-layer dense/MoE beyond leading dense layers)"),
    ) if bad]
