"""Per-GPU memory estimate of a model config on a parallel layout (printed by dry_run=true).

An estimate, not a measurement: it counts the bytes of weights, gradients and optimizer state
exactly from the parameter shapes and the sharding rules below, and activations from a per-token
count of the tensors a layer keeps for backward (bf16; `model.recompute=full` keeps each layer's
input and rebuilds one layer at a time, `selective` drops the attention output). It ignores
allocator fragmentation, communication buffers and temporary workspace, so leave ~10-15% headroom.

Sharding rules (megatron-core with the distributed optimizer):
- non-expert weights split over TP and PP; the input embedding sits on the first stage, the
  output layer on the last; the estimate reports the larger of the two end stages;
- expert weights split over EP, expert-TP (= TP here) and PP;
- gradients are kept in fp32 (grad_reduce_in_fp32); the fp32 master copy and both Adam moments
  (12 bytes / param) are sharded over the data-parallel ranks that hold the same weights:
  DP x CP for non-expert weights, world / (EP x TP x PP) for experts;
- activations per layer scale with the tokens a rank holds, seq / (TP x CP) with sequence
  parallelism; under 1F1B the first stage holds PP micro-batches in flight.
"""

from __future__ import annotations

from msa_model.config import moe_layers
from msa_model.model.gpt import count_parameters, model_vocab_size, padded_vocab_size

GIB = 1024**3


def activation_elements_per_token(m) -> dict[str, int]:
    """Elements one layer keeps for backward per token (before TP/CP splitting)."""
    h, d, hq, g = m.hidden_size, m.head_dim, m.num_attention_heads, m.num_query_groups
    qkv = (hq + 2 * g) * d
    # norm output, qkv projection output, q/k/v after RoPE, attention output, o-proj input, residual
    attention = h + 2 * qkv + 2 * hq * d + h
    if m.attention == "msa":
        di, k = m.msa.index_head_dim, m.msa.topk
        # what the MSA core keeps beyond dense's q, k, v, o, lse (counted in bf16 elements): the
        # index queries and keys after norm and RoPE, the int32 block ids and the int32 entries
        # of their inverse index [G, K], the student's fp32 lse [G]: 1,168 B a token and layer
        # for `small`, 1,808 for the proxy. The late-teacher core saves all but the inverse index
        # for its backward (tests/test_late_teacher.py counts those saved bytes: 912 B for small);
        # the inverse index it keeps on the autograd context (ctx.chunks). Against measured peaks:
        # bench/HISTORY.md, 2026-12-05, "What an MSA layer keeps beyond a dense one"
        attention += g * di + di + 2 * g * k + 2 * g * k + 2 * g
    dense_mlp = h + 3 * m.ffn_hidden_size + h
    moe = 0
    if m.num_experts > 0:
        k, f = m.moe_router_topk, m.moe_ffn_hidden_size
        # norm output, fp32 router logits, dispatched copies, fc1 (gate+up), activation, fc2 input
        moe = h + 2 * m.num_experts + k * (h + 2 * f + f + f) + h
        if m.moe_shared_expert_size:
            moe += 4 * m.moe_shared_expert_size
    return {"attention": attention, "dense_mlp": dense_mlp, "moe_mlp": moe}


def memory_estimate(cfg, tokenizer_vocab: int, world_size: int | None = None) -> dict[str, float]:
    """GiB per GPU for the most loaded pipeline stage: weights, grads, optimizer, activations."""
    m, p = cfg.model, cfg.parallel
    tp, pp, ep, cp = p.tp, p.pp, p.ep, p.cp
    world = world_size or cfg.launch.nodes * cfg.launch.ranks_per_node
    dp = max(1, world // (tp * pp * cp))
    expert_dp = max(1, world // (ep * tp * pp))
    weight_bytes = 2 if m.params_dtype == "bf16" else 4

    counts = count_parameters(m, tokenizer_vocab)
    n_moe = sum(moe_layers(m))
    expert_params = n_moe * m.num_experts * 3 * m.hidden_size * m.moe_ffn_hidden_size
    vocab = padded_vocab_size(model_vocab_size(m, tokenizer_vocab), m, tp)
    embedding = vocab * m.hidden_size
    body = counts["total"] - expert_params - counts["embedding"]
    # the heaviest stage holds 1/PP of the layers plus one embedding matrix (tied: on both ends)
    dense_per_gpu = (body / pp + embedding) / tp
    expert_per_gpu = expert_params / (pp * ep * tp)

    weights = (dense_per_gpu + expert_per_gpu) * weight_bytes
    grads = (dense_per_gpu + expert_per_gpu) * 4
    optimizer = 12 * (dense_per_gpu / (dp * cp) + expert_per_gpu / expert_dp)

    per_token = activation_elements_per_token(m)
    layer_tokens = p.micro_batch_size * m.seq_length / (tp * cp)
    n_dense = m.num_layers - n_moe
    layer_elements = (m.num_layers * per_token["attention"] + n_dense * per_token["dense_mlp"]
                      + n_moe * per_token["moe_mlp"])
    if m.recompute == "full":
        # each layer keeps only its input; one layer at a time is rebuilt with all of its own
        heaviest = max(per_token["attention"] + per_token["dense_mlp"], per_token["attention"] + per_token["moe_mlp"])
        layer_elements = m.num_layers * m.hidden_size + heaviest
    elif m.recompute == "selective":
        # the attention core keeps its inputs (q, k, v and the index branch), not its output
        layer_elements -= m.num_layers * m.num_attention_heads * m.head_dim
    # 1F1B: the first stage keeps PP micro-batches of its L/PP layers = L layers of one micro-batch
    activations = layer_elements * layer_tokens * 2
    if cp > 1 and m.attention == "msa":
        # keys, values and index keys all-gathered over CP are kept for the backward of each layer
        per_layer = p.micro_batch_size * m.seq_length * (2 * max(1, m.num_query_groups // tp) * m.head_dim
                                                         + m.msa.index_head_dim)
        activations += per_layer * 2 * m.num_layers
    # fp32 logits of the last stage for the cross entropy
    logits = p.micro_batch_size * m.seq_length / cp * vocab / tp * 4
    activations += logits
    out = {"weights": weights, "grads": grads, "optimizer": optimizer, "activations": activations}
    out = {k: v / GIB for k, v in out.items()}
    out["total"] = sum(out.values())
    out.update(dp=dp, expert_dp=expert_dp, world=world)
    return out


def format_estimate(est: dict[str, float]) -> list[str]:
    parts = ", ".join(f"{k} {est[k]:.1f}" for k in ("weights", "grads", "optimizer", "activations"))
    return [f"memory_per_gpu_gib={est['total']:.1f}  ({parts}; world {est['world']}, "
            f"dp {est['dp']}, expert dp {est['expert_dp']})"]
