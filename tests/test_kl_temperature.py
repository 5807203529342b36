"""model.msa.kl_temperature (MiniMax's lse_temperature): the KL's student is
softmax(iq.ik * index_scale / temperature) on the support, in the reference and in the Triton
kernels (every teacher path), and the selection never depends on it. On CPU the kernels run in
Triton's interpreter, so shapes are small."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from msa_model.ops import MSASettings, indexer_kl_loss, msa_attention, select_blocks, sparse_attention
from msa_model.ops.indexer_kl.triton import DEFAULT_TUNING
from msa_model.ops.support import support_mask

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
TEMPERATURES = (0.5, 1.0, 2.5)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def case(B, T, Hq, G, D, Di, bs, topk, dense, seed, dtype=torch.float32, doc_cut=None):
    gen = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=gen).to(DEV, dtype)  # noqa: E731
    q, k, v = mk(B, T, Hq, D), mk(B, T, G, D), mk(B, T, G, D)
    iq, ik = mk(B, T, G, Di) * 2, mk(B, T, Di)
    doc = None
    if doc_cut is not None:
        doc = torch.where(torch.arange(T) < doc_cut, 0, doc_cut).to(torch.int32).expand(B, T).contiguous().to(DEV)
    idx = None if dense else select_blocks(iq, ik, block_size=bs, topk=topk, backend="reference", doc_start=doc)
    _, lse = sparse_attention(q, k, v, idx, block_size=bs, backend="reference", doc_start=doc)
    return q, k, v, iq, ik, idx, lse, doc


def kl_and_grads(q, k, iq, ik, idx, lse, bs, backend, temperature, doc=None, tuning=None):
    iq = iq.detach().clone().requires_grad_()
    ik = ik.detach().clone().requires_grad_()
    loss = indexer_kl_loss(q, k, iq, ik, idx, lse, block_size=bs, backend=backend, doc_start=doc, tuning=tuning,
                           temperature=temperature)
    loss.backward()
    return loss.detach(), iq.grad, ik.grad


def plain_kl(q, k, iq, ik, idx, lse, bs, temperature, doc=None):
    """The loss written out in float64 from its definition (no chunks, no shared code with the op
    beyond the support mask): KL(teacher || softmax(z / temperature))."""
    B, T, Hq, D = q.shape
    G, Di = k.shape[2], iq.shape[-1]
    q, k, lse = q.double(), k.double(), lse.double()
    iq = iq.detach().double().requires_grad_()
    ik = ik.detach().double().requires_grad_()
    mask = support_mask(idx, 0, T, T, bs, G, B, q.device, 0, doc)
    s = torch.einsum("btghd,bjgd->btghj", q.view(B, T, G, Hq // G, D), k) / math.sqrt(D)
    s = s.masked_fill(~mask[:, :, :, None, :], -math.inf)
    p = torch.exp(s - lse.view(B, T, G, Hq // G, 1)).mean(3)
    p = p / p.sum(-1, keepdim=True)
    z = torch.einsum("btgi,bji->btgj", iq, ik) / math.sqrt(Di) / temperature
    log_student = torch.log_softmax(z.masked_fill(~mask, -math.inf), -1)
    loss = torch.where(mask, torch.xlogy(p, p) - p * log_student, torch.zeros_like(p)).sum(-1).mean()
    loss.backward()
    return loss.detach(), iq.grad, ik.grad


@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
def test_reference_is_the_kl_of_the_tempered_student(dense, temperature):
    q, k, _, iq, ik, idx, lse, doc = case(2, 45, 4, 2, 16, 16, 16, 3, dense, seed=1, doc_cut=20)
    want = plain_kl(q, k, iq, ik, idx, lse, 16, temperature, doc)
    got = kl_and_grads(q, k, iq, ik, idx, lse, 16, "reference", temperature, doc)
    assert abs(float(got[0]) - float(want[0])) <= 1e-5 * abs(float(want[0]))
    for name, x, w in zip(("d iq", "d ik"), got[1:], want[1:]):
        assert rel(x, w) < 1e-5, name
    if temperature != 1.0:
        # the option does something: another loss than at temperature 1
        plain = kl_and_grads(q, k, iq, ik, idx, lse, 16, "reference", 1.0, doc)
        assert abs(float(plain[0]) - float(got[0])) > 1e-3


@pytest.mark.parametrize("teacher", ["stored", "recompute"])
@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
def test_triton_kernels_take_the_temperature(dense, teacher):
    if dense and teacher == "recompute":
        pytest.skip("the dense mode keeps no teacher")
    tuning = dataclasses.replace(DEFAULT_TUNING, teacher_bytes=0 if teacher == "recompute" else 4 << 30)
    q, k, _, iq, ik, idx, lse, doc = case(1, 63, 4, 2, 16, 32, 16, 3, dense, seed=2, doc_cut=30)
    for temperature in (0.5, 2.5):
        want = kl_and_grads(q, k, iq, ik, idx, lse, 16, "reference", temperature, doc)
        got = kl_and_grads(q, k, iq, ik, idx, lse, 16, "triton", temperature, doc, tuning)
        assert abs(float(got[0]) - float(want[0])) <= 1e-5 * max(1.0, abs(float(want[0])))
        for name, x, w in zip(("d iq", "d ik"), got[1:], want[1:]):
            assert rel(x, w) < 2e-5, (name, temperature)


@pytest.mark.parametrize("kl_teacher", ["forward", "backward"])
def test_msa_attention_passes_the_temperature_to_every_teacher_path(kl_teacher):
    """The layer core on the Triton path: kl_teacher="backward" takes the teacher rows from the
    attention's backward (ops/msa_attention/late_teacher.py), "forward" runs the KL's own kernels; both against
    the float64 reference ops on the same selection at the same temperature, and the selection
    is the one at temperature 1."""
    B, T, Hq, G, D, Di, bs, topk = 1, 70, 4, 2, 16, 16, 16, 3
    gen = torch.Generator().manual_seed(3)
    # fp32 in the interpreter (exact products); the compiled sparse attention takes bf16
    dtype = torch.bfloat16 if CUDA else torch.float32
    leaves = [torch.randn(*s, generator=gen).to(DEV, dtype).requires_grad_()
              for s in ((B, T, Hq, D), (B, T, G, D), (B, T, G, D), (B, T, G, Di), (B, T, Di))]
    do = torch.randn(B, T, Hq, D, generator=gen).to(DEV, dtype)
    runs = {}
    for temperature in (2.0, 1.0):
        settings = MSASettings(bs, topk, kl_teacher=kl_teacher, kl_temperature=temperature, backend="triton")
        o, kl, idx, _ = msa_attention(*leaves, settings)
        grads = torch.autograd.grad([o, kl], leaves, [do, torch.full_like(kl, 0.7)])
        runs[temperature] = (kl.detach(), idx, grads)
    kl, idx, grads = runs[2.0]
    assert torch.equal(idx, runs[1.0][1])
    ref = [x.detach().double().requires_grad_() for x in leaves]
    rq, rk, rv, riq, rik = ref
    ro, rlse = sparse_attention(rq, rk, rv, idx, bs, backend="reference")
    rkl = indexer_kl_loss(rq.detach(), rk.detach(), riq, rik, idx, rlse.detach(), bs, backend="reference",
                          temperature=2.0)
    want = torch.autograd.grad([ro, rkl], ref, [do.double(), torch.full_like(rkl, 0.7)])
    tol = 2e-2 if CUDA else 1e-5
    assert abs(float(kl) - float(rkl)) <= tol * abs(float(rkl))
    assert abs(float(kl) - float(runs[1.0][0])) > 1e-2 * abs(float(rkl))
    for name, x, w in zip(("dq", "dk", "dv", "d iq", "d ik"), grads, want):
        assert rel(x, w) < tol, name


@pytest.mark.parametrize("temperature", [0.0, -1.0, math.inf, math.nan])
def test_a_temperature_that_is_not_positive_is_refused(temperature):
    q, k, _, iq, ik, idx, lse, _ = case(1, 20, 2, 1, 16, 16, 16, 2, False, seed=4)
    with pytest.raises(ValueError, match="KL temperature must be a finite positive number"):
        indexer_kl_loss(q, k, iq, ik, idx, lse, block_size=16, backend="reference", temperature=temperature)
