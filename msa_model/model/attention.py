"""The attention layers as megatron-core self-attention modules: MiniMax Sparse Attention
(`MSASelfAttention`) and the full-attention GQA baseline (`DenseSelfAttention`), over one base.

Both are a `SelfAttention` (same linear_qkv, q/k norms, RoPE and linear_proj, so their main-branch
weights are a plain GQA layer's). `MSASelfAttention` adds the index branch of docs/msa.md:

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

Which layers are which: msa_model.model.gpt builds `DenseSelfAttention` for every layer of
`attention="dense"` and for the full-attention layers of `attention_types`, MSA elsewhere.

Packed documents: megatron's `attention_mask` argument carries the documents' starts, int
[B, S] (`doc_start`, the position of each token's document's first token; a boolean
[.., S, S] mask would be quadratic in S). Each document is then its own sequence for attention,
selection and KL, in both phases and in the dense baseline (docs/msa.md). None: one document per
row. Under context parallelism the rows are this rank's, as for every [B, S] input. Dense
attention on documents (the baseline, the warmup) takes the path the batch's documents call for
(msa_model/ops/dense_attention: causal attention on rows of one document, each document alone
in padded buckets otherwise), planned once per micro-batch and shared by the layers.

Parallelism: each rank attends with its own GQA groups (TP) and query chunks (CP), against the
whole sequence's keys (`_attention_inputs`, `_over_query_chunks`); the gradient adjustments that
make the ranks' gradients one process's are msa_model.parallel.grads.

Legend: S = tokens (sequence), B = batch, Hq = query heads, G = GQA groups (kv heads),
D = head dim, Di = index head dim, K = top-k blocks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.nn.attention import SDPBackend, sdpa_kernel
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

from msa_model.config import MSAConfig, tuning_overrides
from msa_model.parallel.context_parallel import gather_sequence, local_query_chunks
from msa_model.model.rng import own_stream
from msa_model.ops import MSASettings, msa_attention
from msa_model.ops.common import doc_rows, host_copy
from msa_model.ops.sparse_attention.inverse_index import reserve_table, table_size
from msa_model.ops.dense_attention import document_attention, document_plan, fused_causal_takes
from msa_model.ops.rope import rope
from msa_model.ops.tuning import kernel_tuning
from msa_model.parallel.grads import attach_kl, average_over_tp, metrics_group, scale_for_tp_mean

KL_METRIC = "msa_kl_loss"
_DETERMINISTIC_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
KEYS_METRIC = "msa_keys_per_query"


@dataclass
class MSAOptions:
    """What the layers need beyond megatron's TransformerConfig (from ModelConfig)."""

    # model.msa: geometry, KL coefficient, sink, local blocks, ops backend
    msa: MSAConfig = field(default_factory=MSAConfig)
    rotary_base: int = 10000
    # checkpoint the attention core (selection, attention, KL; or dense attention) and rerun it
    # in backward: only its inputs stay alive between forward and backward
    recompute_core: bool = False
    # the index q/k rotate their first channels with the main RoPE table (model.rotary_dim set,
    # as in MiniMax-M3) instead of a table of their own when Di != D
    index_main_rope: bool = False
    # full-attention layers report their keys per query; off in a model mixing them with MSA
    # layers, whose selection the metric then reports
    dense_keys_metric: bool = True


@dataclass
class MSASelfAttentionSubmodules(SelfAttentionSubmodules):
    index_q_proj: Any = None  # column-parallel: groups are split across TP like the kv heads
    index_k_proj: Any = None  # duplicated on every TP rank (one head shared by all groups)
    index_q_layernorm: Any = None
    index_k_layernorm: Any = None


class CoreAttentionPlaceholder(IdentityOp):
    """Stands in for megatron's core attention (never called: our layers attend themselves),
    whose local implementation refuses context parallelism at construction."""


class CausalSelfAttention(SelfAttention):
    """What the dense baseline and MSA share: megatron's projections, q/k norms and RoPE, the
    causal attention of this rank's query chunks against the whole sequence's keys, the output
    projection and the per-step metrics. Input/output [S, B, hidden] like SelfAttention; the
    subclasses' `forward` is the method."""

    def __init__(self, config, submodules: SelfAttentionSubmodules, layer_number: int,
                 attn_mask_type=None, cp_comm_type: Optional[str] = None, pg_collection=None,
                 pp_layer_offset: Optional[int] = None, name: Optional[str] = None,
                 options: Optional[MSAOptions] = None):
        super().__init__(config=config, submodules=submodules, layer_number=layer_number,
                         attn_mask_type=attn_mask_type, cp_comm_type=cp_comm_type,
                         pg_collection=pg_collection, pp_layer_offset=pp_layer_offset, name=name)
        self.options = options or MSAOptions()
        # in evaluation (no graph), record the step metrics (keys per query, the indexer KL) as
        # training does: set by `record_evaluation_metrics` for the trainer's validation only
        self.evaluation_metrics = False

    def _document_starts(self, hidden_states, attention_mask, megatron_inputs: dict) -> torch.Tensor | None:
        """The document starts int [B, S] of this rank's tokens that megatron's attention_mask slot
        carries (see the module docstring), or None. Inference contexts and packed_seq_params are
        refused; megatron's other inputs (fused-RoPE cos/sin, attention_bias, ...) are not used."""
        refused = ("inference_context", "inference_params", "packed_seq_params")
        if any(megatron_inputs.get(k) is not None for k in refused):
            raise NotImplementedError(f"{type(self).__name__}: inference contexts and megatron's packed_seq_params "
                                      "are not supported; pass document starts as attention_mask")
        if attention_mask is None:
            return None
        seq, batch = hidden_states.shape[:2]
        if self.config.sequence_parallel:  # hidden_states hold this TP rank's share of the sequence
            seq *= self.pg_collection.tp.size()
        if attention_mask.dtype not in (torch.int32, torch.int64) or tuple(attention_mask.shape) != (batch, seq):
            raise ValueError(f"{type(self).__name__} takes document starts (int32 [B, S] = [{batch}, {seq}]) as "
                             f"attention_mask, got {attention_mask.dtype} {tuple(attention_mask.shape)}; set "
                             "data.document_mask=true instead of building a mask")
        return attention_mask

    def _rope(self, x, freqs):
        if freqs is None:
            return x
        if x.is_cuda and not (self.config.rotary_interleaved or self.config.multi_latent_attention):
            # one fused kernel each way (megatron's unfused RoPE makes about six passes over x;
            # its fused one needs Transformer Engine)
            return rope(x, freqs)
        return apply_rotary_pos_emb(x, freqs, config=self.config, cp_group=self.pg_collection.cp)

    def _attention_inputs(self, hidden_states, rotary_pos_emb):
        """q/k/v projections (with the q/k norms) and RoPE: (q [B, S, Hq, D] of this rank's tokens,
        k and v [B, S_all, G, D] of the whole sequence under context parallelism, q's RoPE table)."""
        q_SBHD, k_SBGD, v_SBGD = self.get_query_key_value_tensors(hidden_states)
        q_freqs, k_freqs = rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb,) * 2
        q_SBHD = self._rope(q_SBHD, q_freqs)
        k_SBGD = self._rope(k_SBGD, k_freqs)
        # context parallel: this rank's queries against the whole sequence's keys and values
        cp_group = self.pg_collection.cp
        k_SBGD, v_SBGD = gather_sequence(k_SBGD, cp_group), gather_sequence(v_SBGD, cp_group)
        # ops use [B, S, H, D]
        q, k, v = (t.transpose(0, 1).contiguous() for t in (q_SBHD, k_SBGD, v_SBGD))
        return q, k, v, q_freqs

    def _recomputed(self, core, *args):
        """core(*args), under model.recompute=selective rerun in backward (non-reentrant: the core's
        own autograd graph is rebuilt there; its inputs are what stays alive)."""
        if self.options.recompute_core and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(core, *args, use_reentrant=False)
        return core(*args)

    def _document_plan(self, q, doc_start, a: int, b: int, q_offset: int):
        """How dense attention runs for this rank's query rows a:b (positions q_offset..) of the
        batch's packed documents (msa_model/ops/dense_attention/plan.py): decided once per
        micro-batch from the starts (a host copy the trainer attaches), shared by every layer.
        None without documents."""
        if doc_start is None:
            return None
        return document_plan(doc_start, a, b, q_offset, fused_causal_takes(q, self.options.msa.backend))

    def _over_query_chunks(self, S: int, attend):
        """The context-parallel chunk loop. `attend(a, b, q_offset)` -> (o [B, b - a, Hq, D], KL fp32
        scalar or None, mean keys a query reads fp32 scalar) for this rank's query rows a:b, which
        are the sequence positions q_offset.. (one chunk without CP, two with it:
        msa_model.parallel.context_parallel). Returns the chunks' outputs concatenated along S, and the KL
        and keys per query as means over this rank's S queries."""
        cp_group = self.pg_collection.cp
        outs, kls, keys = [], [], 0.0
        for a, b, off in local_query_chunks(S, cp_group.rank(), cp_group.size()):
            o_c, kl_c, keys_c = attend(a, b, off)
            outs.append(o_c)
            kls.append(kl_c)
            keys = keys + (b - a) / S * keys_c
        o = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
        if kls[0] is None:
            return o, None, keys
        # the chunks have equal lengths: the mean of their means is the mean over this rank's queries
        return o, torch.stack(kls).mean() if len(kls) > 1 else kls[0], keys

    def _project(self, o_BSHD: torch.Tensor):
        """linear_proj of the attention output: ([S, B, hidden], bias)."""
        return self.linear_proj(o_BSHD.transpose(0, 1).reshape(o_BSHD.shape[1], o_BSHD.shape[0], -1))

    def _evaluating(self) -> bool:
        return self.evaluation_metrics and not self.training

    def _record_step_metrics(self, keys: torch.Tensor, kl: torch.Tensor | None = None) -> None:
        """Record keys per query and the KL in megatron's MoE metrics tracker: per-rank means over
        this rank's groups (TP) and queries (CP), whose mean over `metrics_group` is the layer's."""
        tracker, avg_group = get_moe_metrics_tracker(), metrics_group(self.pg_collection)
        tracker.record(KEYS_METRIC, keys.float(), self.layer_number, self.config.num_layers, avg_group=avg_group)
        if kl is not None:
            tracker.record(KL_METRIC, kl.detach(), self.layer_number, self.config.num_layers, avg_group=avg_group)


class DenseSelfAttention(CausalSelfAttention):
    """The full-attention GQA baseline (and the full layers of a model mixing them with MSA)."""

    def forward(self, hidden_states, attention_mask=None, rotary_pos_emb=None, **megatron_inputs):
        """hidden_states [S, B, hidden] (already normed by the layer) -> ([S, B, hidden], bias)."""
        doc_start = self._document_starts(hidden_states, attention_mask, megatron_inputs)
        q, k, v, _ = self._attention_inputs(hidden_states, rotary_pos_emb)
        o_BSHD, keys = self._recomputed(self._core, q, k, v, doc_start)
        output, bias = self._project(o_BSHD)
        # recorded with a graph only: not in evaluation, nor in the first pass of a layer that
        # megatron's full recompute reruns in backward (it records then, once)
        if (torch.is_grad_enabled() or self._evaluating()) and self.options.dense_keys_metric:
            self._record_step_metrics(keys)
        return output, bias

    def _core(self, q, k, v, doc_start=None):
        """Causal attention over this rank's query chunks: (o [B, S, Hq, D], mean keys a query
        reads fp32 scalar). q [B, S, Hq, D] (this rank's queries), k/v [B, S_all, G, D], doc_start
        int [B, S] or None."""

        def attend(a, b, off):
            # a chunk's queries read the keys up to its own last position
            doc = doc_rows(doc_start, a, b)
            plan = self._document_plan(q, doc_start, a, b, off)
            o = self._dense_attention(q[:, a:b], k[:, :off + b - a], v[:, :off + b - a], off, doc, plan)
            return o, None, dense_keys_per_query(b - a, off, doc, q.device)

        o, _, keys = self._over_query_chunks(q.shape[1], attend)
        return o, keys

    def _dense_attention(self, q_BCHD, k_BJGD, v_BJGD, q_offset: int, doc_start_BC=None, plan=None):
        """Causal GQA attention of queries at positions q_offset.. over keys 0..q_offset+C-1; with
        document starts int [B, C] each query reads its own document's keys only, by the path
        `plan` chose for the batch's documents (msa_model/ops/dense_attention)."""
        if doc_start_BC is not None:
            o, _ = document_attention(q_BCHD, k_BJGD, v_BJGD, doc_start_BC, scale=self.config.softmax_scale,
                                      q_offset=q_offset, backend=self.options.msa.backend, plan=plan)
            return o
        q, k, v = (t.transpose(1, 2) for t in (q_BCHD, k_BJGD, v_BJGD))
        # trainer.deterministic: only kernels whose backward torch makes deterministic in that mode
        deterministic = torch.are_deterministic_algorithms_enabled()
        with sdpa_kernel(_DETERMINISTIC_SDPA) if deterministic else contextlib.nullcontext():
            if q_offset == 0:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.config.softmax_scale,
                                                   enable_gqa=True)
            else:
                C, J = q.shape[2], k.shape[2]
                pos_C = q_offset + torch.arange(C, device=q.device)
                mask_CJ = torch.arange(J, device=q.device)[None, :] <= pos_C[:, None]
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_CJ, scale=self.config.softmax_scale,
                                                   enable_gqa=True)
        return o.transpose(1, 2)


class MSASelfAttention(CausalSelfAttention):
    """Self-attention with MSA: the index branch, top-k block selection and the indexer KL."""

    def __init__(self, config, submodules: MSASelfAttentionSubmodules, layer_number: int, **kwargs):
        super().__init__(config, submodules, layer_number, **kwargs)
        self.sparse = True
        self.settings = msa_settings(self.options, config.softmax_scale)
        # whether the last forward's KL gets its value in backward (see `_core`)
        self._late_kl = False
        # set by msa_model.training.diagnostics to receive this layer's inputs of one forward
        self.diagnostics_capture = None
        # model.msa.cuda_graph: the sparse core captured per input shapes (`_graphed_core`)
        self._graphs: dict = {}
        self._graph_pool = None  # their memory pool, made with the first
        di = self.options.msa.index_head_dim
        with own_stream(f"msa-index/layer{layer_number}"):  # the backbone's weights as a dense model's
            self._build_index_branch(submodules, config, di)
        # the model's rotary table has the main head dim; a different Di needs its own table
        self.index_rotary = None
        if di != self.hidden_size_per_attention_head and not self.options.index_main_rope:
            self.index_rotary = RotaryEmbedding(kv_channels=di, rotary_percent=1.0, rotary_base=self.options.rotary_base,
                                                use_cpu_initialization=config.use_cpu_initialization)

    def _build_index_branch(self, submodules, config, di: int) -> None:
        """The index projections W_iq (column-parallel: groups split across TP like the kv heads)
        and W_ik, and their norms when the main q/k have them."""
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
            average_over_tp(self.index_k_layernorm)

    def forward(self, hidden_states, attention_mask=None, rotary_pos_emb=None, **megatron_inputs):
        """hidden_states [S, B, hidden] (already normed by the layer) -> ([S, B, hidden], bias)."""
        doc_start = self._document_starts(hidden_states, attention_mask, megatron_inputs)
        graphed = self._graphable(hidden_states, doc_start)
        if graphed and self.options.msa.cuda_graph_scope == "attention":
            output, kl, keys = self._graphed_block(hidden_states, rotary_pos_emb, doc_start)
            # megatron's RowParallelLinear hands its bias back unadded where skip_bias_add is set
            bias = self.linear_proj.bias if getattr(self.linear_proj, "skip_bias_add", False) else None
        else:
            # main branch: q/k/v with their norms and RoPE
            q, k, v, q_freqs = self._attention_inputs(hidden_states, rotary_pos_emb)
            # index branch: iq per group, ik shared, from the detached hidden state
            iq, ik = self._index_inputs(hidden_states, q_freqs, q.shape[1])
            # top-k selection (dense in warmup), attention and the indexer KL
            if graphed:
                o_BSHD, kl, keys = self._graphed_core(q, k, v, iq, ik, doc_start)
            else:
                o_BSHD, kl, keys = self._recomputed(self._core, q, k, v, iq, ik, doc_start)
            output, bias = self._project(o_BSHD)
        if not torch.is_grad_enabled():
            # no graph to attach the KL to: the trainer's validation records it; the first pass of a
            # layer that megatron's full recompute reruns in backward does not (it records then, once)
            if self._evaluating():
                self._record_step_metrics(keys, kl)
            return output, bias
        # a KL whose teacher comes from the attention's backward is recorded there (`_core`)
        self._record_step_metrics(keys, None if self._late_kl else kl)
        if self.training and self.options.msa.kl_coeff > 0:
            output = attach_kl(output, kl, self.options.msa.kl_coeff, self.pg_collection.cp)
        return output, bias

    def _index_freqs(self, q_freqs, S: int):
        """The index branch's RoPE table for this rank's S tokens: the main q's, or its own."""
        if self.index_rotary is None or q_freqs is None:
            return q_freqs
        cp_group = self.pg_collection.cp
        return self.index_rotary(S * cp_group.size(), cp_group=cp_group)

    def _index_inputs(self, hidden_states, q_freqs, S: int, index_freqs=None):
        """(iq [B, S, G_local, Di] of this rank's S tokens, ik [B, S_all, Di] of the whole sequence).
        `index_freqs`: the branch's RoPE table when the caller made it (else from q_freqs)."""
        cp_group = self.pg_collection.cp
        if index_freqs is None:
            index_freqs = self._index_freqs(q_freqs, S)
        if torch.is_grad_enabled() and self.config.recompute_granularity != "full":
            # cheap to rebuild (projections to G*Di + Di features, norms, RoPE): keep only its
            # outputs, which the KL needs anyway, not the intermediates. Under full recompute this
            # forward already is the layer's rerun inside its backward: a third pass would gain nothing.
            # The branch draws no random numbers: no RNG state to keep (nor to read inside a graph)
            iq_SBGI, ik_SBI = torch.utils.checkpoint.checkpoint(self._index_branch, hidden_states, index_freqs,
                                                                use_reentrant=False, preserve_rng_state=False)
        else:
            iq_SBGI, ik_SBI = self._index_branch(hidden_states, index_freqs)
        ik = gather_sequence(ik_SBI, cp_group).transpose(0, 1).contiguous()
        return iq_SBGI.transpose(0, 1).contiguous(), ik

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
        return scale_for_tp_mean(iq_SBGI, self.pg_collection.tp), ik_SB1I.squeeze(2)

    def _graphable(self, x, doc_start) -> bool:
        """Whether this forward replays a CUDA graph (model.msa.cuda_graph, of the core or of the
        whole block: model.msa.cuda_graph_scope): training steps of the sparse phase; validation,
        the indexer warmup and a diagnostics capture run eagerly. The configurations it needs are
        checked with the config (msa_model.config_checks)."""
        return (self.options.msa.cuda_graph and self.sparse and self.training and torch.is_grad_enabled()
                and (doc_start is None or host_copy(doc_start) is not None)
                and self.diagnostics_capture is None and x.is_cuda)

    def _graphed_core(self, q, k, v, iq, ik, doc_start=None):
        """`_core` replayed as a CUDA graph, captured (forward and backward) at the first call of
        these shapes. The graph reads and writes fixed buffers: inputs are copied in, the outputs
        and the inputs' gradients are views of its own memory, valid until this layer's next
        forward, which megatron's schedule without a pipeline runs after the backward of the last.
        The KL whose value the backward fills in is recorded once that backward has run (a hook
        on q's gradient): the graph replays kernels, not the eager core's Python callback.
        Packed documents (starts with their host copy): the documents' block table is a shape of
        the core, so a graph serves the micro-batches whose table fits its size, a power of two
        (the rows' extra entries are empty); one graph per size met, all in one memory pool."""
        return self._replay(self._graph_body, (q, k, v, iq, ik), doc_start)

    def _graphed_block(self, hidden_states, rotary_pos_emb, doc_start=None):
        """The whole attention block (model.msa.cuda_graph_scope=attention) replayed as a CUDA
        graph: (output [S, B, hidden] before any skipped bias, KL, keys per query). The graph
        also returns its weights' gradients, which reach them as an eager backward's would
        (megatron's gradient hooks run on them). The RoPE tables are inputs, copied in."""
        q_freqs, k_freqs = rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb, None)
        # the index branch's own table, where it has one (else it rotates with q's)
        index_freqs = self._index_freqs(q_freqs, hidden_states.shape[0]) if self.index_rotary is not None else None
        freqs = (q_freqs, k_freqs, index_freqs)
        present = tuple(t is not None for t in freqs)
        names, weights = zip(*[(n, p) for n, p in self.named_parameters() if p.requires_grad])
        return self._replay(functools.partial(self._block_body, present, names),
                            (hidden_states,) + tuple(t for t in freqs if t is not None) + weights, doc_start,
                            tag=("block", present, names))

    def _replay(self, body, inputs: tuple, doc_start=None, tag=()):
        """body(*inputs, doc_start) -> (out, KL, keys) replayed as a CUDA graph captured (forward
        and backward) at the first call of these shapes and `tag` (see `_graphed_core`)."""
        inputs = inputs + ((doc_start,) if doc_start is not None else ())
        key = tag + tuple((tuple(t.shape), t.dtype, t.requires_grad) for t in inputs)
        table = 0
        if doc_start is not None:
            table = max(16, 1 << (table_size(doc_start, self.settings.block_size) - 1).bit_length())
            key += (table,)
        entry = self._graphs.get(key)
        if entry is None:
            samples = tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in inputs)
            if doc_start is not None:
                reserve_table(samples[-1], self.settings.block_size, table)
            if self._graph_pool is None:
                # one memory pool for the layer's graphs: they never run interleaved (a forward's
                # backward comes before the layer's next forward), so a graph for another table
                # size reuses its predecessors' working memory instead of holding its own
                self._graph_pool = torch.cuda.graph_pool_handle()
            # a weight the capture's step leaves unused (none in the sparse phase) gets no gradient
            graphed = torch.cuda.make_graphed_callables(body, samples, pool=self._graph_pool,
                                                        allow_unused_input=True)
            # whether the captured KL is filled in by the backward, as the capture's core decided:
            # a replay runs no core, and an eager forward in between (validation) decides anew
            entry = self._graphs[key] = (graphed, self._late_kl)
        graphed, self._late_kl = entry
        out, kl, keys = graphed(*inputs)
        if self._late_kl and inputs[0].requires_grad:
            inputs[0].register_hook(lambda grad: self._record_kl(kl))
        return out, kl, keys

    def _graph_body(self, q, k, v, iq, ik, doc_start=None):
        return self._core(q, k, v, iq, ik, doc_start, record_late_kl=False)

    def _block_body(self, present: tuple, names: tuple, hidden_states, *rest):
        """The attention block's training forward from its input, the RoPE tables `present` and the
        weights `names` in that order (then the document starts, if any): (output, KL, keys).
        The weights are inputs, not the layer's parameters: the capture differentiates its own
        copies, whose gradients the replay hands to the parameters, and never runs an autograd
        node of theirs (megatron's data-parallel wrapper keeps those, made on the default stream,
        which a capture's stream must not wait for)."""
        it = iter(rest)
        q_freqs, k_freqs, index_freqs = (next(it) if p else None for p in present)
        weights = {name: next(it) for name in names}
        doc_start = next(it, None)
        rotary = (q_freqs, k_freqs) if k_freqs is not None else q_freqs
        with _parameters_replaced(self, weights):
            q, k, v, q_freqs = self._attention_inputs(hidden_states, rotary)
            iq, ik = self._index_inputs(hidden_states, q_freqs, q.shape[1], index_freqs)
            o_BSHD, kl, keys = self._core(q, k, v, iq, ik, doc_start, record_late_kl=False)
            output, _ = self._project(o_BSHD)
        return output, kl, keys

    def _record_kl(self, kl):
        """Add a KL filled in by the backward to the layer's metric (the eager core's chunks each
        add their share; the graphed core the whole)."""
        get_moe_metrics_tracker().record(KL_METRIC, kl.detach(), self.layer_number, self.config.num_layers,
                                         avg_group=metrics_group(self.pg_collection))

    def _core(self, q, k, v, iq, ik, doc_start=None, record_late_kl: bool = True):
        """MSA over this rank's query chunks: (o [B, S, Hq, D], KL fp32 scalar, mean keys a query
        reads fp32 scalar). q [B, S, Hq, D] (this rank's queries), k/v [B, S_all, G, D],
        iq [B, S, G, Di], ik [B, S_all, Di] (keys of the whole sequence under context
        parallelism), doc_start int [B, S] or None (packed documents). `record_late_kl=False`:
        a KL that the backward fills in is not recorded there (the graphed core records it)."""
        cp = self.pg_collection.cp
        # the op decides whether the KL's teacher comes from the attention's backward (the KL's
        # value known there, `kl_in_backward`); in evaluation no backward is expected
        settings = self.settings if self.training else dataclasses.replace(self.settings, kl_teacher="forward")
        # the diagnostics number each document's blocks from every key's document start
        key_doc = doc_start
        if self.diagnostics_capture is not None and doc_start is not None and cp.size() > 1:
            with torch.no_grad():
                key_doc = gather_sequence(doc_start.transpose(0, 1).contiguous(), cp).transpose(0, 1)
        chunks = len(local_query_chunks(q.shape[1], cp.rank(), cp.size()))
        late = []

        def record(value):
            # a KL whose value the backward fills in (`kl_in_backward`) is recorded there; the
            # layer's KL is the mean of its (equal-length) chunks': each adds its share
            self._record_kl(value / chunks)

        def attend(a, b, off):
            doc = doc_rows(doc_start, a, b)
            plan = None if self.sparse else self._document_plan(q, doc_start, a, b, off)
            o, kl, block_idx, kl_in_backward = msa_attention(
                q[:, a:b], k, v, iq[:, a:b], ik, settings, dense=not self.sparse, q_offset=off, doc_start=doc,
                # the data pipeline builds the starts: no host synchronisation to check them
                check_ids=False, on_kl=record if record_late_kl else None, document_plan=plan,
                # without a graph the layer drops the KL (full recompute's first pass, inference)
                with_kl=torch.is_grad_enabled() or self._evaluating(),
            )
            late.append(kl_in_backward)
            if self.diagnostics_capture is not None:
                # the first forward after arming only (a recomputation finds the capture sealed)
                self.diagnostics_capture.add(q=q[:, a:b], k=k, iq=iq[:, a:b], ik=ik, block_idx=block_idx,
                                             q_offset=off, scale=self.config.softmax_scale, doc_start=doc,
                                             key_doc_start=key_doc)
            keys = (selected_keys_per_query(block_idx, settings.block_size, off, doc) if block_idx is not None
                    else dense_keys_per_query(b - a, off, doc, q.device))
            return o, kl, keys

        o, kl, keys = self._over_query_chunks(q.shape[1], attend)
        # the chunks have equal lengths: the op decides alike for each
        self._late_kl = any(late)
        if self.diagnostics_capture is not None:
            self.diagnostics_capture.seal()
        return o, kl, keys


@contextlib.contextmanager
def _parameters_replaced(module: torch.nn.Module, tensors: dict):
    """Within: `module`'s parameters of these (dotted) names read as the given tensors."""
    saved = []
    try:
        for name, tensor in tensors.items():
            owner_name, _, leaf = name.rpartition(".")
            owner = module.get_submodule(owner_name)
            saved.append((owner, leaf, owner._parameters[leaf]))
            owner._parameters[leaf] = tensor
        yield
    finally:
        for owner, leaf, param in reversed(saved):
            owner._parameters[leaf] = param


def msa_settings(options: MSAOptions, scale: float | None) -> MSASettings:
    """msa_attention's settings for a layer of these options (model.msa) and softmax scale."""
    msa = options.msa
    return MSASettings(block_size=msa.block_size, topk=msa.topk, local_blocks=msa.local_blocks,
                       force_sink=msa.force_sink, scale=scale, index_precision=msa.index_precision,
                       kl_teacher=msa.kl_teacher, kl_temperature=msa.kl_temperature,
                       # under recompute the KL's forward reruns right before its backward: keeping its
                       # teacher rows then costs memory only for the length of one layer's backward
                       keep_teacher=True if options.recompute_core else None,
                       fp8_probs=msa.fp8_probs, backend=msa.backend,
                       tuning=kernel_tuning(tuning_overrides(msa.tuning)))


def _scalar(value: float, device) -> torch.Tensor:
    # torch.full fills on the device; torch.tensor(value, device=cuda) would copy from the host and wait
    return torch.full((), float(value), dtype=torch.float32, device=device)


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


def record_evaluation_metrics(model, on: bool) -> None:
    """Whether the attention layers of `model` record their step metrics (keys per query, the
    indexer KL) in evaluation mode without a graph, as the trainer's validation wants."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    for layer in (m for chunk in chunks for m in chunk.modules() if isinstance(m, CausalSelfAttention)):
        layer.evaluation_metrics = on


def set_msa_phase(model, sparse: bool) -> None:
    """Switch every MSA layer between indexer warmup (dense) and top-k selection (sparse)."""
    for layer in msa_layers(model):
        layer.sparse = sparse
