"""The Triton select_blocks against the reference: on CPU under Triton's interpreter (small shapes),
on the GPU at large shapes when one is present.

Block ids are a set per (b, t, g): both sides are sorted before comparing.
"""

import dataclasses

import pytest
import torch

from msa_model.ops import select_blocks
from msa_model.ops.select_blocks import select_blocks_reference
from msa_model.ops.select_blocks.fp8 import key_scales, quantize_index
from msa_model.ops.select_blocks.triton import Tuning

from bench.select_blocks_stages import block_scores_triton, topk_blocks_triton

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


def fp8_scores64(iq, ik, block_size):
    """float64 block maxima of the scores precision='fp8' ranks: quantized products times each key
    block's scale."""
    iq8, ik8, scale = quantize_index(iq, ik, block_size)
    deq = ik8.double() * key_scales(scale, ik.shape[1], block_size).double()[..., None]
    return block_scores64(iq8.double(), deq, block_size)


@pytest.mark.parametrize("B,T,G,Di,block_size,topk,force_sink", CASES)
def test_fp8_scores_pick_the_fp8_reference_sets(B, T, G, Di, block_size, topk, force_sink):
    iq, ik = rand_index(B, T, G, Di, dtype=torch.bfloat16, seed=T + 11)
    # keys of unequal norms: the per-block scales matter
    ik = ik * torch.linspace(0.2, 3.0, T, device=ik.device, dtype=ik.dtype)[None, :, None]
    out = select_blocks(iq, ik, block_size=block_size, topk=topk, force_sink=force_sink, backend="triton",
                        precision="fp8")
    ref = select_blocks_reference(iq, ik, block_size, topk, force_sink, precision="fp8")
    # products of e4m3 values are exact in fp32: only the summation order (and, on the fp8 tensor
    # cores, their accumulator) differ, so swaps are allowed only between near-tied blocks
    check_valid_topk(out, fp8_scores64(iq, ik, block_size), block_size, topk, force_sink,
                     tol=(1e-9 if DEV == "cpu" else 1e-3) * Di ** 0.5 * 448)
    # (on an H200: 0.14% of the rows of 5000 tokens x 2 groups at Di=128, all such near-ties)
    rows_differ = (as_sets(out) != as_sets(ref)).any(-1).float().mean().item()
    assert rows_differ <= (0.0 if DEV == "cpu" else 5e-3)


def test_fp8_scores_with_documents_and_query_offset():
    T, q0, bs = 160, 37, 16
    iq, ik = rand_index(1, T, 2, 32, dtype=torch.bfloat16, seed=4)
    ik = ik * torch.rand(1, T, 1, generator=torch.Generator().manual_seed(5)).to(ik)
    starts = torch.tensor([0] * 50 + [50] * 70 + [120] * 40, dtype=torch.int32, device=iq.device)[None]
    kw = dict(block_size=bs, topk=4, force_sink=True, q_offset=q0, doc_start=starts[:, q0:], precision="fp8")
    out = select_blocks(iq[:, q0:], ik, backend="triton", **kw)
    ref = select_blocks(iq[:, q0:], ik, backend="reference", **kw)
    rows_differ = (as_sets(out) != as_sets(ref)).any(-1).float().mean().item()
    assert rows_differ <= (0.0 if DEV == "cpu" else 0.02)


def test_fp8_quantization_error_is_one_e4m3_rounding():
    iq, ik = rand_index(2, 100, 3, 32, seed=8, device="cpu")
    ik = ik * torch.linspace(0.01, 5.0, 100)[None, :, None]
    iq8, ik8, scale = quantize_index(iq, ik, 16)
    assert iq8.dtype == ik8.dtype == torch.float8_e4m3fn and scale.shape == (2, 7)
    # rows of iq: scaled to the e4m3 range by their amax (the scale is not needed for ranking)
    amax_q = iq.abs().amax(-1, keepdim=True)
    deq_q = iq8.float() * amax_q / 448
    assert bool(((deq_q - iq).abs() <= 2 ** -4 * iq.abs() + 2 ** -10 * amax_q / 448 + 1e-7).all())
    # keys: one scale per block of 16, the block's amax over 448
    deq_k = ik8.float() * key_scales(scale, 100, 16)[..., None]
    amax_k = key_scales(scale, 100, 16)[..., None] * 448
    assert bool(((deq_k - ik).abs() <= 2 ** -4 * ik.abs() + 2 ** -10 * amax_k / 448 + 1e-7).all())


def test_unknown_precision_is_refused():
    iq, ik = rand_index(1, 40, 2, 16, seed=1)
    with pytest.raises(ValueError, match="precision must be one of"):
        select_blocks(iq, ik, block_size=16, topk=2, precision="int8")


@pytest.mark.parametrize("skip_from", [0, 1])
@pytest.mark.parametrize("precision", ["input", "fp8"])
def test_topk_skip_changes_no_set(skip_from, precision):
    # fp8 kernels over more than skip_from blocks skip top-k updates that no row of a program
    # wins (input-precision kernels never do): the same sets either way
    T = 3000 if DEV == "cuda" else 200
    iq, ik = rand_index(1, T, 4, 32, dtype=torch.bfloat16, seed=21)
    base = Tuning(rows=32, cols=32, num_warps=4, num_stages=1) if DEV == "cpu" else Tuning()
    bs = 32 if DEV == "cpu" else 128
    want = select_blocks(iq, ik, block_size=bs, topk=4, backend="triton", precision=precision,
                         tuning=dataclasses.replace(base, skip_from=10 ** 9))
    got = select_blocks(iq, ik, block_size=bs, topk=4, backend="triton", precision=precision,
                        tuning=dataclasses.replace(base, skip_from=skip_from))
    assert torch.equal(as_sets(got), as_sets(want))


def tied_index(B, T, G, Di, block_size, seed, device=DEV):
    """Index inputs whose block maxima tie often: iq one-hot on channel 0, each key block one
    small integer (every key of a block the same), so many blocks share a score."""
    g = torch.Generator().manual_seed(seed)
    iq = torch.zeros(B, T, G, Di)
    iq[..., 0] = 1.0
    n = -(-T // block_size)
    value = torch.randint(0, 3, (B, n), generator=g).float()
    ik = torch.zeros(B, T, Di)
    ik[..., 0] = value.repeat_interleave(block_size, 1)[:, :T]
    return iq.to(device), ik.to(device)


def test_ties_go_to_the_lowest_block_id():
    # block maxima 2, 1, 9, 2, 5 then the query's block: of the two 2s the lower id is kept,
    # whatever slot the kernel's running top-k holds them in
    bs = 16
    vals = [2.0, 1.0, 9.0, 2.0, 5.0, 0.0]
    iq = torch.zeros(1, len(vals) * bs, 1, 16, device=DEV)
    iq[..., 0] = 1
    ik = torch.zeros(1, len(vals) * bs, 16, device=DEV)
    ik[0, :, 0] = torch.tensor(vals, device=DEV).repeat_interleave(bs)
    for backend in ("reference", "triton"):
        got = select_blocks(iq, ik, block_size=bs, topk=4, backend=backend)[0, -1, 0]
        assert sorted(got.tolist()) == [0, 2, 4, 5], backend


@pytest.mark.parametrize("docs", [False, True], ids=["one-document", "documents"])
@pytest.mark.parametrize("local_blocks,force_sink", [(1, False), (2, True)])
def test_tied_scores_pick_the_same_sets_as_the_reference(docs, local_blocks, force_sink):
    B, T, G, Di, bs, topk = 2, 190, 2, 16, 16, 5
    iq, ik = tied_index(B, T, G, Di, bs, seed=3)
    doc = None
    if docs:
        # documents of 37..120 tokens: their blocks do not line up with the key tiles
        cuts = torch.tensor([0, 37, 157]), torch.tensor([0, 120])
        doc = torch.stack([torch.bucketize(torch.arange(T), c, right=True) for c in cuts])
        doc = torch.stack([c[d - 1] for c, d in zip(cuts, doc)]).to(torch.int32).to(DEV)
    kw = dict(block_size=bs, topk=topk, force_sink=force_sink, doc_start=doc, local_blocks=local_blocks)
    want = select_blocks(iq, ik, backend="reference", **kw)
    got = select_blocks(iq, ik, backend="triton", **kw)
    assert torch.equal(as_sets(got), as_sets(want))


def test_two_stage_top_k_breaks_ties_by_the_lowest_block_id():
    iq, ik = tied_index(1, 160, 2, 16, 16, seed=5)
    want = select_blocks(iq, ik, block_size=16, topk=4, backend="reference")
    got = topk_blocks_triton(block_scores_triton(iq, ik, 16), 16, 4)
    assert torch.equal(as_sets(got), as_sets(want))
