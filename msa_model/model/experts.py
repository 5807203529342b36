"""Routed experts as grouped GEMMs, without Transformer Engine.

megatron-core runs the experts of a MoE layer either one after another (`SequentialMLP`, a
matmul and an activation per expert) or as grouped GEMMs through Transformer Engine, which we
do not use. `GroupedExperts` keeps `SequentialMLP`'s parameters, names and sharded state dict
(checkpoints and conversions do not change) and replaces its loop by three grouped matrix
products over all local experts (`torch.nn.functional.grouped_mm`: on Hopper one CUTLASS
kernel per product; on CPU a reference loop inside torch).

The products take the tokens sorted by expert, as the dispatcher hands them over, and the
expert boundaries as device-side offsets, so the loop's per-expert host splits are gone.
Without expert or tensor parallelism there is nothing to exchange between ranks, and
`LocalDispatchMoELayer` uses `LocalTokenDispatcher`, which keeps the token counts on the device:
megatron's all-to-all dispatcher copies them to the host and waits for the device in every MoE
layer, which stalls the host's issue queue once per layer (and it re-sorts the tokens by a
permutation that is the identity on one rank).
The autograd function saves the input and fc1's output only: the activation (GLU, expert
probabilities applied) is recomputed in backward, and the stacked weights are rebuilt from
the experts' own parameters rather than kept. On CUDA a silu or quick-GELU GLU without clamps
runs as one fused kernel each way (`msa_model.ops.glu`; the backward's also gives the
activation again for fc2's weight gradient), instead of about six elementwise passes over
[N, 2F] tensors, one of them in fp32.

Legend: N = tokens routed to this rank's experts (sorted by expert), E = local experts,
H = hidden size, F = expert width (fc1 has 2F outputs: gate and up, stacked).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_geglu import quick_gelu
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer, get_default_pg_collection
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

from msa_model.ops.glu import glu_backward_triton, glu_forward_triton

_grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm


def glu_activation(config):
    """The gated activation of megatron's MLP (`glu` in megatron.core.transformer.mlp) as a
    function of fc1's output [N, 2F] -> [N, F]: act(gate) * (up + offset), optional clamps."""
    act, offset, clamp = config.activation_func, config.glu_linear_offset, config.activation_func_clamp_value

    def glu(h_N2F: torch.Tensor) -> torch.Tensor:
        gate, up = torch.chunk(h_N2F, 2, dim=-1)
        if clamp is not None:
            gate = gate.clamp(min=None, max=clamp)
            up = up.clamp(min=-clamp, max=clamp)
        return act(gate) * (up + offset)

    return glu


def fused_glu(config) -> tuple[float, float] | None:
    """(alpha, offset) of the fused kernel's act(x) = x sigmoid(alpha x) when the GLU is one it
    computes (silu, or quick-GELU as msa_model.model.gpt builds it, without clamps), else None."""
    act = config.activation_func
    if config.activation_func_clamp_value is not None:
        return None
    if act is F.silu:
        alpha = 1.0
    elif act is quick_gelu:
        alpha = 1.702
    elif isinstance(act, functools.partial) and getattr(act.func, "__name__", "") == "_quick_gelu":
        alpha = float(act.keywords["alpha"])
    else:
        return None
    return alpha, float(config.glu_linear_offset)


def _scaled_activation(glu, h_N2F, probs_N):
    """GLU of fc1's output times each token's routing probability, in the input dtype (as
    megatron's MLP applies `per_token_scale`)."""
    a = glu(h_N2F)
    return (a * probs_N.unsqueeze(-1)).to(h_N2F.dtype)


class _GroupedSwiGLU(torch.autograd.Function):
    """y [N, H] = sum over experts e of rows offs[e-1]:offs[e]: act(x W1_e^T) * p  W2_e^T."""

    @staticmethod
    def forward(ctx, x_NH, probs_N, offs_E, glu, fused, n_experts, *weights):
        """fused: the GLU's (alpha, offset) for the fused kernels, or None (`glu` in torch)."""
        w1, w2 = weights[:n_experts], weights[n_experts:]
        W1_EFH = torch.stack(w1)  # [E, 2F, H]
        h_N2F = _grouped_mm(x_NH, W1_EFH.transpose(1, 2), offs=offs_E)
        del W1_EFH
        if fused is not None:
            a_NF = glu_forward_triton(h_N2F, probs_N, *fused)
        else:
            a_NF = _scaled_activation(glu, h_N2F, probs_N)
        y_NH = _grouped_mm(a_NF, torch.stack(w2).transpose(1, 2), offs=offs_E)
        ctx.save_for_backward(x_NH, probs_N, offs_E, h_N2F, *weights)
        ctx.glu, ctx.fused, ctx.n_experts = glu, fused, n_experts
        return y_NH

    @staticmethod
    def backward(ctx, dy_NH):
        x_NH, probs_N, offs_E, h_N2F, *weights = ctx.saved_tensors
        n = ctx.n_experts
        w1, w2 = weights[:n], weights[n:]
        dy_NH = dy_NH.contiguous()
        # fc2: d a = dy W2_e ; d W2_e = dy_e^T a_e
        da_NF = _grouped_mm(dy_NH, torch.stack(w2), offs=offs_E)
        if ctx.fused is not None:
            dh_N2F, a_NF, dprobs = glu_backward_triton(h_N2F, probs_N, da_NF, *ctx.fused)
            dprobs = dprobs.to(probs_N.dtype) if ctx.needs_input_grad[1] else None
        else:
            with torch.enable_grad():
                h = h_N2F.detach().requires_grad_()
                p = probs_N.detach().requires_grad_(ctx.needs_input_grad[1])
                a_NF = _scaled_activation(ctx.glu, h, p)
            inputs = (h, p) if ctx.needs_input_grad[1] else (h,)
            grads = torch.autograd.grad(a_NF, inputs, da_NF)
            dh_N2F, dprobs = grads[0], grads[1] if ctx.needs_input_grad[1] else None
            a_NF = a_NF.detach()
        dW2_EHF = _grouped_mm(dy_NH.t(), a_NF, offs=offs_E)
        # fc1: d x = dh W1_e ; d W1_e = dh_e^T x_e
        dx_NH = _grouped_mm(dh_N2F, torch.stack(w1), offs=offs_E) if ctx.needs_input_grad[0] else None
        dW1_EFH = _grouped_mm(dh_N2F.t(), x_NH, offs=offs_E)
        return (dx_NH, dprobs, None, None, None, None, *dW1_EFH.unbind(0), *dW2_EHF.unbind(0))


class GroupedExperts(SequentialMLP):
    """`SequentialMLP` whose forward runs all local experts as grouped GEMMs.

    Same parameters (`local_experts.i.linear_fc1.weight` [2F, H], `linear_fc2.weight` [H, F]),
    so checkpoints, resharding and conversion are those of `SequentialMLP`. Bias-free GLU
    experts only (the models here have no linear biases); fp8/fp4 are not supported.
    """

    def __init__(self, num_local_experts, config, submodules, pg_collection=None, name=None):
        super().__init__(num_local_experts, config, submodules, pg_collection=pg_collection, name=name)
        if config.add_bias_linear or not config.gated_linear_unit:
            raise ValueError("GroupedExperts needs bias-free gated (GLU) experts")
        if config.moe_apply_probs_on_input:
            raise ValueError("GroupedExperts applies the routing probabilities after the activation")
        self._glu = glu_activation(self.config)
        self._fused = fused_glu(self.config)

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        """hidden [N, H] sorted by local expert, tokens_per_expert [E] (host or device),
        probs [N] -> ([N, H], None)."""
        x = permuted_local_hidden_states
        if x.is_cuda and x.dtype != torch.bfloat16:
            # torch's CUDA grouped GEMM takes bf16 only: other dtypes run the loop
            return super().forward(x, tokens_per_expert, permuted_probs)
        offs = torch.cumsum(tokens_per_expert.to(device=x.device, non_blocking=True), 0).to(torch.int32)
        w1 = [e.linear_fc1.weight for e in self.local_experts]
        w2 = [e.linear_fc2.weight for e in self.local_experts]
        y = _GroupedSwiGLU.apply(x, permuted_probs, offs, self._glu, self._fused if x.is_cuda else None, len(w1),
                                 *w1, *w2)
        return y, None


def _token_sums(rows_RH: torch.Tensor, order_R: torch.Tensor, k: int) -> torch.Tensor:
    """[T, H]: each token's k rows summed (fp32 accumulation), rows_RH [T*k, H] in any order and
    order_R the rows sorted by token (stable). Every token must own exactly k rows (dropless
    top-k routing: `local_dispatch_supported` excludes capacities and padding); the sort puts
    token t's rows at t*k .. t*k + k - 1."""
    return rows_RH.index_select(0, order_R).view(-1, k, rows_RH.shape[-1]).sum(1)


class _TokenRows(torch.autograd.Function):
    """Top-k dispatch as gathers both ways: rows [T*k, H] = x[token of row], and its backward,
    d x = the sum of each token's k row gradients. megatron's permute gathers in the forward but
    scatters with atomic adds in the backward (`index_add_`, each token's k rows contending),
    several times slower than the gather and sum."""

    @staticmethod
    def forward(ctx, x_TH, token_R, order_R, k):
        ctx.save_for_backward(order_R)
        ctx.k = k
        return x_TH.index_select(0, token_R)

    @staticmethod
    def backward(ctx, d_RH):
        (order_R,) = ctx.saved_tensors
        return _token_sums(d_RH, order_R, ctx.k), None, None, None


class _TokenSums(torch.autograd.Function):
    """Top-k combine: y [T, H] = the sum of each token's k expert rows; backward d rows = dy[token
    of row] (megatron's unpermute scatter-adds in bf16, and its backward gathers by an index
    expanded to [T*k, H])."""

    @staticmethod
    def forward(ctx, rows_RH, token_R, order_R, k):
        ctx.save_for_backward(token_R)
        return _token_sums(rows_RH, order_R, k)

    @staticmethod
    def backward(ctx, dy_TH):
        (token_R,) = ctx.saved_tensors
        return dy_TH.index_select(0, token_R), None, None, None


def permute_topk(x_TH: torch.Tensor, routing_map_TE: torch.Tensor, probs_TE: torch.Tensor, k: int):
    """(rows [T*k, H], their probabilities [T*k], token of each row int64 [T*k], the rows sorted by
    token [T*k]) of top-k routing (exactly k experts a token): the rows in megatron's order, those
    of expert 0 (tokens ascending), then expert 1, ... (`moe_utils.permute`'s, without drops)."""
    T = x_TH.shape[0]
    flat = routing_map_TE.T.contiguous().view(-1).argsort(descending=True, stable=True)[:T * k]
    token_R = flat % T
    order_R = token_R.argsort(stable=True)
    rows_RH = _TokenRows.apply(x_TH, token_R, order_R, k)
    return rows_RH, probs_TE.T.contiguous().view(-1)[flat], token_R, order_R


def unpermute_topk(rows_RH: torch.Tensor, token_R: torch.Tensor, order_R: torch.Tensor, k: int) -> torch.Tensor:
    """[T, H]: each token's k rows of `permute_topk`'s order summed (`moe_utils.unpermute`'s result)."""
    return _TokenSums.apply(rows_RH, token_R, order_R, k)


class LocalTokenDispatcher(MoEAlltoAllTokenDispatcher):
    """megatron's all-to-all dispatcher on one rank (EP = expert TP = 1), with nothing moved to the host.

    Tokens are permuted by expert (argsort, a static output size: dropless top-k routing sends
    every token to exactly k experts) and the counts per expert stay a device tensor, which
    `GroupedExperts` turns into offsets. The exchanges between ranks and the re-sort by source
    rank are identities here and are skipped. The permutation and its inverse run as gathers
    both ways (`_TokenRows`, `_TokenSums`): the rows are in megatron's order (by expert, then
    token), each token's k rows found by a stable sort of the rows' tokens."""

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        """hidden [.., H], routing_map bool [T, E] (k per row), probs [T, E] -> (rows [T*k, H] by expert,
        their probabilities [T*k])."""
        self.hidden_shape = hidden_states.shape
        self.probs, self.routing_map = probs, routing_map
        x_TH = hidden_states.view(-1, self.hidden_shape[-1])
        self.tokens_per_expert = self.preprocess(routing_map)
        # no shared-expert overlap here (`local_dispatch_supported`): the MoE layer adds the
        # shared experts' output itself
        rows_RH, probs_R, *self._rows = permute_topk(x_TH, routing_map, probs, self.config.moe_router_topk)
        return rows_RH, probs_R

    def combine_postprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out = unpermute_topk(hidden_states, *self._rows, self.config.moe_router_topk).view(self.hidden_shape)
        self._rows = None
        return out

    def preprocess(self, routing_map: torch.Tensor) -> torch.Tensor:
        self.num_out_tokens = routing_map.size(0) * self.config.moe_router_topk
        return routing_map.sum(dim=0).long()

    def _maybe_dtoh_and_synchronize(self, point: str, tokens_per_expert=None):
        return tokens_per_expert

    def token_dispatch(self, permutated_local_input_tokens, permuted_probs):
        return permutated_local_input_tokens, permuted_probs

    def dispatch_postprocess(self, global_input_tokens, global_probs):
        tokens_per_expert, self.tokens_per_expert = self.tokens_per_expert, None
        return global_input_tokens, tokens_per_expert, global_probs

    def combine_preprocess(self, hidden_states):
        return hidden_states

    def token_combine(self, hidden_states, async_finish: bool = True, allocate_on_comm_stream: bool = True):
        return hidden_states


def local_dispatch_supported(config, pg_collection) -> bool:
    """Whether `LocalTokenDispatcher` applies: one expert rank and one expert tensor-parallel rank,
    dropless routing (exactly k rows a token), no shared-expert overlap (which hooks into the
    exchanges), no CUDA graphs (megatron's capture lists the base dispatcher's state, not the
    permutation this one keeps)."""
    return (pg_collection.ep.size() == 1 and pg_collection.expt_tp.size() == 1
            and config.moe_expert_capacity_factor is None and not config.moe_pad_expert_input_to_capacity
            and not config.moe_router_padding_for_quantization and not config.moe_shared_expert_overlap
            and getattr(config, "cuda_graph_impl", "none") == "none")


class LocalDispatchMoELayer(MoELayer):
    """megatron's MoELayer whose dispatcher, on one expert rank, is `LocalTokenDispatcher`."""

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None, is_mtp_layer=False,
                 name=None):
        super().__init__(config, submodules=submodules, layer_number=layer_number, pg_collection=pg_collection,
                         is_mtp_layer=is_mtp_layer, name=name)
        pg = get_default_pg_collection() if pg_collection is None else pg_collection
        if isinstance(self.token_dispatcher, MoEAlltoAllTokenDispatcher) and local_dispatch_supported(config, pg):
            self.token_dispatcher = LocalTokenDispatcher(self.num_local_experts, self.local_expert_indices,
                                                         config=self.config, pg_collection=pg)
