"""Hugging Face model families we convert, and their config.json <-> ModelConfig translation.

| family    | architecture        | q/k/v bias | QK norm | MLP                                        | router                  |
|-----------|---------------------|------------|---------|--------------------------------------------|-------------------------|
| llama     | LlamaForCausalLM    | no         | no      | mlp.{gate,up,down}_proj                    |                         |
| qwen2     | Qwen2ForCausalLM    | yes        | no      | mlp.{gate,up,down}_proj                    |                         |
| qwen3     | Qwen3ForCausalLM    | no         | yes     | mlp.{gate,up,down}_proj                    |                         |
| qwen3_moe | Qwen3MoeForCausalLM | no         | yes     | mlp.experts.E.{gate,up,down}_proj          | mlp.gate, norm_topk_prob|
| mixtral   | MixtralForCausalLM  | no         | no      | block_sparse_moe.experts.E.{w1,w3,w2}      | block_sparse_moe.gate   |
| mistral   | MistralForCausalLM  | no         | no      | mlp.{gate,up,down}_proj (no sliding window) |                        |

MiniMax-M3 (`minimax_m3`, MSA kept in both directions) has a layout of its own:
msa_model.convert.minimax_m3.

Every family is GQA with SwiGLU MLPs, RMSNorm and rotary embeddings, which is exactly our model's
backbone; what differs is listed in `Family`. The config.json keys that are one ModelConfig field
each are a table per family (`Family.keys`), which hf-to-msa reads and msa-to-hf writes. Router semantics: Mixtral and Qwen3-MoE with
`norm_topk_prob=true` renormalise the top-k softmax probabilities, which equals megatron's
"top-k logits, then softmax"; Qwen3-MoE with `norm_topk_prob=false` keeps the full-softmax
probabilities of the chosen experts (`moe_router_pre_softmax=true`).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any

from msa_model.config import PRODUCTION_BLOCK_SIZE, PRODUCTION_TOPK, ModelConfig, MSAConfig, RopeScalingConfig
from msa_model.convert import minimax_m3 as m3
from msa_model.convert.config_keys import Key, lookup, read_keys, write_keys
from msa_model.convert.hf_io import ConversionError

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


@dataclass(frozen=True)
class Family:
    name: str
    architecture: str
    model_type: str
    # its config.json keys that are one ModelConfig field each, in both directions
    keys: tuple[Key, ...] = LLAMA_KEYS
    qkv_bias: bool = False
    qk_norm: bool = False
    moe: bool = False
    moe_module: str = "mlp"  # HF submodule holding the router (`gate`) and `experts`
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # gate, up, down
    # more architectures / model types read as this family (e.g. a vision-language wrapper)
    aliases: tuple[str, ...] = ()


FAMILIES = {
    f.name: f
    for f in (
        Family("llama", "LlamaForCausalLM", "llama"),
        Family("qwen2", "Qwen2ForCausalLM", "qwen2", qkv_bias=True),
        Family("qwen3", "Qwen3ForCausalLM", "qwen3", qk_norm=True),
        Family("qwen3_moe", "Qwen3MoeForCausalLM", "qwen3_moe", QWEN3_MOE_KEYS, qk_norm=True, moe=True),
        Family("mixtral", "MixtralForCausalLM", "mixtral", MIXTRAL_KEYS, moe=True, moe_module="block_sparse_moe",
               expert_names=("w1", "w3", "w2")),
        Family("mistral", "MistralForCausalLM", "mistral"),
        # its own tensor layout and config translation: msa_model.convert.minimax_m3
        Family("minimax_m3", m3.EXPORT_ARCHITECTURE, m3.EXPORT_MODEL_TYPE, m3.CONFIG_KEYS, qk_norm=True, moe=True,
               aliases=m3.ARCHITECTURES + m3.MODEL_TYPES),
    )
}


def detect_family(hf_config: dict, where: str = "config.json") -> Family:
    """The family of a parsed config.json, from `architectures` (or `model_type`)."""
    archs = hf_config.get("architectures") or []
    for fam in FAMILIES.values():
        if fam.architecture in archs or set(fam.aliases) & set(archs):
            return fam
    model_type = hf_config.get("model_type")
    if not archs:
        for fam in FAMILIES.values():
            if model_type in (fam.model_type, *fam.aliases):
                return fam
    supported = ", ".join(f.architecture for f in FAMILIES.values())
    raise ConversionError(f"{where}: unsupported architecture {archs or model_type!r}; supported: {supported}")


def rope_from_hf(cfg: dict, where: str) -> tuple[float, RopeScalingConfig]:
    """(theta, scaling) from `rope_parameters` (transformers >= 5) or `rope_theta`/`rope_scaling`."""
    params = dict(cfg.get("rope_parameters") or {})
    legacy = cfg.get("rope_scaling") or {}
    theta = float(lookup(params, "rope_theta", default=lookup(cfg, "rope_theta", default=10000.0)))
    kind = lookup(params, "rope_type", "type", default=None) or lookup(legacy, "rope_type", "type", default="default")
    source = params if params.get("factor") is not None or not legacy else legacy
    if kind == "default":
        return theta, RopeScalingConfig()
    if kind == "linear":
        return theta, RopeScalingConfig(type="linear", factor=float(source["factor"]))
    if kind == "llama3":
        return theta, RopeScalingConfig(
            type="llama3", factor=float(source["factor"]),
            low_freq_factor=float(source.get("low_freq_factor", 1.0)),
            high_freq_factor=float(source.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(source.get("original_max_position_embeddings", 8192)))
    raise ConversionError(f"{where}: RoPE scaling type {kind!r} is not supported (supported: default, linear, llama3)")


def rope_to_hf(theta: float, scaling) -> dict:
    """`rope_parameters` of config.json for a rotary base and a RopeScalingConfig."""
    if scaling.type == "none":
        return {"rope_theta": theta, "rope_type": "default"}
    if scaling.type == "linear":
        return {"rope_theta": theta, "rope_type": "linear", "factor": scaling.factor}
    return {"rope_theta": theta, "rope_type": "llama3", "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor, "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings}


def model_config_from_hf(hf_config: dict, *, attention: str = "msa", msa: MSAConfig | None = None,
                         seq_length: int = 4096, name: str | None = None, where: str = "config.json") -> tuple[Family, ModelConfig]:
    """Translate a config.json into the family and the ModelConfig of the equivalent model.

    Raises ConversionError for what our model cannot express (the message names the field).
    """
    fam = detect_family(hf_config, where)
    quant = hf_config.get("quantization_config") or (hf_config.get("text_config") or {}).get("quantization_config")
    if quant:
        raise ConversionError(f"{where}: a quantized checkpoint (quant_method={quant.get('quant_method')!r}); "
                              "convert its dequantized bf16/fp32 weights")
    if fam.name == "minimax_m3":
        return fam, m3.model_config_from_m3(hf_config, attention=attention, seq_length=seq_length, name=name, where=where)
    c = hf_config
    fields = read_keys(fam.keys, c, where)
    heads, kv_heads = fields["num_attention_heads"], fields["num_query_groups"]
    if heads % kv_heads != 0:
        raise ConversionError(f"{where}: not a GQA model: num_attention_heads ({heads}) is not a multiple of "
                              f"num_key_value_heads ({kv_heads})")
    act = lookup(c, "hidden_act", "hidden_activation", default="silu")
    if act not in ("silu", "swish"):
        raise ConversionError(f"{where}: hidden_act={act!r} is not supported (SwiGLU with silu only)")
    if float(lookup(c, "partial_rotary_factor", default=1.0)) != 1.0:
        raise ConversionError(f"{where}: partial_rotary_factor != 1 is not supported")
    if c.get("use_sliding_window") or (fam.name in ("mixtral", "mistral") and c.get("sliding_window")):
        raise ConversionError(f"{where}: sliding-window attention is not supported")
    if c.get("mlp_bias"):
        raise ConversionError(f"{where}: mlp_bias=true is not supported")
    if fam.name != "qwen2" and c.get("attention_bias"):
        raise ConversionError(f"{where}: attention_bias=true (a bias on o_proj too) is not supported")
    theta, scaling = rope_from_hf(c, where)
    dtype = str(lookup(c, "dtype", "torch_dtype", default="float32")).replace("torch.", "")

    moe: dict[str, Any] = {"num_experts": 0, "first_dense_layers": fields["num_layers"]}
    if fam.moe:
        moe = {"first_dense_layers": 0}
        if fam.name == "qwen3_moe":
            dense_layers = sorted(int(i) for i in c.get("mlp_only_layers") or [])
            step = int(lookup(c, "decoder_sparse_step", default=1))
            if step != 1:
                raise ConversionError(f"{where}: decoder_sparse_step={step} is not supported (MoE layers must be "
                                      "contiguous after the leading dense ones)")
            if dense_layers != list(range(len(dense_layers))):
                raise ConversionError(f"{where}: mlp_only_layers={dense_layers} is not supported (only leading "
                                      "dense layers, e.g. [0, 1])")
            moe["first_dense_layers"] = len(dense_layers)

    model = ModelConfig(
        name=name or f"{fam.name}-converted",
        attention=attention,
        qk_layernorm=fam.qk_norm,
        qkv_bias=fam.qkv_bias,
        seq_length=seq_length,
        rotary_base=theta,
        rope_scaling=scaling,
        # the largest alignment that needs no padding at TP=1 (so TP=1 logits are exactly HF's)
        make_vocab_size_divisible_by=math.gcd(fields["vocab_size"], 128),
        params_dtype="bf16" if dtype == "bfloat16" else "fp32",
        msa=msa or msa_from_hf(c, fields["head_dim"]),
        **fields,
        **moe,
    )
    return fam, model


def msa_from_hf(cfg: dict, head_dim: int) -> MSAConfig:
    """The MSA geometry of an exported model (its config.json "msa" entry), else the production
    block size and top-k with Di = D."""
    return MSAConfig(**read_keys(MSA_KEYS, cfg.get("msa") or {}, 'config.json "msa"', head_dim=head_dim))


def hf_config_from_model(model, fam: Family, source: dict | None = None) -> dict:
    """config.json for a ModelConfig exported as `fam`; keys of `source` (the original config.json,
    e.g. token ids) are kept unless they describe the architecture. The index branch, when present,
    is described under "msa" (ignored by transformers)."""
    if fam.name == "minimax_m3":
        return m3.hf_config_from_model(model, source)
    m = model
    cfg = dict(source or {})
    for key in ("rope_theta", "rope_scaling", "torch_dtype", "num_experts", "num_local_experts"):
        cfg.pop(key, None)
    cfg.update(
        architectures=[fam.architecture], model_type=fam.model_type, **write_keys(fam.keys, m), hidden_act="silu",
        rope_parameters=rope_to_hf(m.rotary_base, m.rope_scaling),
        dtype="bfloat16" if m.params_dtype == "bf16" else cfg.get("dtype", "float32"),
    )
    if fam.name in ("llama", "qwen3", "qwen3_moe"):
        cfg["attention_bias"] = False
    if fam.name in ("mistral", "mixtral"):
        cfg["sliding_window"] = None
    if fam.name == "qwen3_moe":
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


def check_exportable(model, fam: Family) -> None:
    """Raise ConversionError when `model` has features `fam` cannot express."""
    if fam.name == "minimax_m3":
        return m3.check_exportable(model)
    problems = []
    if model.qkv_bias != fam.qkv_bias:
        problems.append(f"qkv_bias={model.qkv_bias} but {fam.name} has qkv bias={fam.qkv_bias}")
    if model.qk_layernorm != fam.qk_norm:
        problems.append(f"qk_layernorm={model.qk_layernorm} but {fam.name} has QK norm={fam.qk_norm}")
    if fam.moe != (model.num_experts > 0):
        problems.append(f"num_experts={model.num_experts} but {fam.name} is {'an MoE' if fam.moe else 'a dense'} family")
    if fam.moe and model.first_dense_layers and fam.name != "qwen3_moe":
        problems.append(f"first_dense_layers={model.first_dense_layers}: {fam.name} has no dense layers")
    if model.moe_shared_expert_size:
        problems.append(f"moe_shared_expert_size={model.moe_shared_expert_size}: {fam.name} has no shared expert")
    if fam.name == "mixtral" and model.moe_router_pre_softmax:
        problems.append("mixtral renormalises top-k probabilities (moe_router_pre_softmax must be false)")
    problems += _m3_only_options(model)
    if problems:
        raise ConversionError(f"cannot export as {fam.name}: " + "; ".join(problems))


def _m3_only_options(m) -> list[str]:
    """Options of our model that the Llama-style families cannot express."""
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
