"""Queries that are a slice of the sequence (`q_offset`, used by context parallelism): every op on
each slice against the full keys equals those rows of the one-call result, gradients included."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from msa_model.ops import MSASettings, indexer_kl_loss, msa_attention, select_blocks, sparse_attention

B, T, HQ, HKV, D, DI = 2, 63, 4, 2, 16, 8


def _inputs(seed: int = 0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    return mk(B, T, HQ, D), mk(B, T, HKV, D), mk(B, T, HKV, D), mk(B, T, HKV, DI), mk(B, T, DI)


# a context-parallel-like split (uneven on purpose) and the 2*cp load-balanced layout of cp=2
SPLITS = [[(0, 20), (20, 41), (41, 63)], [(0, 16), (48, 63), (16, 32), (32, 48)]]


@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("block_size,topk", [(8, 3), (16, 2)])
def test_select_blocks_slices_match_full(splits, block_size, topk):
    _, _, _, iq, ik = _inputs()
    full = select_blocks(iq, ik, block_size=block_size, topk=topk, backend="reference")
    for t0, t1 in splits:
        part = select_blocks(iq[:, t0:t1], ik, block_size=block_size, topk=topk, backend="reference", q_offset=t0)
        assert torch.equal(part, full[:, t0:t1]), (t0, t1)


@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("dense", [True, False])
def test_msa_attention_slices_match_full(splits, dense):
    """Outputs, block ids, the KL (row-count weighted) and every gradient (k, v, ik summed over
    slices) equal the full call's."""
    block_size, topk = 8, 3
    leaves = [t.requires_grad_() for t in _inputs()]
    q, k, v, iq, ik = leaves
    settings = MSASettings(block_size=block_size, topk=topk, backend="reference")
    o, kl, idx, _ = msa_attention(q, k, v, iq, ik, settings, dense=dense)
    w = torch.randn(o.shape, generator=torch.Generator().manual_seed(1), dtype=o.dtype)
    full_grads = torch.autograd.grad((o * w).sum() + 3.0 * kl, leaves)

    parts_o, parts_kl = [], 0.0
    for t0, t1 in splits:
        o_p, kl_p, idx_p, _ = msa_attention(q[:, t0:t1], k, v, iq[:, t0:t1], ik, settings, dense=dense, q_offset=t0)
        torch.testing.assert_close(o_p, o[:, t0:t1], rtol=1e-12, atol=1e-12)
        if not dense:
            assert torch.equal(idx_p, idx[:, t0:t1])
        parts_o.append((t0, t1, o_p))
        parts_kl = parts_kl + kl_p * (t1 - t0) / T
    torch.testing.assert_close(parts_kl, kl, rtol=1e-12, atol=1e-12)
    loss = sum((o_p * w[:, t0:t1]).sum() for t0, t1, o_p in parts_o) + 3.0 * parts_kl
    split_grads = torch.autograd.grad(loss, leaves)
    for name, a, b in zip("q k v iq ik".split(), split_grads, full_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)


def test_sparse_attention_and_kl_accept_longer_keys():
    """Keys past the queries' last position are ignored (cut before the kernel runs)."""
    q, k, v, iq, ik = _inputs()
    idx = select_blocks(iq[:, 10:30], ik, block_size=8, topk=3, backend="reference", q_offset=10)
    o_long, lse_long = sparse_attention(q[:, 10:30], k, v, idx, block_size=8, backend="reference", q_offset=10)
    o_cut, lse_cut = sparse_attention(q[:, 10:30], k[:, :30], v[:, :30], idx, block_size=8, backend="reference",
                                      q_offset=10)
    assert torch.equal(o_long, o_cut) and torch.equal(lse_long, lse_cut)
    kl_long = indexer_kl_loss(q[:, 10:30], k, iq[:, 10:30], ik, idx, lse_long, block_size=8, backend="reference",
                              q_offset=10)
    kl_cut = indexer_kl_loss(q[:, 10:30], k[:, :30], iq[:, 10:30], ik[:, :30], idx, lse_long, block_size=8,
                             backend="reference", q_offset=10)
    assert torch.equal(kl_long, kl_cut)


def test_q_offset_checks():
    q, k, v, iq, ik = _inputs()
    with pytest.raises(ValueError, match="q_offset"):
        sparse_attention(q[:, 40:], k[:, :50], v[:, :50], None, block_size=8, backend="reference", q_offset=40)
    with pytest.raises(ValueError, match="q_offset"):
        select_blocks(iq, ik, block_size=8, topk=2, backend="reference", q_offset=-1)
    with pytest.raises(ValueError, match="q_offset"):
        sparse_attention(q, k[:, :10], v[:, :10], None, block_size=8, backend="reference")


# the Triton kernels (Triton's interpreter on CPU, fp32 there: its bf16 dot is wrong): each slice
# against the reference with the same q_offset, and the slices together against one q_offset=0 call
TK, TQ_SLICES = 200, [(0, 37), (37, 130), (130, 200)]
TRITON_DTYPE = torch.float32 if not torch.cuda.is_available() else torch.bfloat16
TRITON_DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _triton_inputs(G: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(TRITON_DEV, TRITON_DTYPE)  # noqa: E731
    return mk(1, TK, 2 * G, D), mk(1, TK, G, D), mk(1, TK, G, D), mk(1, TK, G, 16) * 2, mk(1, TK, 16)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _tol(fp32: float) -> float:
    return fp32 if TRITON_DTYPE == torch.float32 else 2e-2


@pytest.mark.parametrize("G,block_size", [(1, 16), (2, 32), (2, 16)])
def test_triton_select_blocks_q_offset(G, block_size):
    _, _, _, iq, ik = _triton_inputs(G)
    full = select_blocks(iq, ik, block_size=block_size, topk=3, force_sink=True, backend="triton")
    parts = []
    for t0, t1 in TQ_SLICES:
        part = select_blocks(iq[:, t0:t1], ik, block_size=block_size, topk=3, force_sink=True, backend="triton",
                             q_offset=t0)
        ref = select_blocks(iq[:, t0:t1], ik, block_size=block_size, topk=3, force_sink=True, backend="reference",
                            q_offset=t0)
        assert torch.equal(part.sort(-1).values, ref.sort(-1).values), (t0, t1)
        parts.append(part)
    assert torch.equal(torch.cat(parts, 1).sort(-1).values, full.sort(-1).values)


def _attention(q, k, v, idx, block_size, backend, q_offset, w):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    o, lse = sparse_attention(q, k, v, idx, block_size=block_size, backend=backend, q_offset=q_offset)
    (o.float() * w).sum().backward()
    return o, lse, q.grad, k.grad, v.grad


@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
@pytest.mark.parametrize("G,block_size", [(1, 16), (2, 32)])
def test_triton_sparse_attention_q_offset(G, block_size, dense):
    q, k, v, iq, ik = _triton_inputs(G, seed=1)
    idx = None if dense else select_blocks(iq, ik, block_size=block_size, topk=3, backend="reference")
    w = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(TRITON_DEV)
    full = _attention(q, k, v, idx, block_size, "triton", 0, w)
    o_parts, lse_parts, dq_parts, dk, dv = [], [], [], 0, 0
    for t0, t1 in TQ_SLICES:
        idx_p = None if idx is None else idx[:, t0:t1]
        out = _attention(q[:, t0:t1], k, v, idx_p, block_size, "triton", t0, w[:, t0:t1])
        ref = _attention(q[:, t0:t1], k, v, idx_p, block_size, "reference", t0, w[:, t0:t1])
        for name, x, r in zip(("o", "lse", "dq", "dk", "dv"), out, ref):
            assert not torch.isnan(x).any(), (name, t0)
            assert _rel(x, r) < _tol(1e-5), (name, t0, _rel(x, r))
        o_parts.append(out[0]), lse_parts.append(out[1]), dq_parts.append(out[2])
        dk, dv = dk + out[3].double(), dv + out[4].double()
    for name, x, r in zip(("o", "lse", "dq", "dk", "dv"),
                          (torch.cat(o_parts, 1), torch.cat(lse_parts, 1), torch.cat(dq_parts, 1), dk, dv), full):
        assert _rel(x, r) < _tol(1e-5), (name, _rel(x, r))


def _kl(q, k, iq, ik, idx, lse, block_size, backend, q_offset, tuning=None):
    iq, ik = (x.detach().clone().requires_grad_() for x in (iq, ik))
    loss = indexer_kl_loss(q, k, iq, ik, idx, lse, block_size=block_size, backend=backend, q_offset=q_offset,
                           tuning=tuning)
    loss.backward()
    return loss.detach(), iq.grad, ik.grad


@pytest.mark.parametrize("teacher_bytes", [None, 0], ids=["stored", "recompute"])
@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
@pytest.mark.parametrize("G,block_size", [(1, 16), (2, 32)])
def test_triton_indexer_kl_q_offset(G, block_size, dense, teacher_bytes):
    if dense and teacher_bytes == 0:
        pytest.skip("the dense mode keeps no teacher")
    from msa_model.ops.indexer_kl.triton import DEFAULT_TUNING

    tuning = DEFAULT_TUNING
    if teacher_bytes is not None:
        tuning = dataclasses.replace(DEFAULT_TUNING, teacher_bytes=teacher_bytes)
    q, k, v, iq, ik = _triton_inputs(G, seed=3)
    idx = None if dense else select_blocks(iq, ik, block_size=block_size, topk=3, backend="reference")
    _, lse = sparse_attention(q, k, v, idx, block_size=block_size, backend="reference")
    full = _kl(q, k, iq, ik, idx, lse, block_size, "triton", 0, tuning)
    loss, diq_parts, dik = 0.0, [], 0
    for t0, t1 in TQ_SLICES:
        args = (q[:, t0:t1], k, iq[:, t0:t1], ik, None if idx is None else idx[:, t0:t1], lse[:, t0:t1], block_size)
        out, ref = _kl(*args, "triton", t0, tuning), _kl(*args, "reference", t0)
        assert abs(float(out[0]) - float(ref[0])) <= _tol(1e-5) * max(1.0, abs(float(ref[0]))), t0
        for name, x, r in zip(("d iq", "d ik"), out[1:], ref[1:]):
            assert _rel(x, r) < _tol(2e-5), (name, t0, _rel(x, r))
        # the loss is a mean over this call's rows: weight each slice by its share of the sequence
        share = (t1 - t0) / TK
        loss += float(out[0]) * share
        diq_parts.append(out[1].double() * share)
        dik = dik + out[2].double() * share
    assert abs(loss - float(full[0])) <= _tol(1e-5) * max(1.0, abs(float(full[0])))
    assert _rel(torch.cat(diq_parts, 1), full[1]) < _tol(2e-5)
    assert _rel(dik, full[2]) < _tol(2e-5)
