"""The fused Triton indexer KL against the reference: loss, d iq, d ik, sparse and dense modes.

On CPU the kernels run in Triton's interpreter (tests/conftest.py), so shapes are small; the
large-shape test runs only where CUDA is present.
"""

import dataclasses
import math

import pytest
import torch

from msa_model.ops import indexer_kl_loss, select_blocks, sparse_attention
from msa_model.ops.indexer_kl.triton import DEFAULT_TUNING
from msa_model.ops.support import support_mask

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def make_case(B, T, Hq, G, D, Di, block_size, topk, dense, dtype, seed, device=DEV):
    gen = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=gen).to(device=device, dtype=dtype)  # noqa: E731
    q, k, v = mk(B, T, Hq, D), mk(B, T, G, D), mk(B, T, G, D)
    # a sharper student than unit-variance inputs give, so the KL is not dominated by noise
    iq, ik = mk(B, T, G, Di) * 2, mk(B, T, Di)
    block_idx = None
    if not dense:
        block_idx = select_blocks(iq, ik, block_size=block_size, topk=topk, backend="reference")
    _, lse = sparse_attention(q, k, v, block_idx, block_size=block_size, backend="reference")
    return q, k, iq, ik, block_idx, lse


def loss_and_grads(q, k, iq, ik, block_idx, lse, block_size, backend, upcast=None, tuning=None):
    if upcast is not None:
        q, k, iq, ik, lse = (x.to(upcast) for x in (q, k, iq, ik, lse))
    iq = iq.detach().clone().requires_grad_()
    ik = ik.detach().clone().requires_grad_()
    loss = indexer_kl_loss(q, k, iq, ik, block_idx, lse, block_size=block_size, backend=backend, tuning=tuning)
    loss.backward()
    return loss.detach(), iq.grad, ik.grad


def torch_in_dtype(q, k, iq, ik, block_idx, lse, block_size):
    """The loss written plainly in the inputs' dtype (every op in bf16): the error PyTorch itself
    makes, the yardstick of the kernel's error."""
    B, T, Hq, D = q.shape
    G = k.shape[2]
    H = Hq // G
    iq = iq.detach().clone().requires_grad_()
    ik = ik.detach().clone().requires_grad_()
    mask = support_mask(block_idx, 0, T, T, block_size, G, B, q.device)
    s = torch.einsum("btghd,bjgd->btghj", q.view(B, T, G, H, D), k) * (1 / math.sqrt(D))
    s = s.masked_fill(~mask[:, :, :, None, :], -math.inf)
    p = torch.exp(s - lse.to(q.dtype).view(B, T, G, H, 1)).mean(3)
    p = p / p.sum(-1, keepdim=True)
    z = torch.einsum("btgi,bji->btgj", iq, ik) * (1 / math.sqrt(iq.shape[-1]))
    log_pi = torch.log_softmax(z.masked_fill(~mask, -math.inf), -1)
    terms = torch.where(mask, torch.xlogy(p, p) - p * log_pi, torch.zeros_like(p))
    loss = terms.sum(-1).mean()
    loss.backward()
    return loss.detach(), iq.grad, ik.grad


@pytest.fixture(params=["stored", "recompute"])
def teacher(request):
    """Sparse backward with the forward's teacher rows kept, or recomputed (see `kl_tuning`)."""
    return request.param


def kl_tuning(teacher: str, **overrides):
    """The Triton KL's tuning for a teacher mode ("recompute": teacher_bytes = 0), with overrides."""
    if teacher == "recompute":
        overrides["teacher_bytes"] = 0
    return dataclasses.replace(DEFAULT_TUNING, **overrides)


def rel(x, ref):
    x, ref = x.double(), ref.double()
    assert torch.isfinite(x).all()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


# (B, T, Hq, G, D, Di, block_size, topk): odd lengths, G (groups) in {1, 2, 4}, heads per group 1-4
SHAPES = [
    (1, 1, 2, 1, 16, 16, 16, 2),
    (2, 63, 4, 2, 16, 32, 16, 3),
    (1, 100, 4, 4, 32, 16, 32, 2),
    (2, 63, 8, 2, 16, 16, 32, 4),
    (1, 200, 4, 1, 16, 32, 16, 4),
]


@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}T{}Hq{}G{}D{}Di{}bs{}k{}".format(*s))
def test_fp32_matches_reference(shape, dense, teacher):
    if dense and teacher == "recompute":
        pytest.skip("the dense mode keeps no teacher")
    B, T, Hq, G, D, Di, bs, topk = shape
    case = make_case(B, T, Hq, G, D, Di, bs, topk, dense, torch.float32, seed=T + G)
    ref = loss_and_grads(*case, bs, "reference")
    out = loss_and_grads(*case, bs, "triton", tuning=kl_tuning(teacher))
    assert out[0].dtype == torch.float32 and out[0].dim() == 0
    assert abs(float(out[0]) - float(ref[0])) <= 1e-5 * max(1.0, abs(float(ref[0])))
    for name, x, r in zip(("d iq", "d ik"), out[1:], ref[1:]):
        assert x.dtype == torch.float32
        # one query and one key: the exact gradient is 0 and a GPU's exp2 leaves ~1e-8
        assert (x - r).norm() <= 2e-5 * r.norm() + 1e-6, (name, rel(x, r))


@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[2]], ids=["T63G2", "T100G4"])
def test_bf16_within_torch_error(shape, dense, teacher):
    if dense and teacher == "recompute":
        pytest.skip("the dense mode keeps no teacher")
    B, T, Hq, G, D, Di, bs, topk = shape
    case = make_case(B, T, Hq, G, D, Di, bs, topk, dense, torch.bfloat16, seed=7 * T + G)
    truth = loss_and_grads(*case, bs, "reference", upcast=torch.float64)
    out = loss_and_grads(*case, bs, "triton", tuning=kl_tuning(teacher))
    pt = torch_in_dtype(*case, bs)
    for name, x, p, t in zip(("loss", "d iq", "d ik"), out, pt, truth):
        if name != "loss":
            assert x.dtype == torch.bfloat16
        assert rel(x, t) <= 2 * rel(p, t) + 2e-3, name


@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
def test_heads_over_several_teacher_dots(teacher, dense):
    """8 heads per group with teacher dots of 2 heads: the group mean is summed over 4 dots (in the
    forward and, with the teacher recomputed, in the backward)."""
    tuning = kl_tuning(teacher, rows=2 * DEFAULT_TUNING.M, dense_rows=2 * DEFAULT_TUNING.M)
    B, T, Hq, G, D, Di, bs, topk = 1, 90, 16, 2, 16, 16, 16, 3
    if dense and teacher == "recompute":
        pytest.skip("the dense mode keeps no teacher")
    case = make_case(B, T, Hq, G, D, Di, bs, topk, dense, torch.float32, seed=5)
    ref = loss_and_grads(*case, bs, "reference")
    out = loss_and_grads(*case, bs, "triton", tuning=tuning)
    assert abs(float(out[0]) - float(ref[0])) <= 1e-5 * max(1.0, abs(float(ref[0])))
    for name, x, r in zip(("d iq", "d ik"), out[1:], ref[1:]):
        assert rel(x, r) < 2e-5, name


def test_slots_empty_repeated_and_past_the_query(teacher):
    """Hand-made selections: -1 slots, a block named twice, blocks after the query's own; popular
    blocks split over several programs."""
    tuning = kl_tuning(teacher, stored_M=16, fwd_per_program=16, bwd_per_program=32)
    B, T, Hq, G, D, Di, bs = 1, 70, 4, 2, 16, 16, 16
    q, k, iq, ik, _, _ = make_case(B, T, Hq, G, D, Di, bs, 2, True, torch.float32, seed=3)
    gen = torch.Generator().manual_seed(4)
    n_blocks = (T + bs - 1) // bs
    block_idx = torch.randint(-1, n_blocks, (B, T, G, 4), generator=gen, dtype=torch.int32)
    block_idx[..., 0] = block_idx[..., 1]
    block_idx[..., 3] = (torch.arange(T, dtype=torch.int32) // bs)[None, :, None]
    block_idx = block_idx.to(DEV)
    v = torch.randn_like(k)
    _, lse = sparse_attention(q, k, v, block_idx, block_size=bs, backend="reference")
    ref = loss_and_grads(q, k, iq, ik, block_idx, lse, bs, "reference")
    out = loss_and_grads(q, k, iq, ik, block_idx, lse, bs, "triton", tuning=tuning)
    assert abs(float(out[0]) - float(ref[0])) <= 1e-5 * max(1.0, abs(float(ref[0])))
    assert rel(out[1], ref[1]) < 2e-5 and rel(out[2], ref[2]) < 2e-5


@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
def test_no_gradient_to_q_k_and_every_row_written(dense, monkeypatch, teacher):
    if dense and teacher == "recompute":
        pytest.skip("the dense mode keeps no teacher")
    B, T, Hq, G, D, Di, bs = 1, 45, 4, 2, 16, 16, 16
    q, k, iq, ik, block_idx, lse = make_case(B, T, Hq, G, D, Di, bs, 2, dense, torch.float32, seed=5)
    ref = loss_and_grads(q, k, iq, ik, block_idx, lse, bs, "reference")
    # uninitialised buffers become NaN (integer ones -7): a row a kernel forgets to write fails
    # the comparison
    empty, empty_like = torch.empty, torch.empty_like
    poison = lambda x: x.fill_(math.nan if x.is_floating_point() else -7)  # noqa: E731
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: poison(empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: poison(empty_like(*a, **kw)))
    q, k = q.clone().requires_grad_(), k.clone().requires_grad_()
    iq, ik = iq.clone().requires_grad_(), ik.clone().requires_grad_()
    loss = indexer_kl_loss(q, k, iq, ik, block_idx, lse, block_size=bs, backend="triton", tuning=kl_tuning(teacher))
    loss.backward()
    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch, "empty_like", empty_like)
    assert q.grad is None and k.grad is None
    assert abs(float(loss) - float(ref[0])) <= 1e-5 * max(1.0, abs(float(ref[0])))
    assert rel(iq.grad, ref[1]) < 2e-5 and rel(ik.grad, ref[2]) < 2e-5


@pytest.mark.skipif(not CUDA, reason="large shapes need a GPU")
@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
def test_large_bf16_on_gpu(dense, teacher):
    if dense and teacher == "recompute":
        pytest.skip("the dense mode keeps no teacher")
    B, T, Hq, G, D, Di, bs, topk = 1, 3000, 64, 4, 128, 128, 128, 16
    case = make_case(B, T, Hq, G, D, Di, bs, topk, dense, torch.bfloat16, seed=11)
    truth = loss_and_grads(*case, bs, "reference", upcast=torch.float64)
    out = loss_and_grads(*case, bs, "triton", tuning=kl_tuning(teacher))
    pt = torch_in_dtype(*case, bs)
    for name, x, p, t in zip(("loss", "d iq", "d ik"), out, pt, truth):
        assert rel(x, t) <= 2 * rel(p, t) + 2e-3, name
