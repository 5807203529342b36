"""The Hugging Face model families we convert: every one is an object listed here (`FAMILIES`).

| family    | architecture        | q/k/v bias | QK norm | MLP                                         | router                  |
|-----------|---------------------|------------|---------|---------------------------------------------|-------------------------|
| llama     | LlamaForCausalLM    | no         | no      | mlp.{gate,up,down}_proj                     |                         |
| qwen2     | Qwen2ForCausalLM    | yes        | no      | mlp.{gate,up,down}_proj                     |                         |
| qwen3     | Qwen3ForCausalLM    | no         | yes     | mlp.{gate,up,down}_proj                     |                         |
| qwen3_moe | Qwen3MoeForCausalLM | no         | yes     | mlp.experts.E.{gate,up,down}_proj           | mlp.gate, norm_topk_prob|
| mixtral   | MixtralForCausalLM  | no         | no      | block_sparse_moe.experts.E.{w1,w3,w2}       | block_sparse_moe.gate   |
| mistral   | MistralForCausalLM  | no         | no      | mlp.{gate,up,down}_proj (no sliding window) |                         |

These share the Llama layout (msa_model.convert.llama_families). MiniMax-M3 (`minimax_m3`, MSA kept
in both directions) has a layout of its own: msa_model.convert.minimax_m3. What a family is and
what adding one takes: msa_model.convert.family.
"""

from __future__ import annotations

from msa_model.config import ModelConfig
from msa_model.convert.family import Family
from msa_model.convert.hf_io import ConversionError
from msa_model.convert.llama_families import MIXTRAL_KEYS, QWEN3_MOE_KEYS, LlamaFamily
from msa_model.convert.minimax_m3 import MiniMaxM3

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        LlamaFamily("llama", "LlamaForCausalLM", "llama", attention_bias_key=True),
        LlamaFamily("qwen2", "Qwen2ForCausalLM", "qwen2", qkv_bias=True),
        LlamaFamily("qwen3", "Qwen3ForCausalLM", "qwen3", qk_norm=True, attention_bias_key=True),
        LlamaFamily("qwen3_moe", "Qwen3MoeForCausalLM", "qwen3_moe", QWEN3_MOE_KEYS, qk_norm=True, moe=True,
                    leading_dense_layers=True, attention_bias_key=True),
        LlamaFamily("mixtral", "MixtralForCausalLM", "mixtral", MIXTRAL_KEYS, moe=True, moe_module="block_sparse_moe",
                    expert_names=("w1", "w3", "w2"), sliding_window_key=True),
        LlamaFamily("mistral", "MistralForCausalLM", "mistral", sliding_window_key=True),
        MiniMaxM3(),
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


def model_config_from_hf(hf_config: dict, *, attention: str = "msa", seq_length: int = 4096, name: str | None = None,
                         where: str = "config.json") -> tuple[Family, ModelConfig]:
    """Translate a config.json into the family and the ModelConfig of the equivalent model.

    Raises ConversionError for what our model cannot express (the message names the field).
    """
    fam = detect_family(hf_config, where)
    quant = hf_config.get("quantization_config") or (hf_config.get("text_config") or {}).get("quantization_config")
    if quant:
        raise ConversionError(f"{where}: a quantized checkpoint (quant_method={quant.get('quant_method')!r}); "
                              "convert its dequantized bf16/fp32 weights")
    return fam, fam.model_config(hf_config, attention=attention, seq_length=seq_length, name=name, where=where)
