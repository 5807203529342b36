"""The Triton select_blocks against the reference: on CPU under Triton's interpreter (small shapes),
on the GPU at large shapes when one is present.

Block ids are a set per (b, t, g): both sides are sorted before comparing.
"""

import pytest
import torch

from msa_model.ops import select_blocks
from msa_model.ops.select_blocks import select_blocks_reference
from msa_model.ops.select_blocks.triton import block_scores_triton, topk_blocks_triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def rand_index(B, T, G, Di, dtype=torch.float32, seed=0, device=DEV):
    g = torch.Generator().manual_seed(seed)
    iq = torch.randn(B, T, G, Di, generator=g).to(dtype).to(device)
    ik = torch.randn(B, T, Di, generator=g).to(dtype).to(device)
    return iq, ik


def as_sets(idx):
    return idx.long().sort(-1).values


def block_scores64(iq, ik, block_size):
    """float64 [B, T, G, N] block maxima over causal keys, -inf where none is visible (naive)."""
    B, T, G, _ = iq.shape
    s = torch.einsum("btgi,bji->btgj", iq.double(), ik.double())
    pos = torch.arange(T, device=iq.device)
    s = s.masked_fill(pos[None, None, None, :] > pos[None, :, None, None], float("-inf"))
    n = -(-T // block_size)
    s = torch.nn.functional.pad(s, (0, n * block_size - T), value=float("-inf"))
    return s.view(B, T, G, n, block_size).amax(-1)


def check_valid_topk(idx, bs64, block_size, topk, force_sink, tol):
    """Structural checks, and no unselected visible block beats a selected free one by more than `tol`."""
    B, T, G, N = bs64.shape
    idx = idx.long()
    t = torch.arange(T, device=idx.device)
    nloc = (t // block_size)[None, :, None]
    n_vis = nloc + 1
    # -1 padding: exactly max(0, topk - visible) empty slots per row
    assert torch.equal((idx < 0).sum(-1), (topk - n_vis).clamp(min=0).expand(B, T, G))
    # nothing past the causal horizon, no repeats
    assert bool((idx <= nloc[..., None]).all())
    srt = idx.sort(-1).values
    assert not bool(((srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)).any())
    # the local block (and the sink) always in
    assert bool((idx == nloc[..., None]).any(-1).all())
    if force_sink:
        assert bool((idx == 0).any(-1).all())
    chosen = torch.zeros(B, T, G, N + 1, dtype=torch.bool, device=idx.device)
    chosen.scatter_(-1, torch.where(idx < 0, N, idx), True)
    chosen = chosen[..., :N]
    forced = torch.arange(N, device=idx.device) == nloc[..., None]
    if force_sink:
        forced = forced | (torch.arange(N, device=idx.device) == 0)
    free_sel = torch.where(chosen & ~forced, bs64, float("inf")).amin(-1)
    best_unsel = torch.where(~chosen & ~forced, bs64, float("-inf")).amax(-1)
    gap = best_unsel - free_sel
    assert bool((gap <= tol).all()), f"a dropped block beats a kept one by {gap.max().item():.3g}"


SMALL = [
    # B, T, G, Di, block_size, topk, force_sink
    (1, 1, 1, 16, 32, 4, False),
    (2, 63, 2, 16, 16, 8, True),
    (1, 200, 4, 32, 32, 4, False),
    (1, 130, 3, 20, 32, 4, True),
    (1, 256, 8, 32, 64, 16, False),
    (1, 250, 1, 32, 16, 16, True),
    (1, 96, 4, 16, 32, 16, False),  # fewer visible blocks than topk everywhere
]
LARGE = [
    (2, 4096, 4, 128, 128, 16, False),
    (1, 3000, 8, 64, 64, 8, True),
    (1, 5000, 2, 128, 32, 4, False),
    (1, 2049, 1, 64, 128, 16, True),
]
CASES = LARGE if DEV == "cuda" else SMALL


@pytest.mark.parametrize("B,T,G,Di,block_size,topk,force_sink", CASES)
def test_same_sets_as_reference_fp32(B, T, G, Di, block_size, topk, force_sink):
    iq, ik = rand_index(B, T, G, Di, seed=T + G)
    ref = select_blocks_reference(iq, ik, block_size, topk, force_sink)
    out = select_blocks(iq, ik, block_size=block_size, topk=topk, force_sink=force_sink, backend="triton")
    assert out.dtype == torch.int32 and out.shape == (B, T, G, topk)
    assert torch.equal(as_sets(out), as_sets(ref))
    check_valid_topk(out, block_scores64(iq, ik, block_size), block_size, topk, force_sink, tol=1e-9)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B,T,G,Di,block_size,topk,force_sink", CASES[1:4])
def test_low_precision_inputs_pick_a_valid_topk(B, T, G, Di, block_size, topk, force_sink, dtype):
    # products of 16-bit inputs are exact in fp32: only the summation order differs from the
    # reference, so a swap is allowed only between blocks whose scores agree to fp32 rounding
    iq, ik = rand_index(B, T, G, Di, dtype=dtype, seed=7)
    out = select_blocks(iq, ik, block_size=block_size, topk=topk, force_sink=force_sink, backend="triton")
    check_valid_topk(out, block_scores64(iq, ik, block_size), block_size, topk, force_sink, tol=1e-4 * Di ** 0.5)
    ref = select_blocks_reference(iq, ik, block_size, topk, force_sink)
    rows_differ = (as_sets(out) != as_sets(ref)).any(-1).float().mean().item()
    assert rows_differ <= 1e-3


@pytest.mark.parametrize("B,T,G,Di,block_size,topk,force_sink", CASES[1:4])
def test_two_stage_path_matches(B, T, G, Di, block_size, topk, force_sink):
    iq, ik = rand_index(B, T, G, Di, seed=3)
    bs = block_scores_triton(iq, ik, block_size)
    bs64 = block_scores64(iq, ik, block_size)
    # fp32 products summed in another order: close to float64, exactly -inf where nothing is visible
    assert torch.equal(torch.isinf(bs), torch.isinf(bs64))
    fin = torch.isfinite(bs64)
    assert torch.allclose(bs[fin].double(), bs64[fin], rtol=1e-5, atol=1e-5)
    ref = select_blocks_reference(iq, ik, block_size, topk, force_sink)
    out = topk_blocks_triton(bs, block_size, topk, force_sink)
    assert torch.equal(as_sets(out), as_sets(ref))
    # the selection stage on arbitrary scores (not block maxima of anything) against torch.topk
    noise = torch.randn(bs.shape, generator=torch.Generator().manual_seed(1)).to(bs.device)
    sel = topk_blocks_triton(noise, block_size, topk, force_sink)
    check_valid_topk(sel, noise.double().masked_fill(torch.isinf(bs64), float("-inf")), block_size, topk,
                     force_sink, tol=0.0)


def test_padding_and_local_slot_layout():
    # slot 0 is the local block, -1 padding comes last
    iq, ik = rand_index(1, 100, 2, 16, seed=5)
    out = select_blocks(iq, ik, block_size=16, topk=8, backend="triton")
    t = torch.arange(100, device=out.device)
    assert torch.equal(out[0, :, :, 0].long(), (t // 16)[:, None].expand(100, 2))
    pad = out < 0
    assert not bool((pad[..., :-1] & ~pad[..., 1:]).any())


def test_deterministic():
    iq, ik = rand_index(1, 150, 4, 16, dtype=torch.bfloat16, seed=9)
    a = select_blocks(iq, ik, block_size=32, topk=4, backend="triton")
    b = select_blocks(iq, ik, block_size=32, topk=4, backend="triton")
    assert torch.equal(a, b)
