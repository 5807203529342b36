"""The grouped-GEMM experts against a per-expert loop: output and every gradient (input, routing
probabilities, both weights of every expert), with an expert that receives no token.

CPU: fp32 against an fp64 loop. CUDA: bf16 through torch's grouped GEMM kernel, whose error must
stay within 2x that of the same loop run in bf16 (both against fp64)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from msa_model.model.experts import _GroupedSwiGLU, fused_glu
from msa_model.ops.triton_utils import interpreting


class _Cfg:
    activation_func = staticmethod(F.silu)
    glu_linear_offset = 0.0
    activation_func_clamp_value = None


def _glu(cfg):
    from msa_model.model.experts import glu_activation

    return glu_activation(cfg)


def _loop(x, probs, counts, w1, w2, glu):
    out, start = [], 0
    for n, a, b in zip(counts, w1, w2):
        h = x[start:start + n] @ a.t()
        out.append((glu(h) * probs[start:start + n, None]).to(x.dtype) @ b.t())
        start += n
    return torch.cat(out)


def _inputs(device, dtype, counts, H=64, F_=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    N, E = sum(counts), len(counts)
    x = torch.randn(N, H, generator=g)
    probs = torch.rand(N, generator=g)
    w1 = [torch.randn(2 * F_, H, generator=g) / H**0.5 for _ in range(E)]
    w2 = [torch.randn(H, F_, generator=g) / F_**0.5 for _ in range(E)]
    dy = torch.randn(N, H, generator=g)
    leaves = [t.to(device=device, dtype=dtype).requires_grad_() for t in (x, probs, *w1, *w2)]
    # routing probabilities are fp32 in megatron whatever the model dtype
    leaves[1] = probs.to(device=device, dtype=torch.float32).requires_grad_()
    return leaves, dy.to(device=device, dtype=dtype)


def _grads(fn, leaves, dy):
    out = fn(*leaves)
    out.backward(dy)
    return [out.detach().double()] + [t.grad.double() for t in leaves]


def _run(device, dtype, counts, grouped: bool, fused=None):
    """fused: the fused GLU kernels' (alpha, offset) (on CPU in Triton's interpreter), or None."""
    leaves, dy = _inputs(device, dtype, counts)
    E, glu = len(counts), _glu(_Cfg)
    if grouped:
        offs = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
        fn = lambda x, p, *w: _GroupedSwiGLU.apply(x, p, offs, glu, fused, E, *w)  # noqa: E731
    else:
        fn = lambda x, p, *w: _loop(x, p, counts, w[:E], w[E:], glu)  # noqa: E731
    return _grads(fn, leaves, dy)


COUNTS = [5, 0, 13, 1, 9]


@pytest.mark.parametrize("fused", [None, pytest.param((1.0, 0.0), marks=pytest.mark.skipif(
    not interpreting(), reason="the fused GLU on CPU tensors needs Triton's interpreter"))], ids=["torch-glu", "fused-glu"])
def test_grouped_matches_loop_fp32_cpu(fused):
    want = _run("cpu", torch.float64, COUNTS, grouped=False)
    got = _run("cpu", torch.float32, COUNTS, grouped=True, fused=fused)
    for i, (a, b) in enumerate(zip(got, want)):
        err = ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()
        assert err < 1e-5, (i, err)
    # the expert without tokens gets exactly zero weight gradients
    # (got: output, d x, d probs, then d w1 and d w2 of each expert)
    assert got[3 + 1].abs().max() == 0 and got[3 + len(COUNTS) + 1].abs().max() == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="grouped GEMM kernel on CUDA")
def test_grouped_matches_loop_bf16_cuda():
    counts = [64 * c + 8 for c in COUNTS]
    want = _run("cuda", torch.float64, counts, grouped=False)
    loop = _run("cuda", torch.bfloat16, counts, grouped=False)
    got = _run("cuda", torch.bfloat16, counts, grouped=True, fused=fused_glu(_Cfg))
    assert fused_glu(_Cfg) == (1.0, 0.0)
    for i, (a, ref, b) in enumerate(zip(got, loop, want)):
        scale = b.abs().max().clamp_min(1e-12)
        err, torch_err = ((a - b).abs().max() / scale).item(), ((ref - b).abs().max() / scale).item()
        assert err <= 2 * torch_err + 1e-6, (i, err, torch_err)


def test_topk_permutation_matches_megatron():
    """The local dispatcher's gathers both ways (`permute_topk`, `unpermute_topk`) against
    megatron's permute / unpermute: the same rows in the same order, the same combined output,
    and the same gradients of the tokens and the routing probabilities."""
    from megatron.core.transformer.moe.moe_utils import permute, unpermute

    from msa_model.model.experts import permute_topk, unpermute_topk

    T, E, H, k = 37, 6, 8, 3
    g = torch.Generator().manual_seed(5)
    chosen = torch.rand(T, E, generator=g).topk(k, dim=1).indices
    routing_map = torch.zeros(T, E, dtype=torch.bool).scatter_(1, chosen, True)
    probs = torch.rand(T, E, generator=g) * routing_map
    x = torch.randn(T, H, generator=g)
    w = torch.randn(T * k, H, generator=g)
    dy = torch.randn(T, H, generator=g)

    def run(ours):
        xx, pp = x.clone().requires_grad_(), probs.clone().requires_grad_()
        if ours:
            rows, prow, token, order = permute_topk(xx, routing_map, pp, k)
            y = unpermute_topk(rows * w * prow[:, None], token, order, k)
        else:
            rows, prow, idx, _, _ = permute(xx, routing_map, probs=pp, num_out_tokens=T * k)
            y = unpermute(rows * w * prow[:, None], idx, restore_shape=x.shape, routing_map=routing_map)
        y.backward(dy)
        return rows.detach(), prow.detach(), y.detach(), xx.grad, pp.grad

    for name, a, b in zip(("rows", "row probs", "output", "d x", "d probs"), run(True), run(False)):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), name
