"""MiniMax-M3 checkpoints <-> our model: the export format that keeps MSA.

M3's text model is our model with these options (msa_model.config.ModelConfig):

| M3 (config.json / transformers `minimax_m3_vl`)    | ModelConfig                                           |
|----------------------------------------------------|-------------------------------------------------------|
| layer_types full_attention / minimax_m3_sparse     | attention_types full / msa                            |
| mlp_layer_types dense / sparse                     | mlp_types dense / moe (or first_dense_layers)         |
| index_head_dim, index_block_size, index_topk_blocks, index_local_blocks | msa.index_head_dim, block_size, topk, local_blocks |
| index_n_heads                                      | must equal num_key_value_heads (one index head per group) |
| sigmoid router + e_score_correction_bias           | moe_router_score_function=sigmoid, moe_router_expert_bias |
| routed_scaling_factor                              | moe_router_topk_scaling_factor                        |
| shared_experts (shared_intermediate_size)          | moe_shared_expert_size                                |
| swiglu_alpha, swiglu_limit, (up + 1)               | activation=quick_geglu, glu_alpha, activation_clamp, glu_linear_offset=1 |
| rope_parameters.partial_rotary_factor              | rotary_dim (index q/k rotate the same channels)       |
| Gemma RMSNorm `x * (1 + w)`                        | norm_zero_centered (w copied as is: exact)            |
| dense_intermediate_size / intermediate_size        | ffn_hidden_size / moe_ffn_hidden_size                 |

Two on-disk layouts are read:
- release (what MiniMax publishes and transformers' `MiniMaxM3SparseForConditionalGeneration`
  writes): `language_model.model.layers.N...`, experts per expert `block_sparse_moe.experts.E.
  {w1,w3,w2}`, `block_sparse_moe.{gate.weight,e_score_correction_bias}`, shared and dense MLPs as
  `{gate,up,down}_proj`, index tensors `self_attn.index_{q,k}_{proj,norm}`; the vision tower,
  projector, patch merger and MTP heads are named and skipped;
- transformers' text model (`MiniMaxM3VLForCausalLM.save_pretrained`): `model.layers.N...` with
  experts stacked `mlp.experts.{gate_up_proj [E, 2F, H], down_proj [E, H, F]}`, fused
  `gate_up_proj` MLPs and `self_attn.indexer.{q,k}_{proj,norm}`.
`msa-to-hf --format minimax_m3` writes the second (it loads with transformers'
AutoModelForCausalLM). Both map through one canonical naming: the text layout with the stacked
expert tensors split per expert (`mlp.experts.E.{gate_up_proj,down_proj}`), so every conversion
is a copy, a concatenation or a row of a stacked tensor, and a round trip is bit-exact.
`MiniMaxM3` is the family (msa_model.convert.family): its `open` reads either layout under the
canonical names (`M3Checkpoint`), its `export_layout` writes the second.

Legend: H = hidden, F = expert MLP width, E = experts, Hkv = kv heads, D = head dim, Di = index head dim.
"""

from __future__ import annotations

import logging
import math
import re
from collections import Counter
from dataclasses import dataclass

import torch

from msa_model.config import PRODUCTION_BLOCK_SIZE, PRODUCTION_TOPK, ModelConfig, MSAConfig, moe_layers, msa_layers_of
from msa_model.convert.config_keys import Key, lookup, read_keys, rope_from_hf, rope_to_hf, text_config, write_keys
from msa_model.convert.family import Family
from msa_model.convert.hf_io import ConversionError
from msa_model.convert.hf_mapping import Rule, decoder_rules

log = logging.getLogger(__name__)

ARCHITECTURES = ("MiniMaxM3VLForCausalLM", "MiniMaxM3SparseForConditionalGeneration")
MODEL_TYPES = ("minimax_m3_vl_text", "minimax_m3_vl")
EXPORT_ARCHITECTURE, EXPORT_MODEL_TYPE = ARCHITECTURES[0], MODEL_TYPES[0]
# parts of a release checkpoint that are not the text model; counted and skipped
SKIPPED_PARTS = ("vision_tower", "multi_modal_projector", "patch_merge_mlp", "mtp")
_ATTENTION = {"full_attention": "full", "minimax_m3_sparse": "msa"}
_MLP = {"dense": "dense", "sparse": "moe"}

# the text config's keys <-> ModelConfig fields (msa_model.convert.config_keys); the rest of the
# translation (layer types, RoPE, the router, what M3 fixes) is code below. A key a config.json
# leaves out reads as transformers' MiniMaxM3VLTextConfig default: what the reference model runs
# with (a default of our own converted silently into another model, e.g. routed scaling 1 for 2)
CONFIG_KEYS = (
    Key("num_hidden_layers", "num_layers"),
    Key("hidden_size", "hidden_size"),
    Key("num_attention_heads", "num_attention_heads"),
    Key("num_key_value_heads", "num_query_groups"),
    Key("head_dim", "head_dim", default=128),
    Key("dense_intermediate_size", "ffn_hidden_size", default=12288),
    Key("rms_norm_eps", "norm_eps", float, 1e-6),
    Key("swiglu_alpha", "glu_alpha", float, 1.702),
    Key("swiglu_limit", "activation_clamp", float, 7.0),
    Key("initializer_range", "init_method_std", float, 0.02),
    Key("vocab_size", "vocab_size", to_hf=int),
)
# read where the model has experts
MOE_KEYS = (
    Key("num_experts_per_tok", "moe_router_topk", default=4),
    Key("intermediate_size", "moe_ffn_hidden_size", default=3072),
    Key("shared_intermediate_size", "moe_shared_expert_size", default=3072),
    Key("routed_scaling_factor", "moe_router_topk_scaling_factor", float, 2.0, to_hf=lambda v: v or 1.0),
    Key("router_aux_loss_coef", "moe_aux_loss_coeff", float, 1e-3),
)
# config.json keys <-> MSAConfig fields
MSA_KEYS = (
    Key("index_head_dim", "index_head_dim", default=128),
    Key("index_block_size", "block_size", default=PRODUCTION_BLOCK_SIZE),
    Key("index_topk_blocks", "topk", default=PRODUCTION_TOPK),
    Key("index_local_blocks", "local_blocks", default=1),
)

# transformers' MiniMaxM3VLTextConfig.default_theta: the RoPE base of a config.json without one
DEFAULT_THETA = 5_000_000.0
# MiniMax's release config.json holds the index geometry in `sparse_attention_config` under these
# names (and the layer types as 0/1 lists); transformers reads them as the flat keys
_LEGACY_INDEX_KEYS = {"index_n_heads": "sparse_num_index_heads", "index_head_dim": "sparse_index_dim",
                      "index_block_size": "sparse_block_size", "index_topk_blocks": "sparse_topk_blocks",
                      "index_local_blocks": "sparse_local_block"}

# release name (after the language_model prefix) -> canonical name, or (canonical, part) for the
# two halves of a fused [gate; up] weight
_RELEASE_RULES = [
    (re.compile(r"(.*)\.block_sparse_moe\.experts\.(\d+)\.w1\.weight$"), r"\1.mlp.experts.\2.gate_up_proj", 0),
    (re.compile(r"(.*)\.block_sparse_moe\.experts\.(\d+)\.w3\.weight$"), r"\1.mlp.experts.\2.gate_up_proj", 1),
    (re.compile(r"(.*)\.block_sparse_moe\.experts\.(\d+)\.w2\.weight$"), r"\1.mlp.experts.\2.down_proj", None),
    (re.compile(r"(.*)\.block_sparse_moe\.gate\.weight$"), r"\1.mlp.gate.weight", None),
    (re.compile(r"(.*)\.block_sparse_moe\.e_score_correction_bias$"), r"\1.mlp.gate.e_score_correction_bias", None),
    (re.compile(r"(.*)\.block_sparse_moe\.shared_experts\.gate_proj\.weight$"),
     r"\1.mlp.shared_experts.gate_up_proj.weight", 0),
    (re.compile(r"(.*)\.block_sparse_moe\.shared_experts\.up_proj\.weight$"),
     r"\1.mlp.shared_experts.gate_up_proj.weight", 1),
    (re.compile(r"(.*)\.block_sparse_moe\.shared_experts\.down_proj\.weight$"),
     r"\1.mlp.shared_experts.down_proj.weight", None),
    (re.compile(r"(.*)\.mlp\.gate_proj\.weight$"), r"\1.mlp.gate_up_proj.weight", 0),
    (re.compile(r"(.*)\.mlp\.up_proj\.weight$"), r"\1.mlp.gate_up_proj.weight", 1),
    (re.compile(r"(.*)\.self_attn\.index_(q|k)_(proj|norm)\.weight$"), r"\1.self_attn.indexer.\2_\3.weight", None),
]
_STACKED = re.compile(r"(.*)\.mlp\.experts\.(gate_up_proj|down_proj)$")


class M3Checkpoint:
    """A checkpoint (HFCheckpoint or TensorDict) of either M3 layout, seen under canonical names.

    Same interface as HFCheckpoint (names, in, shape, dtype, get). `skipped` counts the tensors
    of the parts that are not the text model, by part.
    """

    def __init__(self, ckpt):
        self.ckpt, self.root = ckpt, ckpt.root
        # canonical name -> ("copy", name) | ("cat", [gate name, up name]) | ("row", stacked name, e)
        self._map: dict[str, tuple] = {}
        self.skipped: Counter = Counter()
        for name in ckpt.names:
            self._add(name)

    def _add(self, name: str) -> None:
        part = next((p for p in SKIPPED_PARTS if re.search(rf"(^|\.){p}\.", name)), None)
        if part is not None:
            self.skipped[part] += 1
            return
        if name.startswith("language_model."):
            inner = name[len("language_model."):]
            for pattern, target, part in _RELEASE_RULES:
                if pattern.match(inner):
                    canonical = pattern.sub(target, inner)
                    if part is None:
                        self._map[canonical] = ("copy", name)
                    else:
                        entry = self._map.setdefault(canonical, ("cat", [None, None]))
                        entry[1][part] = name
                    return
            self._map[inner] = ("copy", name)
            return
        stacked = _STACKED.match(name)
        if stacked:
            for e in range(self.ckpt.shape(name)[0]):
                self._map[f"{stacked.group(1)}.mlp.experts.{e}.{stacked.group(2)}"] = ("row", name, e)
            return
        self._map[name] = ("copy", name)

    @property
    def names(self) -> list[str]:
        return sorted(self._map)

    def __contains__(self, name: str) -> bool:
        return name in self._map

    def _entry(self, name: str) -> tuple:
        if name not in self._map:
            raise ConversionError(f"{self.root}: tensor {name!r} not found in the checkpoint")
        entry = self._map[name]
        if entry[0] == "cat" and None in entry[1]:
            have = next(n for n in entry[1] if n is not None)
            raise ConversionError(f"{self.root}: tensor {have!r} has no {'up' if entry[1][1] is None else 'gate'} "
                                  "half to fuse with (w1/w3 or gate_proj/up_proj come in pairs)")
        return entry

    def shape(self, name: str) -> tuple[int, ...]:
        entry = self._entry(name)
        if entry[0] == "copy":
            return self.ckpt.shape(entry[1])
        if entry[0] == "row":
            return tuple(self.ckpt.shape(entry[1])[1:])
        gate, up = (self.ckpt.shape(n) for n in entry[1])
        if gate[1:] != up[1:]:
            raise ConversionError(f"{self.root}: {entry[1][0]!r} {list(gate)} and {entry[1][1]!r} {list(up)} "
                                  "differ in their input size")
        return (gate[0] + up[0], *gate[1:])

    def dtype(self, name: str) -> str:
        entry = self._entry(name)
        return self.ckpt.dtype(entry[1] if entry[0] != "cat" else entry[1][0])

    def get(self, name: str) -> torch.Tensor:
        entry = self._entry(name)
        if entry[0] == "copy":
            return self.ckpt.get(entry[1])
        if entry[0] == "row":
            return self.ckpt.get_row(entry[1], entry[2]).contiguous()
        return torch.cat([self.ckpt.get(n) for n in entry[1]], dim=0)


def _rotary_dim(c: dict, head_dim: int, where: str) -> int:
    """Channels of each head that RoPE rotates: head_dim * partial_rotary_factor, the rule
    transformers applies. A `rotary_dim` that says otherwise is refused when no factor is given
    (transformers would rotate every channel, serving engines rotary_dim of them)."""
    params = c.get("rope_parameters") or {}
    factor = params.get("partial_rotary_factor", c.get("partial_rotary_factor"))
    legacy = c.get("rotary_dim")
    if factor is None:
        if legacy is not None and int(legacy) != head_dim:
            raise ConversionError(f"{where}: rotary_dim={legacy} but no partial_rotary_factor: transformers rotates all "
                                  f"{head_dim} channels; set rope_parameters.partial_rotary_factor={legacy}/{head_dim} "
                                  f"(or rotary_dim={head_dim}) so both readings agree")
        return head_dim
    dim = int(head_dim * float(factor))
    if legacy is not None and int(legacy) != dim:
        log.warning("%s: rotary_dim=%s disagrees with partial_rotary_factor=%s (%d of %d channels); following "
                    "partial_rotary_factor, as transformers does", where, legacy, factor, dim, head_dim)
    if dim <= 0 or dim % 2:
        raise ConversionError(f"{where}: partial_rotary_factor={factor} gives {dim} rotated channels of {head_dim}; "
                              "it must be a positive even number")
    return dim


def _flat_keys(c: dict) -> dict:
    """The text config with the release config.json's older keys read as transformers reads them
    (MiniMaxM3VLTextConfig.__post_init__): the index geometry of `sparse_attention_config` over the
    flat `index_*` keys, its `sparse_attention_freq` and `moe_layer_freq` (one 0/1 per layer) as
    `layer_types` / `mlp_layer_types` where those are not given. Without this a release config
    read as all full-attention layers with MoE MLPs and the default geometry."""
    sparse = c.get("sparse_attention_config") or {}
    flat = {**c, **{key: sparse[old] for key, old in _LEGACY_INDEX_KEYS.items() if old in sparse}}
    if flat.get("layer_types") is None and "sparse_attention_freq" in sparse:
        flat["layer_types"] = ["minimax_m3_sparse" if f else "full_attention" for f in sparse["sparse_attention_freq"]]
    if flat.get("mlp_layer_types") is None and c.get("moe_layer_freq") is not None:
        flat["mlp_layer_types"] = ["sparse" if f else "dense" for f in c["moe_layer_freq"]]
    return flat


def _types(c: dict, key: str, table: dict, layers: int, default: str, where: str) -> list[str]:
    values = c.get(key) or [default] * layers
    if len(values) != layers:
        raise ConversionError(f"{where}: {key} lists {len(values)} layers, num_hidden_layers is {layers}")
    unknown = sorted(set(values) - set(table))
    if unknown:
        raise ConversionError(f"{where}: {key} has unsupported value(s) {unknown} (supported: {sorted(table)})")
    return [table[v] for v in values]


@dataclass(frozen=True)
class MiniMaxM3(Family):
    name: str = "minimax_m3"
    architecture: str = EXPORT_ARCHITECTURE
    model_type: str = EXPORT_MODEL_TYPE
    keys: tuple[Key, ...] = CONFIG_KEYS
    aliases: tuple[str, ...] = ARCHITECTURES + MODEL_TYPES
    runs_msa: bool = True

    def model_config(self, hf_config: dict, *, attention: str = "msa", seq_length: int = 4096, name: str | None = None,
                     where: str = "config.json") -> ModelConfig:
        """The text model's (a vision-language config's text_config)."""
        c = text_config(hf_config)
        if c is not hf_config:
            where = f"{where} (text_config)"
        c = _flat_keys(c)
        fields = read_keys(CONFIG_KEYS, c, where)
        layers, heads, kv_heads = fields["num_layers"], fields["num_attention_heads"], fields["num_query_groups"]
        head_dim = fields["head_dim"]
        if heads % kv_heads:
            raise ConversionError(f"{where}: num_attention_heads ({heads}) is not a multiple of num_key_value_heads "
                                  f"({kv_heads})")
        attn_types = _types(c, "layer_types", _ATTENTION, layers, "full_attention", where)
        mlp_types = _types(c, "mlp_layer_types", _MLP, layers, "sparse", where)
        has_msa = "msa" in attn_types and attention == "msa"
        index_heads = int(lookup(c, "index_n_heads", default=4))
        if has_msa and index_heads != kv_heads:
            raise ConversionError(f"{where}: index_n_heads ({index_heads}) != num_key_value_heads ({kv_heads}); MSA "
                                  "has one index head per GQA group")
        msa = MSAConfig(**read_keys(MSA_KEYS, c, where, head_dim=head_dim))
        if has_msa and not 1 <= msa.local_blocks <= msa.topk:
            raise ConversionError(f"{where}: index_local_blocks ({msa.local_blocks}) must be in [1, index_topk_blocks="
                                  f"{msa.topk}] (with more forced blocks than slots the kept ones are arbitrary)")
        rotary_dim = _rotary_dim(c, head_dim, where)
        if has_msa and rotary_dim > msa.index_head_dim:
            raise ConversionError(f"{where}: {rotary_dim} rotated channels do not fit "
                                  f"index_head_dim={msa.index_head_dim}")
        theta, scaling = rope_from_hf(c, where, default_theta=DEFAULT_THETA)
        experts = int(lookup(c, "num_local_experts", "num_experts", default=128)) if "moe" in mlp_types else 0
        moe_kw = {}
        if experts:
            moe_kw = dict(num_experts=experts, **read_keys(MOE_KEYS, c, where), moe_router_score_function="sigmoid",
                          moe_router_expert_bias=True)
            if moe_kw["moe_router_topk"] < 2:
                raise ConversionError(f"{where}: num_experts_per_tok={moe_kw['moe_router_topk']}: M3 renormalises the "
                                      "chosen experts' weights to sum to 1, which for one expert our sigmoid router "
                                      "(megatron's) does not")
        leading = next((i for i, t in enumerate(mlp_types) if t == "moe"), layers)
        dtype = str(lookup(c, "dtype", "torch_dtype",
                           default=lookup(hf_config, "dtype", "torch_dtype", default="float32")))
        return ModelConfig(
            name=name or "minimax_m3-converted",
            attention="msa" if has_msa else "dense",
            attention_types=attn_types if has_msa and set(attn_types) != {"msa"} else [],
            **fields, qk_layernorm=True, norm_zero_centered=True, seq_length=seq_length,
            rotary_base=theta, rotary_dim=rotary_dim, rope_scaling=scaling,
            activation="quick_geglu", glu_linear_offset=1.0,
            first_dense_layers=leading if all(t == "moe" for t in mlp_types[leading:]) else 0,
            mlp_types=[] if all(t == "moe" for t in mlp_types[leading:]) or not experts else mlp_types,
            tie_embeddings=bool(lookup(c, "tie_word_embeddings", default=hf_config.get("tie_word_embeddings", False))),
            make_vocab_size_divisible_by=math.gcd(fields["vocab_size"], 128),
            params_dtype="bf16" if dtype.replace("torch.", "") == "bfloat16" else "fp32",
            msa=msa, **moe_kw,
        )

    def has_msa_geometry(self, hf_config: dict) -> bool:
        # index_block_size and index_topk_blocks (M3's defaults where absent)
        return True

    def hf_config(self, model: ModelConfig, source: dict | None = None) -> dict:
        """The exported text model's; kept keys come from the source's text config."""
        m = model
        dropped = ("rope_theta", "rope_scaling", "torch_dtype", "sparse_attention_config", "moe_layer_freq")
        cfg = {k: v for k, v in text_config(source or {}).items() if k not in dropped}
        rotary = m.rotary_dim or m.head_dim
        rope = rope_to_hf(m.rotary_base, m.rope_scaling)
        if rotary != m.head_dim:
            rope["partial_rotary_factor"] = rotary / m.head_dim
        msa, moe = msa_layers_of(m), moe_layers(m)
        cfg.update(
            architectures=[self.architecture], model_type=self.model_type, **write_keys(CONFIG_KEYS, m),
            hidden_act="silu", rope_parameters=rope, rotary_dim=rotary, tie_word_embeddings=m.tie_embeddings,
            num_local_experts=max(1, m.num_experts), **write_keys(MOE_KEYS, m),
            layer_types=["minimax_m3_sparse" if x else "full_attention" for x in msa],
            mlp_layer_types=["sparse" if x else "dense" for x in moe],
            index_n_heads=m.num_query_groups, **write_keys(MSA_KEYS, m.msa),
            dtype="bfloat16" if m.params_dtype == "bf16" else cfg.get("dtype", "float32"),
        )
        return cfg

    def check_exportable(self, model: ModelConfig) -> None:
        """Every option that M3 cannot express exactly."""
        m = model
        problems = [text for bad, text in (
            (not m.qk_layernorm, "qk_layernorm=false (M3 always has QK norms)"),
            (not m.norm_zero_centered, "norm_zero_centered=false (M3's norms scale by 1 + w; w - 1 is not exact)"),
            (m.qkv_bias, "qkv_bias=true"),
            (m.activation != "quick_geglu", f"activation={m.activation} (M3 uses quick_geglu)"),
            (m.glu_linear_offset != 1.0, f"glu_linear_offset={m.glu_linear_offset} (M3 multiplies by up + 1)"),
            (m.activation_clamp is None, "activation_clamp unset (M3 always clamps at swiglu_limit)"),
            (m.num_experts > 0 and m.moe_router_score_function != "sigmoid",
             f"moe_router_score_function={m.moe_router_score_function} (M3 routes by sigmoid scores)"),
            (m.num_experts > 0 and m.moe_router_topk < 2, "moe_router_topk=1 (M3 renormalises one weight to 1)"),
            (m.num_experts > 0 and not m.moe_shared_expert_size, "moe_shared_expert_size=0 (M3 has a shared expert)"),
            (m.attention == "msa" and m.msa.force_sink, "msa.force_sink=true (M3 forces no sink block)"),
            (m.attention == "msa" and (m.rotary_dim or m.head_dim) > m.msa.index_head_dim,
             "the rotated channels do not fit msa.index_head_dim"),
            (m.attention == "msa" and m.rotary_dim is None and m.msa.index_head_dim != m.head_dim,
             "index_head_dim != head_dim without rotary_dim (our index branch then has its own RoPE table; M3 "
             "rotates the index q/k with the main one)"),
        ) if bad]
        if problems:
            raise ConversionError("cannot export as minimax_m3: " + "; ".join(problems))

    def rules(self, model: ModelConfig, with_index: bool) -> list[Rule]:
        """In the canonical naming (see the module's docstring)."""
        msa, moe = msa_layers_of(model), moe_layers(model)

        def attention(i: int, attn: str, sa: str) -> list[Rule]:
            out = [Rule(f"{sa}.linear_qkv.weight", tuple(f"{attn}.{p}_proj.weight" for p in "qkv"), "qkv"),
                   Rule(f"{sa}.q_layernorm.weight", (f"{attn}.q_norm.weight",)),
                   Rule(f"{sa}.k_layernorm.weight", (f"{attn}.k_norm.weight",)),
                   Rule(f"{sa}.linear_proj.weight", (f"{attn}.o_proj.weight",))]
            if with_index and msa[i]:
                out += [Rule(f"{sa}.index_{p}_proj.weight", (f"{attn}.indexer.{p}_proj.weight",)) for p in "qk"]
                out += [Rule(f"{sa}.index_{p}_layernorm.weight", (f"{attn}.indexer.{p}_norm.weight",)) for p in "qk"]
            return out

        def mlp(i: int, hf: str, mc: str) -> list[Rule]:
            if not moe[i]:
                return [Rule(f"{mc}.mlp.linear_fc{n}.weight", (f"{hf}.mlp.{p}.weight",))
                        for n, p in ((1, "gate_up_proj"), (2, "down_proj"))]
            out = [Rule(f"{mc}.mlp.router.weight", (f"{hf}.mlp.gate.weight",))]
            if model.moe_router_expert_bias:
                out.append(Rule(f"{mc}.mlp.router.expert_bias", (f"{hf}.mlp.gate.e_score_correction_bias",)))
            for e in range(model.num_experts):
                ex, mx = f"{hf}.mlp.experts.{e}", f"{mc}.mlp.experts.local_experts.{e}"
                out += [Rule(f"{mx}.linear_fc1.weight", (f"{ex}.gate_up_proj",)),
                        Rule(f"{mx}.linear_fc2.weight", (f"{ex}.down_proj",))]
            if model.moe_shared_expert_size:
                out += [Rule(f"{mc}.mlp.shared_experts.linear_fc{n}.weight", (f"{hf}.mlp.shared_experts.{p}.weight",))
                        for n, p in ((1, "gate_up_proj"), (2, "down_proj"))]
            return out

        return decoder_rules(model, attention, mlp)

    def hf_shapes(self, model: ModelConfig, with_index: bool) -> dict[str, tuple[int, ...]]:
        m = model
        h, d, hq, g, di = m.hidden_size, m.head_dim, m.num_attention_heads, m.num_query_groups, m.msa.index_head_dim
        by_leaf = {"q_proj.weight": (hq * d, h), "k_proj.weight": (g * d, h), "v_proj.weight": (g * d, h),
                   "o_proj.weight": (h, hq * d), "q_norm.weight": (d,), "k_norm.weight": (d,),
                   "gate.weight": (m.num_experts, h), "gate.e_score_correction_bias": (m.num_experts,)}
        out = {}
        for rule in self.rules(model, with_index):
            for name in rule.hf:
                leaf = ".".join(name.split(".")[-2:])
                if name in ("model.embed_tokens.weight", "lm_head.weight"):
                    shape = (m.vocab_size, h)
                elif ".indexer." in name:
                    shape = {"q_proj.weight": (g * di, h), "k_proj.weight": (di, h)}.get(leaf, (di,))
                elif ".experts." in name:
                    f = m.moe_ffn_hidden_size
                    shape = (2 * f, h) if name.endswith("gate_up_proj") else (h, f)
                elif ".mlp." in name and leaf not in by_leaf:
                    f = m.moe_shared_expert_size if ".shared_experts." in name else m.ffn_hidden_size
                    shape = (2 * f, h) if leaf == "gate_up_proj.weight" else (h, f)
                else:
                    shape = by_leaf.get(leaf, (h,))
                out[name] = shape
        return out

    def open(self, ckpt) -> tuple[M3Checkpoint, dict[str, int]]:
        view = M3Checkpoint(ckpt)
        return view, dict(view.skipped)

    def export_layout(self, tensors: dict[str, torch.Tensor], model: ModelConfig) -> dict[str, torch.Tensor]:
        """Canonical tensors -> transformers' text layout: per-expert tensors stacked into
        `mlp.experts.{gate_up_proj,down_proj}`, a zero `e_score_correction_bias` where the model has
        no expert bias (the same routing)."""
        out = {}
        moe = moe_layers(model)
        for name, t in tensors.items():
            if ".mlp.experts." not in name:
                out[name] = t
        for i, is_moe in enumerate(moe):
            if not is_moe:
                continue
            mlp = f"model.layers.{i}.mlp"
            for part in ("gate_up_proj", "down_proj"):
                out[f"{mlp}.experts.{part}"] = torch.stack([tensors[f"{mlp}.experts.{e}.{part}"]
                                                            for e in range(model.num_experts)])
            bias = f"{mlp}.gate.e_score_correction_bias"
            if bias not in out:
                out[bias] = torch.zeros(model.num_experts, dtype=tensors[f"{mlp}.gate.weight"].dtype)
        return out
