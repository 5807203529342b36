"""MiniMax Sparse Attention as a megatron-core self-attention module.

`MSASelfAttention` is a `SelfAttention` (same linear_qkv, q/k norms, RoPE and linear_proj, so
its main-branch weights are a plain GQA layer's) plus the index branch of docs/msa.md:

    x = normed hidden state, detached       (no gradient from the index branch to the backbone)
    iq = index_q_layernorm(index_q_proj(x)) one index query per GQA group   [S, B, G, Di]
    ik = index_k_layernorm(index_k_proj(x)) one index key shared by groups  [S, B, Di]
    both get the same RoPE as the main q/k

and computes attention + indexer KL with `msa_model.ops.msa_attention`. The KL joins the loss
through megatron's MoE aux-loss auto-scaler (the pipeline schedule sets its scale), weighted by
`kl_coeff`, and is recorded for logging in megatron's MoE metrics tracker as "msa_kl_loss"
without the coefficient (the logged KL is the mean over layers of the uncoefficiented KL).

Phase: `sparse=False` (indexer warmup) runs dense causal attention with a dense KL; `sparse=True`
selects the top-k key blocks per (query, group). The trainer flips it via `set_msa_phase`.

With `attention="dense"` the layer is the full-attention GQA baseline: no index branch at all.

Packed documents: megatron's `attention_mask` argument carries the documents' starts, int
[B, S] (`doc_start`, the position of each token's document's first token; a boolean
[.., S, S] mask would be quadratic in S). Each document is then its own sequence for attention,
selection and KL, in both phases and in the dense baseline (docs/msa.md). None: one document per
row. Under context parallelism the rows are this rank's, as for every [B, S] input.

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

from dataclasses import dataclass, field, replace
from typing import Any, Optional

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from megatron.core import parallel_state
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

from msa_model.config import MSAConfig
from msa_model.context_parallel import gather_sequence, local_query_chunks
from msa_model.ops import msa_attention, sparse_attention

KL_METRIC = "msa_kl_loss"
KEYS_METRIC = "msa_keys_per_query"


@dataclass
class MSAOptions:
    """What the layer needs beyond megatron's TransformerConfig (from ModelConfig)."""

    attention: str = "msa"  # msa | dense
    # model.msa: geometry, KL coefficient, sink, local blocks, ops backend
    msa: MSAConfig = field(default_factory=MSAConfig)
    rotary_base: int = 10000
    # checkpoint the attention core (selection, attention, KL; or dense attention) and rerun it
    # in backward: only its inputs stay alive between forward and backward
    recompute_core: bool = False
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
        # set by msa_model.training.diagnostics to receive this layer's inputs of one forward
        self.diagnostics_capture = None
        if self.options.attention == "dense":
            return

        di = self.options.msa.index_head_dim
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
        di = self.options.msa.index_head_dim
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
        """hidden_states [S, B, hidden] (already normed by the layer) -> ([S, B, hidden], bias).

        attention_mask: None, or the document starts int [B, S] of this rank's tokens (see the
        module docstring)."""
        if inference_context is not None or inference_params is not None or packed_seq_params is not None:
            raise NotImplementedError("MSASelfAttention: inference contexts and megatron's packed_seq_params are not "
                                      "supported; pass document starts as attention_mask")
        doc_start = _document_starts(attention_mask, hidden_states.shape[1], hidden_states.shape[0])
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
        S = q.shape[1]
        if self.options.attention == "dense":
            iq = ik = None
        else:
            index_freqs = q_freqs
            if self.index_rotary is not None and q_freqs is not None:
                index_freqs = self.index_rotary(S * cp_group.size(), cp_group=cp_group)
            if torch.is_grad_enabled():
                # cheap to rebuild (projections to G*Di + Di features, norms, RoPE): keep only its
                # outputs, which the KL needs anyway, not the intermediates
                iq_SBGI, ik_SBI = torch.utils.checkpoint.checkpoint(self._index_branch, hidden_states, index_freqs,
                                                                    use_reentrant=False)
            else:
                iq_SBGI, ik_SBI = self._index_branch(hidden_states, index_freqs)
            ik = gather_sequence(ik_SBI, cp_group).transpose(0, 1).contiguous()
            iq = iq_SBGI.transpose(0, 1).contiguous()
        if self.options.recompute_core and torch.is_grad_enabled():
            # non-reentrant: the core's own autograd graph is rebuilt in backward; its inputs
            # (q, k, v, iq, ik) are what stays alive
            o_BSHD, kl, keys = torch.utils.checkpoint.checkpoint(self._core, q, k, v, iq, ik, doc_start,
                                                                 use_reentrant=False)
        else:
            o_BSHD, kl, keys = self._core(q, k, v, iq, ik, doc_start)

        context_SBX = o_BSHD.transpose(0, 1).reshape(S, o_BSHD.shape[0], -1)
        output, bias = self.linear_proj(context_SBX)
        if not torch.is_grad_enabled():
            # no graph to attach the KL to (evaluation, or the first pass of a layer that
            # megatron's full recompute reruns in backward: it records and attaches then, once)
            return output, bias

        # per-rank means over this rank's groups (TP) and queries (CP): their mean is the layer's value
        tracker, avg_group = get_moe_metrics_tracker(), self._tp_cp_group()
        # in a model mixing full and MSA layers keys/q reports the MSA layers' selection
        if self.options.attention == "msa" or not self.options.layer_attention:
            tracker.record(KEYS_METRIC, keys.float(), self.layer_number, self.config.num_layers, avg_group=avg_group)
        if kl is not None:
            tracker.record(KL_METRIC, kl.detach(), self.layer_number, self.config.num_layers, avg_group=avg_group)
            if self.training and self.options.msa.kl_coeff > 0:
                # the KL's gradient enters at this output during backward, scaled like the loss;
                # megatron multiplies that scale by CP (right for losses it reduces over CP
                # itself), while each rank's KL here is its local mean: divide CP back out
                output = MoEAuxLossAutoScaler.apply(output, kl * (self.options.msa.kl_coeff / cp_group.size()))
        return output, bias

    def _core(self, q, k, v, iq, ik, doc_start=None):
        """The attention core over this rank's query chunks: (o [B, S, Hq, D], KL fp32 scalar or
        None for the dense baseline, mean keys a query reads fp32 scalar).
        q [B, S, Hq, D] (this rank's queries), k/v [B, S_all, G, D], iq [B, S, G, Di],
        ik [B, S_all, Di] (keys of the whole sequence under context parallelism), doc_start int
        [B, S] or None (packed documents)."""
        cp_group = self.pg_collection.cp
        S = q.shape[1]
        chunks = local_query_chunks(S, cp_group.rank(), cp_group.size())
        doc = (lambda a, b: None) if doc_start is None else (lambda a, b: doc_start[:, a:b])
        if self.options.attention == "dense":
            o = torch.cat([self._dense_attention(q[:, a:b], k[:, :off + b - a], v[:, :off + b - a], off, doc(a, b))
                           for a, b, off in chunks], dim=1)
            keys = sum((b - a) / S * dense_keys_per_query(b - a, off, doc(a, b), q.device) for a, b, off in chunks)
            return o, None, keys
        msa = self.options.msa
        outs, kls, keys = [], [], 0.0
        for a, b, off in chunks:
            o_c, kl_c, block_idx_c = msa_attention(
                q[:, a:b], k, v, iq[:, a:b], ik, block_size=msa.block_size, topk=msa.topk,
                dense=not self.sparse, scale=self.config.softmax_scale, force_sink=msa.force_sink,
                backend=msa.backend, return_block_idx=True, q_offset=off, doc_start=doc(a, b),
                # the data pipeline builds the starts: no host synchronisation to check them
                check_ids=False,
                # under recompute the KL's forward reruns right before its backward: keeping its
                # teacher rows then costs memory only for the length of one layer's backward
                keep_teacher=True if self.options.recompute_core else None,
                local_blocks=msa.local_blocks,
            )
            if self.diagnostics_capture is not None:
                # the first forward after arming only (a recomputation finds the capture sealed)
                self.diagnostics_capture.add(q=q[:, a:b], k=k, iq=iq[:, a:b], ik=ik, block_idx=block_idx_c,
                                             q_offset=off, scale=self.config.softmax_scale)
            outs.append(o_c)
            kls.append(kl_c)
            keys = keys + (b - a) / S * (
                selected_keys_per_query(block_idx_c, msa.block_size, off, doc(a, b))
                if block_idx_c is not None else dense_keys_per_query(b - a, off, doc(a, b), q.device))
        if self.diagnostics_capture is not None:
            self.diagnostics_capture.seal()
        o = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
        # the chunks have equal lengths: the mean of their means is the mean over this rank's queries
        kl = torch.stack(kls).mean() if len(kls) > 1 else kls[0]
        return o, kl, keys

    def _tp_cp_group(self):
        group = getattr(self.pg_collection, "tp_cp", None)
        return group if group is not None else parallel_state.get_tensor_and_context_parallel_group()

    def _dense_attention(self, q_BCHD, k_BJGD, v_BJGD, q_offset: int, doc_start_BC=None):
        """Causal GQA attention of queries at positions q_offset.. over keys 0..q_offset+C-1; with
        document starts int [B, C] each query reads its own document's keys only."""
        if doc_start_BC is not None:
            # SDPA would need a [C, J] mask per row: the ops' dense path takes the starts directly
            msa = self.options.msa
            o, _ = sparse_attention(q_BCHD, k_BJGD, v_BJGD, None, block_size=msa.block_size,
                                    scale=self.config.softmax_scale, backend=msa.backend, q_offset=q_offset,
                                    check_ids=False, doc_start=doc_start_BC)
            return o
        q, k, v = (t.transpose(1, 2) for t in (q_BCHD, k_BJGD, v_BJGD))
        if q_offset == 0:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.config.softmax_scale, enable_gqa=True)
        else:
            C, J = q.shape[2], k.shape[2]
            mask_CJ = torch.arange(J, device=q.device)[None, :] <= q_offset + torch.arange(C, device=q.device)[:, None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_CJ, scale=self.config.softmax_scale,
                                               enable_gqa=True)
        return o.transpose(1, 2)


def _scalar(value: float, device) -> torch.Tensor:
    # torch.full fills on the device; torch.tensor(value, device=cuda) would copy from the host and wait
    return torch.full((), float(value), dtype=torch.float32, device=device)


def _document_starts(attention_mask, batch: int, seq: int) -> torch.Tensor | None:
    """The document starts int [B, S] megatron's attention_mask slot carries, or None."""
    if attention_mask is None:
        return None
    if attention_mask.dtype not in (torch.int32, torch.int64) or tuple(attention_mask.shape) != (batch, seq):
        raise ValueError(f"MSASelfAttention takes document starts (int32 [B, S] = [{batch}, {seq}]) as "
                         f"attention_mask, got {attention_mask.dtype} {tuple(attention_mask.shape)}; set "
                         "data.document_mask=true instead of building a mask")
    return attention_mask


def dense_keys_per_query(C: int, q_offset: int, doc_start_BC: torch.Tensor | None, device) -> torch.Tensor:
    """Mean keys a query reads in dense attention, for C queries at positions q_offset..: fp32 scalar."""
    if doc_start_BC is None:
        return _scalar(q_offset + (C + 1) / 2, device)
    pos = q_offset + torch.arange(C, device=doc_start_BC.device)
    return (pos - doc_start_BC + 1).float().mean()


def selected_keys_per_query(block_idx_BSGK: torch.Tensor, block_size: int, q_offset: int = 0,
                            doc_start_BS: torch.Tensor | None = None) -> torch.Tensor:
    """Mean number of causally visible keys in the selected blocks, over (B, S, G), for queries at
    positions q_offset... fp32 scalar. With document starts, blocks count from each query's
    document start."""
    S = block_idx_BSGK.shape[1]
    t = q_offset + torch.arange(S, device=block_idx_BSGK.device).view(1, S, 1, 1)
    if doc_start_BS is not None:
        t = t - doc_start_BS.long()[:, :, None, None]
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
