"""MiniMax Sparse Attention as a megatron-core self-attention module.

`MSASelfAttention` is a `SelfAttention` (same linear_qkv, q/k norms, RoPE and linear_proj, so
its main-branch weights are a plain GQA layer's) plus the index branch of MSA_SPEC.md:

    x = normed hidden state, detached       (no gradient from the index branch to the backbone)
    iq = index_q_layernorm(index_q_proj(x)) one index query per GQA group   [S, B, G, Di]
    ik = index_k_layernorm(index_k_proj(x)) one index key shared by groups  [S, B, Di]
    both get the same RoPE as the main q/k

and computes attention + indexer KL with `msa_model.ops.msa_attention`. The KL joins the loss
through megatron's MoE aux-loss auto-scaler (the pipeline schedule sets its scale), weighted by
`kl_coeff`, and is recorded for logging in megatron's MoE metrics tracker as "msa_kl_loss".

Phase: `sparse=False` (indexer warmup) runs dense causal attention with a dense KL; `sparse=True`
selects the top-k key blocks per (query, group). The trainer flips it via `set_msa_phase`.

With `attention="dense"` the layer is the full-attention GQA baseline: no index branch at all.

Parallelism. Tensor parallel: whole GQA groups per rank (query heads, kv heads and index queries
split alike; TP must divide Hkv), the shared index key duplicated. Each rank's KL is the mean
over its own groups, so the model's KL is the mean of the ranks' values: the index-query
gradients are scaled by 1/TP, and the duplicated index-key weights average their gradients over
TP, which together give exactly the gradients of one process. Context parallel: see
msa_model.context_parallel (the KL attached per rank is divided by CP, because megatron's loss
scale for auxiliary losses is multiplied by CP).

Legend: S = tokens (sequence), B = batch, Hq = query heads, G = GQA groups (kv heads),
D = head dim, Di = index head dim, K = top-k blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

from msa_model.context_parallel import gather_sequence, local_query_chunks
from msa_model.ops import msa_attention

KL_METRIC = "msa_kl_loss"
KEYS_METRIC = "msa_keys_per_query"


@dataclass
class MSAOptions:
    """What the layer needs beyond megatron's TransformerConfig (from ModelConfig)."""

    attention: str = "msa"  # msa | dense
    block_size: int = 128
    topk: int = 16
    index_head_dim: int = 128
    kl_coeff: float = 1.0
    force_sink: bool = False
    backend: str = "auto"
    rotary_base: int = 10000
    local_blocks: int = 1  # blocks ending with the query's own that are always selected
    # per layer (index layer_number - 1): "msa" or "dense"; (): every layer as `attention`
    layer_attention: tuple = ()
    # the index q/k rotate their first channels with the main RoPE table (model.rotary_dim set,
    # as in MiniMax-M3) instead of a table of their own when Di != D
    index_main_rope: bool = False


@dataclass
class MSASelfAttentionSubmodules(SelfAttentionSubmodules):
    index_q_proj: Any = None  # column-parallel: groups are split across TP like the kv heads
    index_k_proj: Any = None  # duplicated on every TP rank (one head shared by all groups)
    index_q_layernorm: Any = None
    index_k_layernorm: Any = None


class DuplicatedLinear(torch.nn.Module):
    """A bias-free linear layer whose weight is replicated on every tensor-parallel rank.

    Megatron-style interface: forward returns (output, None). Under sequence parallelism the
    input arrives split along S and is gathered first. Gradients are averaged over the TP group
    by megatron's finalize_model_grads (`average_gradients_across_tp_domain`).
    """

    def __init__(self, input_size: int, output_size: int, *, config, init_method, tp_group=None):
        super().__init__()
        self.config = config
        self.tp_group = tp_group
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype, device=device))
        if config.perform_initialization:
            # the CPU generator draws the same numbers on every TP rank, keeping replicas equal
            with torch.no_grad():
                master = torch.empty(output_size, input_size, dtype=torch.float32)
                init_method(master)
                self.weight.copy_(master)
        self.weight.average_gradients_across_tp_domain = True

    def forward(self, x_SBH: torch.Tensor):
        if self.config.sequence_parallel and self.tp_group is not None and self.tp_group.size() > 1:
            x_SBH = gather_from_sequence_parallel_region(x_SBH, group=self.tp_group)
        return F.linear(x_SBH, self.weight), None


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by `factor`."""

    @staticmethod
    def forward(ctx, x, factor: float):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


class CoreAttentionPlaceholder(IdentityOp):
    """Stands in for megatron's core attention (never called: MSASelfAttention attends itself),
    whose local implementation refuses context parallelism at construction."""


class MSASelfAttention(SelfAttention):
    """Self-attention with MSA (or plain dense GQA). Input/output [S, B, hidden] like SelfAttention."""

    def __init__(self, config, submodules: MSASelfAttentionSubmodules, layer_number: int,
                 attn_mask_type=None, cp_comm_type: Optional[str] = None, pg_collection=None,
                 pp_layer_offset: Optional[int] = None, name: Optional[str] = None,
                 options: Optional[MSAOptions] = None):
        super().__init__(config=config, submodules=submodules, layer_number=layer_number,
                         attn_mask_type=attn_mask_type, cp_comm_type=cp_comm_type,
                         pg_collection=pg_collection, pp_layer_offset=pp_layer_offset, name=name)
        self.options = options or MSAOptions()
        if self.options.layer_attention:
            # layer_number is megatron's global 1-based layer index (pipeline offset included)
            self.options = replace(self.options, attention=self.options.layer_attention[layer_number - 1])
        self.sparse = True
        if self.options.attention == "dense":
            return

        di = self.options.index_head_dim
        self.index_q_proj = submodules.index_q_proj(
            config.hidden_size, config.num_query_groups * di, config=config,
            init_method=config.init_method, gather_output=False, bias=False, skip_bias_add=False,
            is_expert=False, tp_comm_buffer_name="index_q", tp_group=self.pg_collection.tp,
        )
        self.index_k_proj = submodules.index_k_proj(
            config.hidden_size, di, config=config, init_method=config.init_method,
            tp_group=self.pg_collection.tp,
        )
        self.index_q_layernorm = self.index_k_layernorm = None
        if config.qk_layernorm:
            self.index_q_layernorm = submodules.index_q_layernorm(hidden_size=di, config=config, eps=config.layernorm_epsilon)
            self.index_k_layernorm = submodules.index_k_layernorm(hidden_size=di, config=config, eps=config.layernorm_epsilon)
            for p in self.index_k_layernorm.parameters():
                p.average_gradients_across_tp_domain = True
        # the model's rotary table has the main head dim; a different Di needs its own table
        self.index_rotary = None
        if di != self.hidden_size_per_attention_head and not self.options.index_main_rope:
            self.index_rotary = RotaryEmbedding(kv_channels=di, rotary_percent=1.0, rotary_base=self.options.rotary_base,
                                                use_cpu_initialization=config.use_cpu_initialization)

    def _rope(self, x, freqs):
        if freqs is None:
            return x
        return apply_rotary_pos_emb(x, freqs, config=self.config, cp_group=self.pg_collection.cp)

    def _index_branch(self, hidden_SBH: torch.Tensor, index_freqs):
        """iq [S, B, G_local, Di], ik [S, B, Di] from the detached normed hidden state."""
        x = hidden_SBH.detach()
        di = self.options.index_head_dim
        iq_SBGI, _ = self.index_q_proj(x)
        iq_SBGI = iq_SBGI.view(iq_SBGI.shape[0], iq_SBGI.shape[1], -1, di)
        ik_SB1I, _ = self.index_k_proj(x)
        ik_SB1I = ik_SB1I.unsqueeze(2)
        if self.index_q_layernorm is not None:
            iq_SBGI = self.index_q_layernorm(iq_SBGI)
            ik_SB1I = self.index_k_layernorm(ik_SB1I)
        iq_SBGI = self._rope(iq_SBGI, index_freqs)
        ik_SB1I = self._rope(ik_SB1I, index_freqs)
        tp = self.pg_collection.tp.size()
        if tp > 1:
            # the KL is the mean of the TP ranks' per-group means: this rank's index queries, and
            # through them index_q_proj and the index-q norm (summed over TP), get 1/TP of its gradient
            iq_SBGI = _ScaleGrad.apply(iq_SBGI, 1.0 / tp)
        return iq_SBGI, ik_SB1I.squeeze(2)

    def forward(self, hidden_states, attention_mask=None, key_value_states=None, inference_context=None,
                rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None, rotary_pos_cos_sin=None,
                attention_bias=None, packed_seq_params=None, sequence_len_offset=None, *, inference_params=None):
        """hidden_states [S, B, hidden] (already normed by the layer) -> ([S, B, hidden], bias)."""
        if inference_context is not None or inference_params is not None or packed_seq_params is not None:
            raise NotImplementedError("MSASelfAttention: inference contexts and packed sequences are not supported yet")
        q_SBHD, k_SBGD, v_SBGD = self.get_query_key_value_tensors(hidden_states)
        if isinstance(rotary_pos_emb, tuple):
            q_freqs, k_freqs = rotary_pos_emb
        else:
            q_freqs = k_freqs = rotary_pos_emb
        q_SBHD = self._rope(q_SBHD, q_freqs)
        k_SBGD = self._rope(k_SBGD, k_freqs)
        # context parallel: this rank's queries against the whole sequence's keys and values
        cp_group = self.pg_collection.cp
        k_SBGD, v_SBGD = gather_sequence(k_SBGD, cp_group), gather_sequence(v_SBGD, cp_group)
        # ops use [B, S, H, D]
        q, k, v = (t.transpose(0, 1).contiguous() for t in (q_SBHD, k_SBGD, v_SBGD))
        S, B = q.shape[1], q.shape[0]
        chunks = local_query_chunks(S, cp_group.rank(), cp_group.size())

        kl = None
        if self.options.attention == "dense":
            o_BSHD = torch.cat([self._dense_attention(q[:, a:b], k[:, :off + b - a], v[:, :off + b - a], off)
                                for a, b, off in chunks], dim=1)
            keys = torch.tensor(sum((off + (b - a + 1) / 2) * (b - a) for a, b, off in chunks) / S, device=q.device)
        else:
            index_freqs = q_freqs
            if self.index_rotary is not None and q_freqs is not None:
                index_freqs = self.index_rotary(S * cp_group.size(), cp_group=cp_group)
            iq_SBGI, ik_SBI = self._index_branch(hidden_states, index_freqs)
            ik = gather_sequence(ik_SBI, cp_group).transpose(0, 1).contiguous()
            iq = iq_SBGI.transpose(0, 1).contiguous()
            outs, kls, keys = [], [], 0.0
            for a, b, off in chunks:
                o_c, kl_c, block_idx_c = msa_attention(
                    q[:, a:b], k, v, iq[:, a:b], ik, block_size=self.options.block_size, topk=self.options.topk,
                    dense=not self.sparse, scale=self.config.softmax_scale, force_sink=self.options.force_sink,
                    backend=self.options.backend, return_block_idx=True, q_offset=off,
                    local_blocks=self.options.local_blocks,
                )
                outs.append(o_c)
                kls.append(kl_c)
                keys = keys + (b - a) / S * (
                    selected_keys_per_query(block_idx_c, self.options.block_size, off) if block_idx_c is not None
                    else torch.tensor(off + (b - a + 1) / 2, device=q.device))
            o_BSHD = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
            # the chunks have equal lengths: the mean of their means is the mean over this rank's queries
            kl = torch.stack(kls).mean() if len(kls) > 1 else kls[0]

        context_SBX = o_BSHD.transpose(0, 1).reshape(S, B, -1)
        output, bias = self.linear_proj(context_SBX)

        # per-rank means over this rank's groups (TP) and queries (CP): their mean is the layer's value
        tracker, avg_group = get_moe_metrics_tracker(), self._tp_cp_group()
        # in a model mixing full and MSA layers keys/q reports the MSA layers' selection
        if self.options.attention == "msa" or not self.options.layer_attention:
            tracker.record(KEYS_METRIC, keys.float(), self.layer_number, self.config.num_layers, avg_group=avg_group)
        if kl is not None:
            tracker.record(KL_METRIC, kl.detach(), self.layer_number, self.config.num_layers, avg_group=avg_group)
            if self.training and self.options.kl_coeff > 0:
                # the KL's gradient enters at this output during backward, scaled like the loss;
                # megatron multiplies that scale by CP (right for losses it reduces over CP
                # itself), while each rank's KL here is its local mean: divide CP back out
                output = MoEAuxLossAutoScaler.apply(output, kl * (self.options.kl_coeff / cp_group.size()))
        return output, bias

    def _tp_cp_group(self):
        group = getattr(self.pg_collection, "tp_cp", None)
        return group if group is not None else parallel_state.get_tensor_and_context_parallel_group()

    def _dense_attention(self, q_BCHD, k_BJGD, v_BJGD, q_offset: int):
        """Causal GQA attention of queries at positions q_offset.. over keys 0..q_offset+C-1."""
        q, k, v = (t.transpose(1, 2) for t in (q_BCHD, k_BJGD, v_BJGD))
        if q_offset == 0:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.config.softmax_scale, enable_gqa=True)
        else:
            C, J = q.shape[2], k.shape[2]
            mask_CJ = torch.arange(J, device=q.device)[None, :] <= q_offset + torch.arange(C, device=q.device)[:, None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_CJ, scale=self.config.softmax_scale,
                                               enable_gqa=True)
        return o.transpose(1, 2)


def selected_keys_per_query(block_idx_BSGK: torch.Tensor, block_size: int, q_offset: int = 0) -> torch.Tensor:
    """Mean number of causally visible keys in the selected blocks, over (B, S, G), for queries at
    positions q_offset... fp32 scalar."""
    S = block_idx_BSGK.shape[1]
    t = q_offset + torch.arange(S, device=block_idx_BSGK.device).view(1, S, 1, 1)
    visible = (t - block_idx_BSGK.long() * block_size + 1).clamp(0, block_size)
    visible = torch.where(block_idx_BSGK >= 0, visible, torch.zeros_like(visible))
    return visible.sum(-1).float().mean()


def msa_layers(model: torch.nn.Module):
    """Every MSASelfAttention inside `model` (a module or a list of model chunks)."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, MSASelfAttention)]


def set_msa_phase(model, sparse: bool) -> None:
    """Switch every MSA layer between indexer warmup (dense) and top-k selection (sparse)."""
    for layer in msa_layers(model):
        layer.sparse = sparse
