"""Several forced local blocks (`local_blocks`, MiniMax-M3's `index_local_blocks`): the Triton
select_blocks equals the reference, and both keep the blocks t // Bk - l for l < local_blocks
plus the best other blocks by fp64 block score.

On CPU the Triton kernel runs in Triton's interpreter (tests/conftest.py), so shapes stay small.
"""

import pytest
import torch

from msa_model.ops import select_blocks

DEV = "cuda" if torch.cuda.is_available() else "cpu"

CASES = [
    # B, T, G, Di, block_size, topk, local_blocks, force_sink, q_offset
    (1, 63, 1, 16, 16, 3, 2, False, 0),
    (2, 100, 2, 16, 16, 4, 3, True, 0),
    (1, 130, 3, 20, 16, 5, 2, True, 0),
    (1, 97, 4, 32, 32, 4, 4, False, 0),
    (1, 45, 2, 16, 16, 6, 3, False, 0),  # fewer visible blocks than topk everywhere
    (1, 70, 2, 16, 16, 4, 2, False, 37),  # a slice of the queries (context parallelism)
]


def _index(B, T, G, Di, seed, q_offset=0):
    g = torch.Generator().manual_seed(seed)
    iq = torch.randn(B, T, G, Di, generator=g).to(DEV)
    ik = torch.randn(B, q_offset + T, Di, generator=g).to(DEV)
    return iq, ik


def _block_scores64(iq, ik, block_size, q_offset):
    """float64 [B, T, G, N] block maxima over causal keys, -inf where none is visible."""
    B, T, G, _ = iq.shape
    TK = ik.shape[1]
    s = torch.einsum("btgi,bji->btgj", iq.double(), ik.double())
    qpos = q_offset + torch.arange(T, device=iq.device)
    s = s.masked_fill(torch.arange(TK, device=iq.device)[None, None, None, :] > qpos[None, :, None, None], float("-inf"))
    n = -(-TK // block_size)
    s = torch.nn.functional.pad(s, (0, n * block_size - TK), value=float("-inf"))
    return s.view(B, T, G, n, block_size).amax(-1)


def _check_selection(idx, bs64, block_size, topk, local_blocks, force_sink, q_offset):
    """Structure (forced blocks, -1 count, causality, no repeats) and optimality of the free picks."""
    B, T, G, N = bs64.shape
    idx = idx.long()
    nloc = ((q_offset + torch.arange(T, device=idx.device)) // block_size)[None, :, None]
    assert torch.equal((idx < 0).sum(-1), (topk - (nloc + 1)).clamp(min=0).expand(B, T, G))
    assert bool((idx <= nloc[..., None]).all())
    srt = idx.sort(-1).values
    assert not bool(((srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)).any())
    n_N = torch.arange(N, device=idx.device)
    forced = (n_N <= nloc[..., None]) & (n_N > nloc[..., None] - local_blocks)
    if force_sink and local_blocks < topk:
        forced = forced | (n_N == 0)
    chosen = torch.zeros(B, T, G, N + 1, dtype=torch.bool, device=idx.device)
    chosen.scatter_(-1, torch.where(idx < 0, N, idx), True)
    chosen = chosen[..., :N]
    assert bool((chosen | ~forced).all()), "a forced block is missing"
    free_sel = torch.where(chosen & ~forced, bs64, float("inf")).amin(-1)
    best_unsel = torch.where(~chosen & ~forced & (n_N <= nloc[..., None]), bs64, float("-inf")).amax(-1)
    assert bool((best_unsel <= free_sel + 1e-4).all())


GPU = [
    (2, 4096, 4, 128, 128, 16, 2, False, 0),
    (1, 3000, 8, 64, 64, 8, 3, True, 1000),
]


@pytest.mark.parametrize("B, T, G, Di, block_size, topk, local_blocks, force_sink, q_offset",
                         CASES + [pytest.param(*c, marks=pytest.mark.skipif(DEV != "cuda", reason="needs a GPU"))
                                  for c in GPU])
def test_local_blocks_triton_equals_reference(B, T, G, Di, block_size, topk, local_blocks, force_sink, q_offset):
    iq, ik = _index(B, T, G, Di, seed=T + local_blocks, q_offset=q_offset)
    kw = dict(block_size=block_size, topk=topk, force_sink=force_sink, q_offset=q_offset, local_blocks=local_blocks)
    ref = select_blocks(iq, ik, backend="reference", **kw)
    tri = select_blocks(iq, ik, backend="triton", **kw)
    assert torch.equal(ref.long().sort(-1).values, tri.long().sort(-1).values)
    # the kernel's layout: local block in slot 0, the one before it in slot 1, -1 padding last
    nloc = (q_offset + torch.arange(T, device=tri.device)) // block_size
    assert torch.equal(tri[..., 0].long(), nloc[None, :, None].expand(B, T, G))
    if local_blocks > 1:
        has_prev = nloc >= 1
        assert torch.equal(tri[:, has_prev, :, 1].long(), (nloc[has_prev] - 1)[None, :, None].expand(B, -1, G))
    empty = tri < 0
    assert not bool((empty[..., :-1] & ~empty[..., 1:]).any())
    _check_selection(ref, _block_scores64(iq, ik, block_size, q_offset), block_size, topk, local_blocks, force_sink,
                     q_offset)


def test_local_blocks_one_is_the_default():
    iq, ik = _index(1, 90, 2, 16, seed=3)
    for backend in ("reference", "triton"):
        assert torch.equal(select_blocks(iq, ik, 16, 3, backend=backend),
                           select_blocks(iq, ik, 16, 3, backend=backend, local_blocks=1))


@pytest.mark.parametrize("local_blocks", [0, 5, 2.0])
def test_local_blocks_out_of_range(local_blocks):
    iq, ik = _index(1, 32, 1, 16, seed=0)
    with pytest.raises(ValueError, match=r"local_blocks must be an int in \[1, topk=4\]"):
        select_blocks(iq, ik, 16, 4, local_blocks=local_blocks)
