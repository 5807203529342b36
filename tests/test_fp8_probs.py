"""model.msa.fp8_probs (MiniMax's probability quantization-aware training): the sparse
attention's forward uses its probabilities rounded to float8 e4m3 of P x 448 (P relative to the
query's max over each key block), the backward passes straight through. The reference against an
independent autograd formulation (the straight-through estimator written as MiniMax write it),
the Triton kernels (interpreter on CPU) against the reference, gradients included, and the
layer core with the KL's teacher from the attention's backward."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import triton
import triton.language as tl

from msa_model.ops import MSASettings, indexer_kl_loss, msa_attention, select_blocks, sparse_attention
from msa_model.ops.sparse_attention import triton as sa_triton
from msa_model.ops.sparse_attention.reference import e4m3_round
from msa_model.ops.support import support_mask
from msa_model.ops.triton_utils import e4m3_round as e4m3_kernel

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float32
TOL = 2e-2 if CUDA else 2e-5


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@triton.jit
def _round_kernel(X, Y, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(Y + i, e4m3_kernel(tl.load(X + i)))


def test_e4m3_rounding_is_the_float8_conversion():
    """The arithmetic rounding the kernels and the reference share is torch's float8_e4m3fn cast:
    every normal and subnormal value up to 448 and every midpoint (ties to even)."""
    gen = torch.Generator().manual_seed(0)
    exact = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    exact = exact[torch.isfinite(exact) & (exact >= 0)].sort().values
    midpoints = (exact[:-1] + exact[1:]) / 2
    x = torch.cat([exact, midpoints, torch.rand(3000, generator=gen) * 448, torch.rand(3000, generator=gen) ** 12])
    x = x.clamp(0, 448)
    x = torch.cat([x, torch.zeros(8192 - x.numel())])
    want = x.to(torch.float8_e4m3fn).float()
    assert torch.equal(e4m3_round(x), want)
    y = torch.empty_like(x, device=DEV)
    _round_kernel[(1,)](x.to(DEV), y, N=8192)
    assert torch.equal(y.cpu(), want)


def straight_through(q, k, v, block_idx, bs, doc_start=None):
    """The fp8 forward and its gradients written as the straight-through estimator on the dense
    masked scores (float64): per (query, head) and key block, p = exp(s - m_block), stored as
    e4m3(p x 448) / 448, times exp(m_block - lse); the output takes these values and the
    gradient of the exact softmax (probability = exact + (quantized - exact).detach())."""
    B, T, Hq, D = q.shape
    G = k.shape[2]
    mask = support_mask(block_idx, 0, T, T, bs, G, B, q.device, 0, doc_start)[:, :, :, None, :]
    s = torch.einsum("btghd,bjgd->btghj", q.view(B, T, G, Hq // G, D), k) / math.sqrt(D)
    s = s.masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(s, -1, keepdim=True)
    exact = torch.exp(s - lse)
    pos = torch.arange(T, device=q.device)
    start = torch.zeros(B, T, dtype=torch.long, device=q.device) if doc_start is None else doc_start.long()
    block = ((pos[None, None, :] - start[:, :, None]).clamp(min=0) // bs)[:, :, None, None, :].expand_as(s)
    with torch.no_grad():
        m = torch.full((*s.shape[:-1], T // bs + 2), -math.inf, dtype=s.dtype, device=s.device)
        m = m.scatter_reduce(-1, block, s, "amax").gather(-1, block)
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        quantized = e4m3_round(torch.exp(s - m) * 448).double() / 448 * torch.exp(m - lse)
    probability = exact + (quantized - exact).detach()
    return torch.einsum("btghj,bjgd->btghd", probability, v).reshape(B, T, Hq, D)


def case(B, T, Hq, G, D, bs, topk, seed, doc_cut=None, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=gen).to(DEV, dtype).requires_grad_()  # noqa: E731
    q, k, v = mk(B, T, Hq, D), mk(B, T, G, D), mk(B, T, G, D)
    iq, ik = torch.randn(B, T, G, 16, generator=gen).to(DEV), torch.randn(B, T, 16, generator=gen).to(DEV)
    doc = None
    if doc_cut is not None:
        doc = torch.where(torch.arange(T) < doc_cut, 0, doc_cut).to(torch.int32).expand(B, T).contiguous().to(DEV)
    idx = select_blocks(iq, ik, block_size=bs, topk=topk, backend="reference", doc_start=doc)
    do = torch.randn(B, T, Hq, D, generator=gen).to(DEV, dtype)
    return q, k, v, idx, doc, do


@pytest.mark.parametrize("doc_cut", [None, 29], ids=["one-document", "documents"])
def test_reference_is_the_straight_through_estimator(doc_cut):
    q, k, v, idx, doc, do = case(2, 75, 4, 2, 16, 16, 3, seed=1, doc_cut=doc_cut)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    want = straight_through(*leaves, idx, 16, doc)
    want_grads = torch.autograd.grad(want, leaves, do.double())
    o, _ = sparse_attention(*leaves, idx, block_size=16, backend="reference", doc_start=doc, fp8_probs=True)
    grads = torch.autograd.grad(o, leaves, do.double())
    assert rel(o, want) < 1e-12
    for name, g, w in zip(("dq", "dk", "dv"), grads, want_grads):
        assert rel(g, w) < 1e-12, name
    # the rounding shows in the output and in dv, not in dq and dk (straight through)
    exact, _ = sparse_attention(*leaves, idx, block_size=16, backend="reference", doc_start=doc)
    exact_grads = torch.autograd.grad(exact, leaves, do.double())
    assert rel(o, exact) > 1e-3 and rel(grads[2], exact_grads[2]) > 1e-3
    assert rel(grads[0], exact_grads[0]) < 1e-12 and rel(grads[1], exact_grads[1]) < 1e-12


# (B, T, Hq, G, D, block_size, topk, q_offset, document cut): odd lengths, 1-4 heads a group (3:
# padded head rows), context-parallel offsets, documents
CASES = [
    (1, 70, 4, 2, 16, 16, 3, 0, None),
    (2, 45, 6, 2, 32, 16, 4, 0, 20),
    (1, 50, 4, 1, 16, 16, 2, 30, None),
    (1, 63, 8, 2, 16, 32, 2, 17, 40),
]


@pytest.mark.parametrize("shape", CASES, ids=lambda c: "B{}T{}Hq{}G{}D{}bs{}k{}off{}doc{}".format(*c))
def test_triton_matches_the_reference(shape):
    B, T, Hq, G, D, bs, topk, off, cut = shape
    gen = torch.Generator().manual_seed(T + Hq)
    mk = lambda *s: torch.randn(*s, generator=gen).to(DEV, DTYPE).requires_grad_()  # noqa: E731
    q, k, v = mk(B, T, Hq, D), mk(B, off + T, G, D), mk(B, off + T, G, D)
    doc = None
    if cut is not None:
        pos = off + torch.arange(T)
        doc = torch.where(pos < cut, 0, cut).to(torch.int32).expand(B, T).contiguous().to(DEV)
    iq = torch.randn(B, T, G, 16, generator=gen).to(DEV)
    ik = torch.randn(B, off + T, 16, generator=gen).to(DEV)
    idx = select_blocks(iq, ik, block_size=bs, topk=topk, backend="reference", q_offset=off, doc_start=doc)
    do = torch.randn(B, T, Hq, D, generator=gen).to(DEV, DTYPE)
    kw = dict(block_size=bs, q_offset=off, doc_start=doc, fp8_probs=True)
    o, lse = sparse_attention(q, k, v, idx, backend="triton", **kw)
    grads = torch.autograd.grad(o, (q, k, v), do)
    ref = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ro, rlse = sparse_attention(*ref, idx, backend="reference", **kw)
    want = torch.autograd.grad(ro, ref, do.double())
    assert rel(o, ro) < TOL and (lse.double() - rlse).abs().max().item() < TOL
    for name, g, w in zip(("dq", "dk", "dv"), grads, want):
        assert rel(g, w) < TOL, name


def test_fp8_takes_the_gather_path_whatever_the_tuning():
    """A tuning that sends every call to the tile-union forward (whose online softmax spans
    several blocks) still gives the fp8 result: fp8 calls take the gather path."""
    hybrid = dataclasses.replace(sa_triton.DEFAULT_TUNING, tile_rows=8, tile_keys=16, tile_min_heads=1,
                                 tile_min_queries=0, tile_union_max=100.0)
    q, k, v, idx, doc, do = case(1, 70, 4, 2, 16, 16, 3, seed=2, dtype=DTYPE)
    o, _ = sparse_attention(q, k, v, idx, block_size=16, backend="triton", fp8_probs=True, tuning=hybrid)
    ro, _ = sparse_attention(*(x.detach().double() for x in (q, k, v)), idx, block_size=16, backend="reference",
                             fp8_probs=True)
    assert rel(o, ro) < TOL


def test_dense_attention_refuses_fp8():
    q, k, v, _, _, _ = case(1, 20, 2, 1, 16, 16, 2, seed=3)
    with pytest.raises(ValueError, match="fp8_probs applies to the sparse attention"):
        sparse_attention(q, k, v, None, block_size=16, backend="reference", fp8_probs=True)


@pytest.mark.parametrize("kl_teacher", ["forward", "backward"])
def test_msa_attention_with_fp8_probabilities(kl_teacher):
    """The layer core: fp8 output and dv, the KL's teacher (from the attention's backward, or its
    own forward) the exact softmax's; against the float64 reference ops on the same selection."""
    B, T, Hq, G, D, Di, bs, topk = 1, 70, 4, 2, 16, 16, 16, 3
    gen = torch.Generator().manual_seed(9)
    leaves = [torch.randn(*s, generator=gen).to(DEV, DTYPE).requires_grad_()
              for s in ((B, T, Hq, D), (B, T, G, D), (B, T, G, D), (B, T, G, Di), (B, T, Di))]
    do = torch.randn(B, T, Hq, D, generator=gen).to(DEV, DTYPE)
    o, kl, idx, _ = msa_attention(*leaves, MSASettings(bs, topk, kl_teacher=kl_teacher, fp8_probs=True,
                                                       backend="triton"))
    grads = torch.autograd.grad([o, kl], leaves, [do, torch.full_like(kl, 0.7)])
    ref = [x.detach().double().requires_grad_() for x in leaves]
    rq, rk, rv, riq, rik = ref
    ro, rlse = sparse_attention(rq, rk, rv, idx, bs, backend="reference", fp8_probs=True)
    rkl = indexer_kl_loss(rq.detach(), rk.detach(), riq, rik, idx, rlse.detach(), bs, backend="reference")
    want = torch.autograd.grad([ro, rkl], ref, [do.double(), torch.full_like(rkl, 0.7)])
    assert rel(o, ro) < TOL and abs(kl.item() - rkl.item()) <= TOL * abs(rkl.item())
    for name, g, w in zip(("dq", "dk", "dv", "d iq", "d ik"), grads, want):
        assert rel(g, w) < TOL, name


def test_training_takes_minimax_options(tmp_path, data_cache):
    """model.msa.fp8_probs and model.msa.kl_temperature reach every MSA layer of a training run
    (through the warmup into the sparse phase)."""
    from skeleton_helpers import metrics, run_train

    run = tmp_path / "run"
    run_train(run, "trainer.max_steps=3", "trainer.indexer_warmup_tokens=1024", "checkpoint.interval=0",
              "checkpoint.save_at_end=false", "model.msa.fp8_probs=true", "model.msa.kl_temperature=2.0",
              data_cache=data_cache)
    rows = metrics(run)
    assert [rows[s]["phase"] for s in (1, 2, 3)] == ["warmup", "sparse", "sparse"]
    assert all(math.isfinite(rows[s]["lm_loss"]) and math.isfinite(rows[s]["kl_loss"]) for s in rows)
    config = (run / "config.yaml").read_text()
    assert "fp8_probs: true" in config and "kl_temperature: 2.0" in config
