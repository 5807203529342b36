"""Build the MSA-MoE GPTModel from a ModelConfig: TransformerConfig, layer specs, model.

Model code only: process groups and parallel sizes come in from msa_model.training.distributed
through `parallel` (a ParallelConfig); nothing here initialises distributed state.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from msa_model.model.attention import (CoreAttentionPlaceholder, DenseSelfAttention, MSAOptions, MSASelfAttention,
                                       MSASelfAttentionSubmodules)
from msa_model.model.experts import GroupedExperts, LocalDispatchMoELayer
from msa_model.model.mlp import with_fused_glu
from msa_model.config import MSAConfig, moe_layers, msa_layers_of
from msa_model.parallel.grads import DuplicatedLinear

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class TorchRMSNorm(torch.nn.RMSNorm):
    """PyTorch RMSNorm with megatron's norm constructor, usable under sequence parallelism
    (megatron's local wrapper refuses it): with SP its weight is marked `sequence_parallel`, so
    finalize_model_grads sums its gradient over the tensor-parallel ranks that each saw a slice
    of the sequence. The weight (an fp32 parameter, as in the wrapper) is applied in the input's
    dtype, so that bf16 inputs take torch's fused kernel (fp32 inside, one rounding); with an
    fp32 weight torch falls back to its composite of about seven passes, some in fp32 (for the q
    norm over 64 heads, several percent of a 128K step).
    The weight's gradient is then rounded to bf16 once per call before it reaches the fp32
    parameter (as with any bf16 parameter). Zero-centred weights stay in fp32 (1 + w would round
    w away in bf16)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_):
        super().__init__(normalized_shape=hidden_size, eps=eps)
        # megatron's zero-centred gamma: the weight w starts at 0 and the norm scales by 1 + w
        self.zero_centered = config.layernorm_zero_centered_gamma
        if self.zero_centered:
            torch.nn.init.zeros_(self.weight)
        for p in self.parameters():
            p.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.zero_centered:
            return F.rms_norm(x, self.normalized_shape, self.weight.to(x.dtype), self.eps)
        # 1 + w in fp32, as Gemma-style checkpoints define it (in bf16 1 + w would round w away)
        out = F.rms_norm(x.float(), self.normalized_shape, None, self.eps) * (1.0 + self.weight.float())
        return out.to(x.dtype)


def _sp_norm(module):
    return TorchRMSNorm if module is WrappedTorchNorm else module


def padded_vocab_size(vocab_size: int, model_cfg, tp: int = 1) -> int:
    """Round the tokenizer's vocabulary up so the embedding splits evenly and aligns (x TP)."""
    multiple = model_cfg.make_vocab_size_divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


def _quick_gelu(x: torch.Tensor, alpha: float) -> torch.Tensor:
    return x * torch.sigmoid(alpha * x)


def activation_func(model_cfg, on_cpu: bool):
    """The GLU's gate activation: silu (SwiGLU) or x * sigmoid(alpha * x) (quick-GELU GLU). With
    alpha = 1.702 on CUDA it is megatron's own quick_gelu, which its fused GLU kernels recognise;
    on CPU the same function unwrapped, since megatron's is torch.compile'd and its first call
    (per input shape) compiles for tens of seconds there."""
    if model_cfg.activation == "swiglu":
        return F.silu
    if model_cfg.glu_alpha == 1.702 and not on_cpu:
        from megatron.core.fusions.fused_bias_geglu import quick_gelu

        return quick_gelu
    return functools.partial(_quick_gelu, alpha=model_cfg.glu_alpha)


def transformer_config(model_cfg, parallel_cfg, on_cpu: bool) -> TransformerConfig:
    """megatron TransformerConfig for the model and parallel layout (local, non-TE modules)."""
    m, p = model_cfg, parallel_cfg
    dtype = _DTYPES[m.params_dtype]
    moe = m.num_experts > 0
    # "full": megatron checkpoints each layer and reruns it in backward. "selective" is ours
    # (the attention layers checkpoint their core; GroupedExperts never keeps activations)
    full = m.recompute == "full"
    return TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        kv_channels=m.head_dim,
        qk_layernorm=m.qk_layernorm,
        normalization="RMSNorm",
        layernorm_epsilon=m.norm_eps,
        layernorm_zero_centered_gamma=m.norm_zero_centered,
        add_qkv_bias=m.qkv_bias,
        add_bias_linear=False,
        gated_linear_unit=True,
        activation_func=activation_func(m, on_cpu),
        glu_linear_offset=m.glu_linear_offset,
        activation_func_clamp_value=m.activation_clamp,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=m.init_method_std,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        pipeline_dtype=dtype,
        tensor_model_parallel_size=p.tp,
        pipeline_model_parallel_size=p.pp,
        expert_model_parallel_size=p.ep,
        context_parallel_size=p.cp,
        sequence_parallel=p.sequence_parallel,
        num_moe_experts=m.num_experts if moe else None,
        moe_ffn_hidden_size=m.moe_ffn_hidden_size if moe else None,
        moe_router_topk=m.moe_router_topk,
        moe_shared_expert_intermediate_size=(m.moe_shared_expert_size or None) if moe else None,
        moe_router_pre_softmax=m.moe_router_pre_softmax,
        moe_router_score_function=m.moe_router_score_function,
        moe_router_enable_expert_bias=m.moe_router_expert_bias and moe,
        moe_router_bias_update_rate=m.moe_router_bias_update_rate,
        moe_router_topk_scaling_factor=m.moe_router_topk_scaling_factor,
        moe_layer_freq=[int(x) for x in moe_layers(m)],
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=m.moe_aux_loss_coeff if moe else 0.0,
        moe_token_dispatcher_type=m.moe_token_dispatcher,
        moe_router_dtype="fp32",
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        moe_router_fusion=False,
        recompute_granularity="full" if full else None,
        recompute_method="uniform" if full else None,
        recompute_num_layers=1 if full else None,
        # the fused kernels below need CUDA (and some TE/apex); the unfused paths are exact
        use_cpu_initialization=on_cpu,
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        # without MoE layers the schedule would never set the auto-scaler's loss scale for the
        # indexer KL; register it as the attention variant's scale hook instead
        experimental_attention_variant_loss_scale_func=None if moe else _kl_scale_hook(),
    )


def _kl_scale_hook():
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    return MoEAuxLossAutoScaler.set_loss_scale


def msa_options(model_cfg) -> MSAOptions:
    # a plain MSAConfig, also when model_cfg is an OmegaConf node: the layer reads it every forward
    msa = MSAConfig(**{f.name: getattr(model_cfg.msa, f.name) for f in dataclasses.fields(MSAConfig)})
    mixed = bool(model_cfg.attention_types) and model_cfg.attention == "msa"
    return MSAOptions(msa=msa, rotary_base=model_cfg.rotary_base, index_main_rope=model_cfg.rotary_dim is not None,
                      recompute_core=model_cfg.recompute == "selective", dense_keys_metric=not mixed)


def use_grouped_gemm(model_cfg, on_cpu: bool) -> bool:
    """model.moe_grouped_gemm, where None means grouped GEMMs on CUDA and the expert loop on CPU."""
    if model_cfg.num_experts == 0:
        return False
    return (not on_cpu) if model_cfg.moe_grouped_gemm is None else bool(model_cfg.moe_grouped_gemm)


def _with_grouped_experts(layer_spec: ModuleSpec) -> ModuleSpec:
    """Swap megatron's SequentialMLP experts of a MoE layer spec for GroupedExperts (same weights).

    megatron-core 0.19 writes the MoE block as builders (functools.partial of MoELayer with
    MoESubmodules whose `experts` is a partial of SequentialMLP); dense layers are left alone."""
    mlp = layer_spec.submodules.mlp
    moe = mlp.keywords.get("submodules") if isinstance(mlp, functools.partial) else None
    if not isinstance(moe, MoESubmodules):
        return layer_spec
    experts = moe.experts
    if not (isinstance(experts, functools.partial) and experts.func is SequentialMLP):
        raise TypeError(f"expected SequentialMLP experts in the local layer spec, found {experts!r}")
    grouped = functools.partial(GroupedExperts, *experts.args, **experts.keywords)
    # grouped experts take device-side token counts: on one expert rank nothing needs the host
    layer = LocalDispatchMoELayer if mlp.func is MoELayer else mlp.func
    layer_spec.submodules.mlp = functools.partial(
        layer, *mlp.args, **{**mlp.keywords, "submodules": dataclasses.replace(moe, experts=grouped)})
    return layer_spec


def _with_attention(layer_spec: ModuleSpec, msa: bool, options: MSAOptions,
                    context_parallel: bool = False) -> ModuleSpec:
    """A copy of a local GPT layer spec whose self-attention is MSASelfAttention (msa) or
    DenseSelfAttention."""
    layer_spec = copy.deepcopy(layer_spec)
    layer_spec.submodules.input_layernorm = _sp_norm(layer_spec.submodules.input_layernorm)
    layer_spec.submodules.pre_mlp_layernorm = _sp_norm(layer_spec.submodules.pre_mlp_layernorm)
    base = layer_spec.submodules.self_attention.submodules
    qk_norm = _sp_norm(base.q_layernorm)
    # our layers never call core attention; megatron's local one refuses CP when built
    core_attention = CoreAttentionPlaceholder if context_parallel else base.core_attention
    main = dict(linear_qkv=base.linear_qkv, core_attention=core_attention, linear_proj=base.linear_proj,
                q_layernorm=qk_norm, k_layernorm=qk_norm)
    if msa:
        module, submodules = MSASelfAttention, MSASelfAttentionSubmodules(
            **main, index_q_proj=ColumnParallelLinear, index_k_proj=DuplicatedLinear,
            index_q_layernorm=qk_norm, index_k_layernorm=qk_norm)
    else:
        module, submodules = DenseSelfAttention, SelfAttentionSubmodules(**main)
    layer_spec.submodules.self_attention = ModuleSpec(
        module=module, params={"attn_mask_type": AttnMaskType.causal, "options": options}, submodules=submodules)
    return layer_spec


def decoder_block_spec(config: TransformerConfig, model_cfg, vp_stage=None, pp_rank=None, grouped_gemm: bool = False):
    """megatron's local decoder block spec (dense first layers, MoE after) with our attention
    layers (MSA or full, per msa_layers_of), the dense MLPs and shared experts with the fused GLU
    (msa_model.model.mlp), and with `grouped_gemm` the routed experts as GroupedExperts."""
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm",
                                       vp_stage=vp_stage, pp_rank=pp_rank)
    options = msa_options(model_cfg)
    cp = config.context_parallel_size > 1
    # the specs are this pipeline stage's layers, from megatron's offset (which numbers them too)
    offset, msa = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank), msa_layers_of(model_cfg)
    block.layer_specs = [_with_attention(spec, msa[offset + i], options, cp) for i, spec in enumerate(block.layer_specs)]
    if grouped_gemm:
        block.layer_specs = [_with_grouped_experts(spec) for spec in block.layer_specs]
    block.layer_specs = [with_fused_glu(spec) for spec in block.layer_specs]
    block.layer_norm = _sp_norm(block.layer_norm)
    return block


def build_model(model_cfg, parallel_cfg, vocab_size: int, *, on_cpu: bool,
                pre_process: bool = True, post_process: bool = True, vp_stage=None,
                init_weights: bool = True) -> GPTModel:
    """The MSA-MoE GPTModel for this pipeline stage. Needs megatron's parallel state initialised.

    vocab_size is the tokenizer's; model_cfg.vocab_size (a converted checkpoint's), when set,
    replaces it. It is padded here. Forward: GPTModel(tokens [B, S],
    position_ids [B, S], attention_mask=None, labels [B, S]) -> per-token loss [B, S].
    init_weights=False leaves the weights as allocated (megatron's perform_initialization), for
    a model that only counts its parameters on the meta device.
    """
    config = transformer_config(model_cfg, parallel_cfg, on_cpu)
    config.perform_initialization = init_weights
    vocab_size = model_vocab_size(model_cfg, vocab_size)
    scaling = model_cfg.rope_scaling
    model = GPTModel(
        config=config,
        transformer_layer_spec=decoder_block_spec(config, model_cfg, vp_stage=vp_stage,
                                                  grouped_gemm=use_grouped_gemm(model_cfg, on_cpu)),
        vocab_size=padded_vocab_size(vocab_size, model_cfg, parallel_cfg.tp),
        max_sequence_length=model_cfg.seq_length,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=model_cfg.tie_embeddings,
        position_embedding_type="rope",
        rotary_percent=rotary_percent(model_cfg),
        rotary_base=model_cfg.rotary_base,
        seq_len_interpolation_factor=scaling.factor if scaling.type == "linear" else None,
        vp_stage=vp_stage,
    )
    if scaling.type == "llama3" and hasattr(model, "rotary_pos_emb"):
        model.rotary_pos_emb.inv_freq = llama3_inv_freq(model.rotary_pos_emb.inv_freq, scaling)
    return model


def rotary_percent(model_cfg) -> float:
    """megatron's share of rotated head channels for model.rotary_dim (exact: int(D * p) == rotary_dim)."""
    if model_cfg.rotary_dim is None or model_cfg.rotary_dim == model_cfg.head_dim:
        return 1.0
    percent = model_cfg.rotary_dim / model_cfg.head_dim
    # megatron takes int(head_dim * percent) channels; nudge up so float rounding cannot lose one
    while int(model_cfg.head_dim * percent) < model_cfg.rotary_dim:
        percent = math.nextafter(percent, 1.0)
    return percent


def model_vocab_size(model_cfg, tokenizer_vocab_size: int) -> int:
    """Embedding rows before padding: model.vocab_size when set (it must cover the tokenizer)."""
    if model_cfg.vocab_size is None:
        return tokenizer_vocab_size
    if model_cfg.vocab_size < tokenizer_vocab_size:
        raise ValueError(f"model.vocab_size ({model_cfg.vocab_size}) is smaller than the tokenizer's "
                         f"vocabulary ({tokenizer_vocab_size})")
    return model_cfg.vocab_size


def llama3_inv_freq(inv_freq: torch.Tensor, scaling) -> torch.Tensor:
    """Llama 3.x RoPE scaling: long wavelengths slowed by `factor`, short ones kept, a smooth
    blend between the two bands (`low_freq_factor`, `high_freq_factor` of the original context)."""
    context = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    slow = inv_freq / scaling.factor
    # 0 at the long-wavelength edge of the blend band, 1 at the short one
    blend = (context / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - blend) * slow + blend * inv_freq
    long_band = wavelen > context / scaling.low_freq_factor
    short_band = wavelen < context / scaling.high_freq_factor
    return torch.where(long_band, slow, torch.where(short_band, inv_freq, blended))


def count_parameters(model_cfg, vocab_size: int) -> dict[str, int]:
    """Analytic parameter counts of the full (unsharded) model: total, active per token, index branch."""
    m = model_cfg
    h, d, hq, g = m.hidden_size, m.head_dim, m.num_attention_heads, m.num_query_groups
    vocab = padded_vocab_size(model_vocab_size(m, vocab_size), m)
    norm_qk = 2 * d if m.qk_layernorm else 0
    attn = h * (hq + 2 * g) * d + hq * d * h + norm_qk
    di = m.msa.index_head_dim
    index = h * g * di + h * di + (2 * di if m.qk_layernorm else 0)
    n_index = sum(msa_layers_of(m))
    dense_mlp = 3 * h * m.ffn_hidden_size
    expert = 3 * h * m.moe_ffn_hidden_size
    shared = 3 * h * m.moe_shared_expert_size
    n_moe = sum(moe_layers(m))
    n_dense = m.num_layers - n_moe
    common = m.num_layers * (attn + 2 * h) + n_index * index + n_dense * dense_mlp
    embed = vocab * h * (1 if m.tie_embeddings else 2)
    total = embed + h + common + n_moe * (m.num_experts * expert + shared + h * m.num_experts)
    active = embed + h + common + n_moe * (m.moe_router_topk * expert + shared + h * m.num_experts)
    return {"total": total, "active": active, "index_branch": n_index * index, "embedding": embed}
