"""Model FLOPs per token, for the TFLOP/s the trainer logs and the training benchmark.

Counted as the work each variant needs, in multiply-adds x 2, forward + backward:
- every linear layer a token passes through: 6 x its weights (forward 2, backward 4): q/k/v and
  output projections, the index projections (MSA), the router, the dense MLP or the top-k
  routed experts plus the shared expert, and the output layer. Embedding lookups are free.
- attention over the n causally visible keys a query reads: QK^T and PV, 4 x Hq x D x n forward,
  3x that with the backward. Dense: n = (T + 1) / 2 on average. MSA: n = the keys of the selected
  blocks (measured per step: `keys_per_query`).
- MSA's index branch: the index scores of the selection over all causal keys, 2 x Hkv x Di x
  (T + 1) / 2 (forward only: selection has no gradient), and the indexer KL on the support of
  n keys: the teacher's q.k, 2 x Hq x D x n (forward only: stop-gradient), and the student's
  index scores, 2 x Hkv x Di x n forward, 3x that with the backward. In the indexer warmup the
  attention and the KL run over all causal keys and nothing is selected.
Activation recomputation is not counted (model FLOPs, not hardware FLOPs), as in Megatron-LM.
"""

from __future__ import annotations

from msa_model.model.gpt import model_vocab_size, padded_vocab_size
from msa_model.ops.common import keys_per_query as selected_keys


def _linear_weights_per_token(m, vocab: int) -> int:
    """Weights of the linear layers one token passes through (all layers, output layer included)."""
    h, d, hq, g = m.hidden_size, m.head_dim, m.num_attention_heads, m.num_query_groups
    attn = h * (hq + 2 * g) * d + hq * d * h
    if m.attention == "msa":
        attn += h * g * m.msa.index_head_dim + h * m.msa.index_head_dim
    n_moe = m.num_layers - m.first_dense_layers if m.num_experts > 0 else 0
    dense_mlp = 3 * h * m.ffn_hidden_size
    moe_mlp = h * m.num_experts + 3 * h * (m.moe_router_topk * m.moe_ffn_hidden_size + m.moe_shared_expert_size)
    return m.num_layers * attn + (m.num_layers - n_moe) * dense_mlp + n_moe * moe_mlp + vocab * h


def flops_per_token(m, tokenizer_vocab: int, keys_per_query: float | None = None, sparse: bool = True) -> float:
    """Training FLOPs (forward + backward) per token of a `ModelConfig` at its seq_length.

    keys_per_query: the mean number of keys an MSA query reads in the sparse phase (None: the
    top-k budget, capped by the causal average); ignored for the dense model and the warmup."""
    T, hq, d, g = m.seq_length, m.num_attention_heads, m.head_dim, m.num_query_groups
    vocab = padded_vocab_size(model_vocab_size(m, tokenizer_vocab), m)
    causal = (T + 1) / 2
    total = 6.0 * _linear_weights_per_token(m, vocab)
    if m.attention != "msa":
        return total + m.num_layers * 12.0 * hq * d * causal
    di = m.msa.index_head_dim
    if sparse:
        n = keys_per_query if keys_per_query is not None else min(causal, selected_keys(m.msa.block_size, m.msa.topk))
        select = 2.0 * g * di * causal
    else:
        n, select = causal, 0.0
    kl = 2.0 * hq * d * n + 6.0 * g * di * n
    return total + m.num_layers * (12.0 * hq * d * n + select + kl)
