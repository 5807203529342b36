"""Queries that are a slice of the sequence (`q_offset`, used by context parallelism): every op on
each slice against the full keys equals those rows of the one-call result, gradients included."""

from __future__ import annotations

import pytest
import torch

from msa_model.ops import indexer_kl_loss, msa_attention, select_blocks, sparse_attention

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
    o, kl, idx = msa_attention(q, k, v, iq, ik, block_size=block_size, topk=topk, dense=dense,
                               backend="reference", return_block_idx=True)
    w = torch.randn(o.shape, generator=torch.Generator().manual_seed(1), dtype=o.dtype)
    full_grads = torch.autograd.grad((o * w).sum() + 3.0 * kl, leaves)

    parts_o, parts_kl = [], 0.0
    for t0, t1 in splits:
        o_p, kl_p, idx_p = msa_attention(q[:, t0:t1], k, v, iq[:, t0:t1], ik, block_size=block_size, topk=topk,
                                         dense=dense, backend="reference", return_block_idx=True, q_offset=t0)
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
    for call in (lambda: select_blocks(iq[:, 8:], ik, block_size=8, topk=2, backend="triton", q_offset=8),
                 lambda: sparse_attention(q[:, 8:], k, v, None, block_size=8, backend="triton", q_offset=8),
                 lambda: msa_attention(q[:, 8:], k, v, iq[:, 8:], ik, block_size=8, topk=2, dense=True,
                                       backend="triton", q_offset=8)):
        with pytest.raises(NotImplementedError, match="q_offset"):
            call()
