"""The Triton sparse_attention against its reference: o, lse, dq, dk, dv.

On CPU the kernels run in Triton's interpreter (tests/conftest.py) on small shapes; large shapes
run only where CUDA is available. Errors are measured against an fp64 reference; low-precision
runs must stay within 2x of what PyTorch achieves in the same dtype (`upcast=False` reference).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from msa_model.ops.sparse_attention import sparse_attention
from msa_model.ops.triton_utils import interpreting
from msa_model.ops.sparse_attention import hybrid, inverse_index, reference, shared, tiles
from msa_model.ops.sparse_attention import triton as sa_triton
from msa_model.ops.sparse_attention.reference import sparse_attention_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class _PoisonedTorch:
    """torch, except that empty / empty_like hand out NaN-filled (float) or garbage (int) memory,
    so an output or partial the kernels forget to write shows up."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def _poison(x):
        return x.fill_(float("nan") if x.is_floating_point() else -7)

    def empty(self, *a, **kw):
        return self._poison(torch.empty(*a, **kw))

    def empty_like(self, *a, **kw):
        return self._poison(torch.empty_like(*a, **kw))


@pytest.fixture(autouse=True)
def poisoned(monkeypatch):
    monkeypatch.setattr(sa_triton, "torch", _PoisonedTorch())


def random_block_idx(B, T, G, K, block_size, gen, empty_frac=0.2, dup=True):
    """Random causal block sets with the local block in slot 0, -1 slots, future blocks and repeats."""
    n = (T + block_size - 1) // block_size
    local = (torch.arange(T) // block_size)[None, :, None]
    idx = (torch.rand(B, T, G, K, generator=gen) * (local[..., None] + 1)).long()
    idx[..., 0] = local
    idx = torch.where(torch.rand(B, T, G, K, generator=gen) < empty_frac, -1, idx)
    if K > 2 and dup:
        # a repeated block must count once; a future block reads nothing
        idx[:, ::3, :, 1] = idx[:, ::3, :, 0]
        idx[:, 1::5, :, 2] = torch.clamp(local[:, 1::5] + 1, max=n - 1)
    return idx.to(torch.int32)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def run_case(B, T, Hq, G, D, block_size, K, dtype, dense=False, seed=0, tuning=None, block_idx=None):
    """block_idx: the sets to use (default: random_block_idx's)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hq, D, generator=gen).to(dtype)
    k = torch.randn(B, T, G, D, generator=gen).to(dtype)
    v = torch.randn(B, T, G, D, generator=gen).to(dtype)
    do = torch.randn(B, T, Hq, D, generator=gen).to(dtype)
    idx = None if dense else random_block_idx(B, T, G, K, block_size, gen) if block_idx is None else block_idx
    q, k, v, do = (x.to(DEVICE) for x in (q, k, v, do))
    idx = None if idx is None else idx.to(DEVICE)

    def grads(fn, dt, **kw):
        qq, kk, vv = (x.detach().to(dt).requires_grad_() for x in (q, k, v))
        o, lse = fn(qq, kk, vv, idx, block_size, **kw)
        dq, dk, dv = torch.autograd.grad(o, (qq, kk, vv), do.to(dt))
        return o, lse, dq, dk, dv

    scale = D ** -0.5
    ref = grads(lambda *a: sparse_attention_reference(*a, scale), torch.float64)
    out = grads(lambda *a: sparse_attention(*a, backend="triton", tuning=tuning), dtype)
    names = ("o", "lse", "dq", "dk", "dv")
    for name, x in zip(names, out):
        assert not torch.isnan(x).any(), f"{name} has NaN (unwritten rows?)"
    # lse: same -inf pattern (empty support), finite values close in absolute terms
    lse_ref, lse = ref[1], out[1]
    assert lse.dtype == torch.float32
    assert torch.equal(torch.isinf(lse_ref), torch.isinf(lse))
    fin = torch.isfinite(lse_ref)
    if dtype == torch.float32:
        tol = 1e-5
        for name, x, r in zip(names, out, ref):
            if name != "lse":
                # one key per query (T = 1): the exact dq is 0 and fp32 rounding leaves ~1e-8
                err = (x.double() - r.double()).norm().item()
                assert err <= tol * r.double().norm().item() + 1e-6, (name, rel(x, r))
        assert (lse[fin].double() - lse_ref[fin]).abs().max().item() < 10 * tol
        return
    base = grads(lambda *a: sparse_attention_reference(*a, scale, upcast=False), dtype)
    for name, x, b, r in zip(names, out, base, ref):
        if name == "lse":
            err, err_torch = ((v[fin].double() - r[fin]).abs().max().item() for v in (x, b))
        else:
            err, err_torch = rel(x, r), rel(b, r)
        assert err <= 2 * err_torch + 1e-6, (name, err, err_torch)


@pytest.mark.parametrize("B,T,Hq,G,D,block_size,K", [
    (1, 1, 2, 1, 16, 16, 4),
    (2, 63, 4, 2, 32, 16, 4),
    (1, 200, 4, 1, 16, 32, 3),
    (2, 50, 8, 2, 16, 16, 5),
    (1, 70, 8, 4, 16, 32, 4),
])
def test_sparse_fp32(B, T, Hq, G, D, block_size, K):
    if DEVICE == "cuda":
        pytest.skip("fp32 runs only under the interpreter")
    run_case(B, T, Hq, G, D, block_size, K, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B,T,Hq,G,D,block_size,K", [
    (2, 63, 4, 2, 32, 16, 4),
    (1, 100, 8, 2, 16, 32, 3),
])
def test_sparse_low_precision(B, T, Hq, G, D, block_size, K, dtype):
    run_case(B, T, Hq, G, D, block_size, K, dtype)


@pytest.mark.parametrize("B,T,Hq,G,D,dtype", [
    (1, 1, 2, 1, 16, torch.float32),
    (2, 63, 4, 2, 16, torch.float32),
    (1, 100, 4, 4, 32, torch.bfloat16),
])
def test_dense(B, T, Hq, G, D, dtype):
    if DEVICE == "cuda" and dtype == torch.float32:
        pytest.skip("fp32 runs only under the interpreter")
    run_case(B, T, Hq, G, D, 16, 0, dtype, dense=True)


def test_query_chunks():
    """Partial buffers over budget: queries run in several chunks (here six of 7 tokens each, the
    last 6, across the 3 blocks' boundaries), same results."""
    B, T, Hq, G, K, bs = 2, 41, 4, 2, 4, 16
    per_query = B * G * K * (Hq // G) * (16 * 4 + 4)  # fp32 partial o and lse of one query (D = 16)
    tuning = dataclasses.replace(sa_triton.DEFAULT_TUNING, partial_bytes=7 * per_query)
    assert shared.equal_chunks(T, per_query, tuning.partial_bytes) == 7
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    assert shared.index_chunk((B, T, G, K), Hq // G, 16, dtype.itemsize, tuning) < T  # the op's chunks: several
    run_case(B, T, Hq, G, 16, bs, K, dtype, tuning=tuning)


@pytest.mark.parametrize("T, heads, groups, chunks", [
    (8192, 64, 4, 1),     # production layer at 8K: 2.0 GiB of partials in one chunk
    (8192, 32, 2, 1),     # its TP=2 share
    (32768, 64, 4, 3),    # 8.1 GiB: the minimum budget of 3 GiB
    (131072, 64, 4, 9),   # 32.5 GiB: 2x the bytes of q, capped at 4 GiB
])
def test_default_partial_budget(T, heads, groups, chunks):
    """The forward's partial buffers (bf16 o and an fp32 lse per entry and head, K = 16) under the
    default budget: one chunk at short context, where the buffers are transient next to the
    step's saved activations; bounded by q's bytes and 4 GiB at long context."""
    tuning, D, K = sa_triton.DEFAULT_TUNING, 128, 16
    per_query = groups * K * (heads // groups) * (D * 2 + 4)
    budget = shared.partial_budget(tuning, T * heads * D * 2)
    assert budget == max(3 << 30, min(4 << 30, 4 * T * heads * D))
    assert -(-T // shared.equal_chunks(T, per_query, budget)) == chunks


@pytest.mark.parametrize("chunk", [0, 5, 23])
def test_inverse_index_lists_every_entry_once_in_its_bucket(chunk):
    """Each valid (b, t, g, slot) entry sits in the bucket of its (chunk of t, b, g, block),
    buckets list their queries ascending, and empty slots sort after every bucket; the schedule
    covers each bucket's entries once, in runs inside its chunk's row."""
    B, T, G, K, N = 2, 23, 3, 4, 4
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(-1, N, (B, T, G, K), generator=gen, dtype=torch.int32)
    idx = inverse_index.clean_block_idx(idx, 1, q_offset=N)  # every block is causal at offset N
    index = inverse_index.build_inverse_index(idx, N, chunk)
    C = T if chunk == 0 else chunk
    S = -(-T // C)
    assert index.n_chunks == S and index.chunk_size == C and index.chunk_entries == B * C * G * K
    flat = idx.flatten()
    valid = (flat >= 0).nonzero().flatten()
    assert int(index.count.sum()) == valid.numel() and index.start.numel() == S * B * G * N
    assert sorted(index.entry[:valid.numel()].tolist()) == valid.tolist()
    for bucket in range(S * B * G * N):
        lo, n_e = int(index.start[bucket]), int(index.count[bucket])
        ent = index.entry[lo:lo + n_e].long()
        b, t, g = ent // (T * G * K), (ent // (G * K)) % T, (ent // K) % G
        assert ((((t // C) * B + b) * G + g) * N + flat[ent] == bucket).all()
        assert (t[1:] > t[:-1]).all()
    per = 3
    tb, ts, tc = inverse_index.schedule(index, per)
    assert tb.shape[0] == S
    # the kernel (what CUDA tensors take; these are CPU tensors) gives the definition's programs
    for got, want in zip(inverse_index.schedule_triton(index, per) if interpreting() else (), (tb, ts, tc)):
        assert got.dtype == torch.int32 and torch.equal(got, want)
    for c in range(S):
        seen = {}
        for bucket, start, count in zip(tb[c].tolist(), ts[c].tolist(), tc[c].tolist()):
            if bucket >= 0:
                assert 0 < count <= per
                seen.setdefault(bucket, []).append((start, count))
        for bl in range(B * G * N):
            runs = seen.get(bl, [])
            g_bucket = c * B * G * N + bl
            lo, n_e = int(index.start[g_bucket]), int(index.count[g_bucket])
            assert [s for s, _ in runs] == list(range(lo, lo + n_e, per)) and sum(n for _, n in runs) == n_e
    # the unchunked view (the KL's) of the same sort: each block's entries of every chunk, in order
    whole = index.whole()
    single = inverse_index.build_inverse_index(idx, N, 0)
    assert whole.n_chunks == 1 and whole.chunk_size == T and whole.chunk_entries == B * T * G * K
    for bl in range(B * G * N):
        lo, n_e = int(whole.start[bl]), int(whole.count[bl])
        lo1, n_e1 = int(single.start[bl]), int(single.count[bl])
        assert torch.equal(index.entry[lo:lo + n_e], single.entry[lo1:lo1 + n_e1])


@pytest.mark.parametrize("per", [1, 2, 16])
@pytest.mark.parametrize("chunk", [0, 7])
def test_schedule_kernel_equals_the_definition(chunk, per):
    """The schedule kernel against schedule_reference on fresh random selections with empty
    slots, popular blocks (runs split over several programs) and empty buckets."""
    B, T, G, K, N = 2, 37, 2, 5, 9
    gen = torch.Generator().manual_seed(10 * chunk + per)
    idx = torch.randint(-1, N, (B, T, G, K), generator=gen, dtype=torch.int32)
    idx[:, :, 0, 0] = 2  # a block every query of group 0 selected
    idx = inverse_index.clean_block_idx(idx.to(DEVICE), 1, q_offset=N)
    chunked = inverse_index.build_inverse_index(idx, N, chunk)
    # and the unchunked view of a chunked index (the KL's), whose bounds are strided views
    for index in (chunked, chunked.whole()):
        want = reference.schedule_reference(index, per)
        got = inverse_index.schedule_triton(index, per)
        for g, w in zip(got, want):
            assert g.shape == w.shape and g.dtype == w.dtype == torch.int32
            assert torch.equal(g, w)


@pytest.mark.parametrize("chunk", [0, 5])
def test_inverse_index_of_many_blocks_sorts_wider_keys(chunk):
    """Bucket keys past 32767 (16-bit keys from -32768, one chunk here) and past 65536 (32-bit
    keys, five chunks): the same entries give the same buckets (block n of (b, g) here is block n
    there; the extra blocks are empty)."""
    B, T, G, K, N, wide = 2, 23, 2, 4, 4, 9000  # 2 * 2 * 9000 = 36000 ids
    gen = torch.Generator().manual_seed(2)
    idx = inverse_index.clean_block_idx(torch.randint(-1, N, (B, T, G, K), generator=gen, dtype=torch.int32), 1,
                                        q_offset=N)
    narrow, big = (inverse_index.build_inverse_index(idx, n, chunk) for n in (N, wide))
    assert torch.equal(narrow.entry, big.entry) and big.n_chunks == narrow.n_chunks
    S = narrow.n_chunks
    for name in ("start", "count"):
        a, b = getattr(narrow, name).view(S, B * G, N), getattr(big, name).view(S, B * G, wide)
        assert torch.equal(a, b[..., :N]), name
    assert (big.count.view(S, B * G, wide)[..., N:] == 0).all()
    assert torch.equal(narrow.block_count.view(B * G, N), big.block_count.view(B * G, wide)[:, :N])


def test_unchecked_ids_out_of_range_read_nothing():
    """check_ids=False skips the (synchronising) range check; ids below -1 or past the last block
    then read nothing, like -1 and future blocks, and the default still refuses them."""
    B, T, Hq, G, D, bs = 1, 40, 2, 1, 16, 16
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    q, k, v = (torch.randn(B, T, h, D, device=DEVICE).to(dtype) for h in (Hq, G, G))
    idx = torch.full((B, T, G, 3), -1, dtype=torch.int32, device=DEVICE)
    idx[..., 0] = (torch.arange(T, device=DEVICE) // bs)[None, :, None]
    bad = idx.clone()
    bad[..., 1] = 99
    bad[..., 2] = -5
    with pytest.raises(ValueError, match="outside"):
        sparse_attention(q, k, v, bad, bs, backend="triton")
    o, lse = sparse_attention(q, k, v, bad, bs, backend="triton", check_ids=False)
    o_ref, lse_ref = sparse_attention(q, k, v, idx, bs, backend="triton")
    assert torch.equal(o, o_ref) and torch.equal(lse, lse_ref)


def test_empty_support_and_duplicates():
    """Rows whose slots are all -1 or future blocks give o = 0, lse = -inf, zero gradients."""
    B, T, Hq, G, D, bs = 1, 48, 2, 1, 16, 16
    dtype, tol = (torch.float32, 1e-5) if DEVICE == "cpu" else (torch.bfloat16, 1e-2)
    q, k, v = (torch.randn(B, T, h, D, device=DEVICE).to(dtype).requires_grad_() for h in (Hq, G, G))
    idx = torch.full((B, T, G, 3), -1, dtype=torch.int32, device=DEVICE)
    idx[:, 20:, :, :] = 1  # the same block three times: counts once
    idx[:, :16, :, 0] = 2  # a future block: no causal key
    o, lse = sparse_attention(q, k, v, idx, bs, backend="triton")
    o_ref, lse_ref = sparse_attention_reference(q, k, v, idx, bs, D ** -0.5)
    assert torch.isinf(lse[:, :20]).all() and (o[:, :20] == 0).all()
    assert rel(o, o_ref) < tol and torch.allclose(lse[:, 20:], lse_ref[:, 20:].float(), atol=tol)
    g = torch.autograd.grad(o.float().sum(), (q, k, v))
    g_ref = torch.autograd.grad(o_ref.float().sum(), (q, k, v))
    for x, r in zip(g, g_ref):
        assert rel(x, r) < tol


def test_int64_offsets_give_the_bits_of_int32_offsets():
    """The gather kernels compute row offsets in int32 where every one fits and in int64 past
    2**31 elements: both give the same o, lse, dq, dk, dv and KL teacher rows, over two chunks
    (partial buffers indexed from each chunk's first query) and a batch of two."""
    from msa_model.ops.sparse_attention import gather

    B, T, Hq, G, D, K, bs = 2, 50, 4, 2, 16, 3, 16
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    gen = torch.Generator().manual_seed(3)
    q, do = (torch.randn(B, T, Hq, D, generator=gen).to(DEVICE, dtype) for _ in range(2))
    k, v = (torch.randn(B, T, G, D, generator=gen).to(DEVICE, dtype) for _ in range(2))
    idx = reference.clean_block_idx_reference(random_block_idx(B, T, G, K, bs, gen).to(DEVICE), bs).contiguous()
    per_query = B * G * K * (Hq // G) * (D * dtype.itemsize + 4)
    outs = []
    for narrow in (True, False):
        tuning = dataclasses.replace(sa_triton.DEFAULT_TUNING, narrow_offsets=narrow, partial_bytes=27 * per_query)
        o, lse, index = gather.sparse_forward(q, k, v, idx, bs, D ** -0.5, tuning=tuning)
        assert index.n_chunks == 2
        teacher = torch.zeros(idx.numel(), bs, dtype=dtype, device=DEVICE)
        grads = gather.sparse_backward(do, q, k, v, o, lse, idx, bs, D ** -0.5, index=index, tuning=tuning,
                                       teacher=teacher)
        outs.append((o, lse, *grads, teacher))
    assert outs[1][-1].abs().sum() > 0
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv", "teacher"), *outs):
        assert torch.equal(a, b), name


def test_offsets_narrow_only_while_every_tensor_fits_int32():
    small, edge, big = (torch.empty(n, device="meta") for n in (10, 2 ** 31 - 1, 2 ** 31))
    tuning = sa_triton.DEFAULT_TUNING
    assert shared.narrow_offsets(tuning, small, edge)
    assert not shared.narrow_offsets(tuning, small, big)
    assert not shared.narrow_offsets(dataclasses.replace(tuning, narrow_offsets=False), small)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="large shapes need a GPU")
@pytest.mark.parametrize("H,D,block_size,K,dtype", [
    (16, 128, 128, 16, torch.bfloat16),
    (8, 64, 64, 8, torch.float16),
    (4, 128, 64, 4, torch.bfloat16),
    (1, 64, 128, 16, torch.bfloat16),
])
def test_large_gpu(H, D, block_size, K, dtype):
    run_case(2, 1000, 2 * H, 2, D, block_size, K, dtype)


def _tiles(rows, per_item=2, **kw):
    """The tile path both ways (every tile); few tiles per dK/dV work item, so popular blocks span
    several; 16 keys per step, so a 32-key block takes two."""
    kw = {"tile_backward": True, "tile_keys": 16, "tile_dq_keys": 16, "tile_min_heads": 1, "tile_min_queries": 0, **kw}
    return dataclasses.replace(sa_triton.DEFAULT_TUNING, tile_rows=rows, tile_dkdv_tiles=per_item, **kw)


@pytest.mark.parametrize("B,T,Hq,G,D,block_size,K,rows", [
    (1, 1, 2, 1, 16, 16, 4, 2),
    (2, 63, 4, 2, 32, 16, 4, 8),
    (1, 45, 6, 2, 16, 16, 3, 8),
])
def test_tile_path_fp32(B, T, Hq, G, D, block_size, K, rows):
    """Odd lengths (a partial last tile), H = 3 heads per group (padded rows), -1 slots, repeats
    and future blocks (random_block_idx)."""
    if DEVICE == "cuda":
        pytest.skip("fp32 runs only under the interpreter")
    run_case(B, T, Hq, G, D, block_size, K, torch.float32, tuning=_tiles(rows))


@pytest.mark.parametrize("dtype,tile_backward", [(torch.bfloat16, True), (torch.float16, False)],
                         ids=["tiles-bf16", "hybrid-fp16"])
def test_tile_path_low_precision(dtype, tile_backward):
    """An odd length (a partial last tile of 2 queries; the second of the 2 blocks partial); one
    batch row (the tile kernels' batch offsets, which no dtype changes, are test_tile_path_fp32's)."""
    run_case(1, 47, 4, 2, 32, 32, 4, dtype, tuning=_tiles(4, tile_backward=tile_backward, tile_union_max=1.25))


@pytest.mark.parametrize("chunked", [False, True])
def test_hybrid_forward_splits_tiles_by_their_union(chunked):
    """Tiles whose union is at most the limit take the tile kernel, the others the gather path, in
    one call: both kinds occur here, and the result is the reference's. Chunked: the gather pass
    runs in several query chunks (not whole tiles), its combine 2 queries a program."""
    B, T, Hq, G, D, bs, K, QT = 1, 90, 4, 2, 16, 16, 4, 4  # 2 heads per group: 8 rows
    gen = torch.Generator().manual_seed(0)  # run_case's first draws: q, k, v, do, then the sets
    for shape in ((B, T, Hq, D), (B, T, G, D), (B, T, G, D), (B, T, Hq, D)):
        torch.randn(*shape, generator=gen)
    idx = inverse_index.clean_block_idx(random_block_idx(B, T, G, K, bs, gen), bs)
    count = tiles.tile_union(idx, QT).count
    limit = 1.0
    assert (count <= limit * K).any() and (count > limit * K).any()
    # a chunk's forward partials: 20 queries of G*K entries of H heads (D values and an fp32 lse each)
    chunks = dict(partial_bytes=20 * G * K * 2 * (D * 4 + 4), partial_min_bytes=0, combine_queries_rows=2) \
        if chunked else {}
    run_case(B, T, Hq, G, D, bs, K, torch.float32 if DEVICE == "cpu" else torch.bfloat16,
             tuning=_tiles(2 * QT, tile_backward=False, tile_union_max=limit, **chunks))


@pytest.mark.parametrize("with_index", [True, False])
def test_hybrid_forward_keeps_the_index_of_every_entry(with_index):
    """The hybrid forward builds the gather path's index of every entry (its gather pass walks one
    of the gathered tiles' entries only) for the backward and the KL: the index `sparse_index`
    gives, or none when the caller needs no backward."""
    B, T, Hq, G, D, bs, K, QT = 1, 40, 4, 2, 16, 16, 4, 4
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, T, h, D, generator=gen).to(DEVICE) for h in (Hq, G, G))
    idx = random_block_idx(B, T, G, K, bs, gen).to(DEVICE)
    tuning = _tiles(2 * QT, tile_backward=False, tile_union_max=1.0)
    state = sa_triton.attention_forward(q, k, v, idx, bs, D ** -0.5, 0, tuning, None, with_index=with_index)[2]
    if not with_index:
        assert state.index is None
        return
    fresh = shared.sparse_index(state.idx, Hq // G, D, q.element_size(), 3, tuning)
    for name in ("entry", "start", "count", "block_start", "block_count"):
        assert torch.equal(getattr(state.index, name), getattr(fresh, name)), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="two streams need a GPU")
def test_hybrid_forward_on_two_streams():
    """On a GPU the hybrid's gather pass runs on a second stream beside the tile kernel, each
    writing its own rows: with much work on both (the first half's queries share their blocks,
    the second half's are random), repeated calls (the allocator handing the freed buffers out
    again) agree with the reference."""
    B, T, Hq, G, D, bs, K = 1, 4096, 32, 2, 128, 64, 8
    gen = torch.Generator().manual_seed(2)
    idx = torch.cat([shared_block_idx(B, T // 2, G, K, bs), random_block_idx(B, T, G, K, bs, gen)[:, T // 2:]], 1)
    tuning = dataclasses.replace(sa_triton.DEFAULT_TUNING, tile_min_queries=0)
    union = tiles.tile_union(inverse_index.clean_block_idx(idx.cuda(), bs), tiles.tile_queries(tuning, 16))
    over = union.count > tuning.tile_union_max * K
    assert 0.3 < over.float().mean() < 0.7
    hybrid.SIDE_STREAMS.clear()
    for seed in range(3):
        run_case(B, T, Hq, G, D, bs, K, torch.bfloat16, seed=seed, tuning=tuning, block_idx=idx)
    assert hybrid.SIDE_STREAMS, "the gather pass took no second stream"


@pytest.mark.parametrize("queries", [2, 8])
def test_forward_combine_merges_several_queries_a_program(queries):
    """The gather path's combine with several queries a program, over query chunks that are not
    multiples of them, and rows with an empty support (every 7th query selects nothing)."""
    B, T, Hq, G, D, bs, K = 2, 31, 6, 2, 16, 16, 4  # 3 heads a group: padded rows
    tuning = dataclasses.replace(sa_triton.DEFAULT_TUNING, combine_queries=queries, tile_rows=0,
                                 partial_bytes=13 * B * G * K * 3 * (D * 4 + 4), partial_min_bytes=0)
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    chunk = shared.index_chunk((B, T, G, K), 3, D, dtype.itemsize, tuning)  # here 11, 11 and 9 queries
    assert chunk < T and chunk % queries
    idx = random_block_idx(B, T, G, K, bs, torch.Generator().manual_seed(9))
    idx[:, ::7] = -1
    run_case(B, T, Hq, G, D, bs, K, dtype, tuning=tuning, block_idx=idx)


def shared_block_idx(B, T, G, K, block_size):
    """Sets that neighbouring queries mostly share, as a trained indexer's: the local block, block
    0, K - 3 fixed stripes per group and one block that changes from query to query (future
    ones dropped by the op), so most tiles hold blocks that every query selected and that end
    before the tile, and some that only part of the tile selected."""
    n = (T + block_size - 1) // block_size
    local = (torch.arange(T) // block_size)[None, :, None, None].expand(B, T, G, 1)
    stripes = (torch.arange(1, K - 2)[None, :] * 2 + torch.arange(G)[:, None]) % n
    moving = (torch.arange(T) % 3 + 1)[None, :, None, None].expand(B, T, G, 1)
    return torch.cat([local, torch.zeros_like(local), stripes[None, None].expand(B, T, G, K - 3), moving],
                     -1).to(torch.int32)


@pytest.mark.parametrize("rows", [4, 8])
def test_tile_path_reads_whole_blocks_unmasked(rows):
    """Tiles whose queries share earlier blocks read those in the kernel's unmasked loop (blocks
    every query selected, ending before the tile's first query) and the rest masked: both loops
    run here, and the result is the reference's."""
    # 16 keys a step: two per block; 4 blocks, the last one and the last tile partial (one batch
    # row: the tile kernels' batch offsets are test_tile_path_fp32's and test_tile_path_low_precision's)
    B, T, Hq, G, D, bs, K = 1, 99, 4, 2, 16, 32, 5
    idx = shared_block_idx(B, T, G, K, bs)
    union = tiles.tile_union(inverse_index.clean_block_idx(idx, bs), rows // 2)
    assert (union.full > 0).float().mean() > 0.5 and (union.full < union.count).any()
    # the blocks each tile reads unmasked (`tiles._whole_blocks`: every query selected them, they
    # end before the tile's first query): most tiles have some, some several, every tile masks the rest
    first = torch.arange(union.count.shape[-1]) * (rows // 2)
    whole = ((torch.arange(union.blocks.shape[-1]) < union.full[..., None])
             & (union.blocks * bs + bs - 1 <= first[:, None])).sum(-1)
    assert (whole > 0).float().mean() > 0.5 and (whole > 1).any() and (whole < union.count).all()
    run_case(B, T, Hq, G, D, bs, K, torch.float32 if DEVICE == "cpu" else torch.bfloat16,
             tuning=_tiles(rows, tile_backward=False, tile_union_max=float(rows)), block_idx=idx)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the default launch shapes need a GPU")
@pytest.mark.parametrize("D", [64, 128, 256])
def test_tile_path_default_launch_shapes(D):
    """The tile kernels at their default launch shapes (128-key steps, both forward loops
    pipelined), which only a GPU compiles: they fit in shared memory at every head dim and agree
    with the reference (with `tile_backward` at D = 256 the gather backward runs: the tile
    backward's dK/dV kernel would not fit)."""
    B, T, Hq, G, bs, K = 1, 1536, 32, 2, 128, 8
    idx = shared_block_idx(B, T, G, K, bs)
    for tile_backward in (False, True):
        tuning = dataclasses.replace(sa_triton.DEFAULT_TUNING, tile_min_queries=0, tile_backward=tile_backward)
        run_case(B, T, Hq, G, D, bs, K, torch.bfloat16, tuning=tuning, block_idx=idx)


def test_tile_path_chunks_the_dkdv_partials(monkeypatch):
    """A partial budget of a few work items: the unions' inverse index runs in several chunks."""
    B, T, Hq, G, D, bs, K = 1, 50, 4, 2, 16, 16, 4
    item = 2 * bs * D * 4
    tuning = _tiles(4, per_item=3, partial_bytes=6 * item, partial_min_bytes=0)
    chunks = []
    build = tiles.build_inverse_index

    def counted(*args):
        index = build(*args)
        chunks.append(index.n_chunks)
        return index

    monkeypatch.setattr(tiles, "build_inverse_index", counted)
    run_case(B, T, Hq, G, D, bs, K, torch.float32 if DEVICE == "cpu" else torch.bfloat16, tuning=tuning)
    assert chunks and min(chunks) > 1, chunks


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_tile_union_lists_each_tiles_distinct_blocks(impl):
    """Distinct ids, those every query of the tile selected first, each part ascending: the
    reference and the kernel against sets built here."""
    B, T, G, K, N, QT = 2, 37, 3, 4, 6, 4
    gen = torch.Generator().manual_seed(3)
    idx = torch.randint(-1, N, (B, T, G, K), generator=gen, dtype=torch.int32)
    idx = inverse_index.clean_block_idx(idx, 1, q_offset=N).to(DEVICE)
    union = {"reference": reference.tile_union_reference, "triton": tiles.tile_union_triton}[impl](idx, QT)
    assert union.blocks.shape == (B, G, -(-T // QT), QT * K)
    for b in range(B):
        for g in range(G):
            for tile in range(-(-T // QT)):
                rows = [set(x for x in r.tolist() if x >= 0) for r in idx[b, tile * QT:(tile + 1) * QT, g]]
                rows += [set()] * (QT - len(rows))  # the last tile's missing queries select nothing
                every = sorted(set.intersection(*rows))
                want = every + sorted(set.union(*rows) - set(every))
                n = int(union.count[b, g, tile])
                assert union.blocks[b, g, tile, :n].tolist() == want
                assert int(union.full[b, g, tile]) == len(every)
                assert (union.blocks[b, g, tile, n:] == -1).all()


def _shared_rows(idx, every=2):
    """idx with each query's sets copied from the query `every` places before, part of the time
    (so tiles hold blocks that all or some of their queries selected)."""
    idx = idx.clone()
    idx[:, 1::every] = idx[:, ::every][:, :idx[:, 1::every].shape[1]]
    return idx


@pytest.mark.parametrize("B, T, G, K, QT", [(1, 21, 2, 3, 4), (2, 9, 1, 16, 8), (1, 5, 1, 5, 1)])
def test_tile_union_kernel_equals_reference(B, T, G, K, QT):
    """The kernel's blocks, counts and every-query counts equal the reference's exactly, with a
    partial last tile, unions short of a power of two, and packed documents' table ids (few tiles:
    the kernel's sort is slow in the interpreter; the GPU runs a large case too)."""
    gen = torch.Generator().manual_seed(T)
    bs = 4
    cases = [(B, T, G, K, QT)] + ([(2, 3000, 4, 16, 8), (1, 1000, 2, 12, 16)] if DEVICE == "cuda" else [])
    some_full = some_partial = False
    for B, T, G, K, QT in cases:
        idx = _shared_rows(random_block_idx(B, T, G, K, bs, gen))
        doc_start = torch.where(torch.arange(T) >= T // 2, T // 2, 0).to(torch.int32).expand(B, T).contiguous()
        for ds in (None, doc_start):
            ds = None if ds is None else ds.to(DEVICE)
            clean = inverse_index.clean_block_idx(idx.to(DEVICE), bs, 0, ds)
            docs = None if ds is None else inverse_index.document_blocks(ds, bs)
            got = tiles.tile_union_triton(clean, QT, docs)
            want = reference.tile_union_reference(clean, QT, docs)
            for name in ("ids", "blocks", "count", "full"):
                assert torch.equal(getattr(got, name), getattr(want, name)), name
            some_full |= bool((want.full > 0).any())
            some_partial |= bool((want.full < want.count).any()) or QT == 1  # one query: all full
    assert some_full and some_partial


@pytest.mark.parametrize("K", [1, 4, 7, 16])
def test_clean_block_idx_kernel_equals_reference(K):
    """The cleaning kernel equals its torch definition exactly: -1, repeats, future blocks, 64-bit
    ids, a query offset and packed documents (whose blocks count from each document's start)."""
    gen = torch.Generator().manual_seed(K)
    # 92 rows: the kernel's 32 a program in three programs, the last one partial
    B, T, G, bs = 2, 23, 2, 8
    assert B * T * G % 32 and B * T * G > 64
    for q_offset in (0, 37):
        n = (q_offset + T) // bs + 3
        idx = torch.randint(-2, n, (B, T, G, K), generator=gen)
        if K > 1:
            idx[..., 1::2] = idx[..., 0::2][..., :K // 2]  # repeats
        # documents over several blocks, of one token (mid-row and the last) and cut mid-block
        cuts = torch.tensor([[0, 10, 11, 19], [0, 3, 20, 22]]) + q_offset
        pos = torch.arange(q_offset, q_offset + T)
        doc_start = torch.stack([c[(pos[:, None] >= c[None, :]).sum(1) - 1] for c in cuts]).to(torch.int32)
        for ds in (None, doc_start):
            got = inverse_index.clean_block_idx_triton(idx.to(DEVICE), bs, q_offset,
                                                       None if ds is None else ds.to(DEVICE))
            want = reference.clean_block_idx_reference(idx, bs, q_offset, ds)
            assert got.dtype == torch.int32 and torch.equal(got.cpu(), want)
            assert (want >= 0).any() and (want < 0).any()
            if ds is not None:
                # the documents change the answer: blocks count from each one's start
                assert not torch.equal(want, reference.clean_block_idx_reference(idx, bs, q_offset))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("tile_backward", [False, True], ids=["hybrid", "tiles"])
def test_tile_path_never_waits_on_the_device(tile_backward):
    """The per-tile choice and the unions' index are built on the device: a forward and backward
    of the tile path issue their work without a host synchronisation."""
    from gpu_sync import assert_no_host_sync

    B, T, Hq, G, D, bs, K = 1, 2048, 32, 2, 64, 64, 8
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, T, h, D, generator=gen).to(DEVICE, torch.bfloat16).requires_grad_()
               for h in (Hq, G, G))
    idx = random_block_idx(B, T, G, K, bs, gen).to(DEVICE)
    tuning = _tiles(128, tile_backward=tile_backward, tile_union_max=2.0)

    def step():
        o, _ = sparse_attention(q, k, v, idx, bs, backend="triton", check_ids=False, tuning=tuning)
        o.float().sum().backward()
    assert_no_host_sync(step)



GLUON = dataclasses.replace(sa_triton.DEFAULT_TUNING, bwd_gluon=True)
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def test_gluon_backward_compiles_for_hopper():
    """Gluon does not run in the interpreter, so on the CPU the Gluon backward is compiled for
    sm_90a (no GPU needed): its loader partition's cp.async gathers, the partitions' register
    split and the wgmma products are in the PTX."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from msa_model.ops.sparse_attention import gluon_backward

    fn = gluon_backward.gluon_bwd_kernel
    names = list(inspect.signature(fn.fn).parameters)
    ptrs = dict(Q="*bf16", K="*bf16", V="*bf16", DO="*bf16", LSE="*fp32", DELTA="*fp32", DQP="*bf16", DKP="*fp32",
                DVP="*fp32", ENTRY="*i32", ITEM_BUCKET="*i32", ITEM_START="*i32", ITEM_COUNT="*i32", BSTART="*i32",
                BEND="*i32", PBAR="*bf16")
    consts = dict(HQ=64, HKV=4, SLOTS=16, H=16, HP=16, QT=4, BS=128, D=128, DOCS=True, TEACHER=True, QTC=16,
                  STAGES=3, LW=gluon_backward.LOADER_WARPS, LOADER_REGS=gluon_backward.LOADER_REGS)
    sig = {n: ptrs.get(n) or ("constexpr" if n in consts else "fp32" if n.endswith("scale") else "i32") for n in names}
    src = GluonASTSource(fn=fn, signature=sig, constexprs={(names.index(n),): v for n, v in consts.items()},
                         attrs={(names.index(n),): [["tt.divisibility", 16]] for n in ptrs})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 128), options={"num_warps": 8}).asm["ptx"]
    assert "cp.async.cg.shared.global" in ptx and "cp.async.mbarrier.arrive.noinc" in ptx
    assert "setmaxnreg.inc" in ptx and "setmaxnreg.dec" in ptx
    assert "wgmma.mma_async" in ptx


def test_gluon_backward_asked_for_where_it_does_not_apply():
    """bwd_gluon where the Gluon kernel does not apply (head dim 16, 16-key blocks; on the CPU fp32
    too) is the Triton kernel's backward."""
    run_case(2, 50, 8, 2, 16, 16, 5, torch.float32 if DEVICE == "cpu" else torch.bfloat16, tuning=GLUON)


@pytest.mark.skipif(not HOPPER, reason="the Gluon backward needs an sm_90 GPU")
@pytest.mark.parametrize("Hq,G,K,stages", [(32, 2, 8, 3), (24, 2, 8, 2), (64, 4, 16, 3)])
def test_gluon_backward(Hq, G, K, stages):
    """Against the reference: random sets with empty slots, repeats and future blocks, an odd
    length, 16 and 12 heads a group (12: four of each entry's 16 rows are padding)."""
    run_case(2, 1000, Hq, G, 128, 128, K, torch.bfloat16, tuning=dataclasses.replace(GLUON, bwd_gluon_stages=stages))


@pytest.mark.skipif(not HOPPER, reason="the Gluon backward needs an sm_90 GPU")
@pytest.mark.parametrize("docs,q0,teacher", [(False, 0, True), (True, 0, True), (True, 300, False)])
def test_gluon_backward_equals_the_triton_kernel(docs, q0, teacher):
    """dq, dk, dv and the KL teacher's rows of the Triton kernel (equal bits at 8K and 32K in the
    benchmark; here within 1e-3), with packed documents (block tables) and a query slice
    (q_offset)."""
    from msa_model.ops.sparse_attention.gather import sparse_backward, sparse_forward

    gen = torch.Generator().manual_seed(3)
    B, T, Hq, G, D, bs, K = 2, 1100, 32, 2, 128, 128, 8
    mk = lambda *s: torch.randn(*s, generator=gen).to("cuda", torch.bfloat16)  # noqa: E731
    q, do = mk(B, T - q0, Hq, D), mk(B, T - q0, Hq, D)
    k, v = mk(B, T, G, D), mk(B, T, G, D)
    doc_start = None
    if docs:
        pos = torch.arange(T)
        doc_start = torch.stack([torch.where(pos < 333, 0, torch.where(pos < 340, 333, 340)),
                                 torch.where(pos < 700, 0, 700)]).to("cuda", torch.int32)[:, q0:]
    idx = inverse_index.clean_block_idx(random_block_idx(B, T - q0, G, K, bs, gen).cuda(), bs, q0, doc_start)
    table = None if doc_start is None else inverse_index.document_blocks(doc_start, bs, q0)
    o, lse, index = sparse_forward(q, k, v, idx, bs, D ** -0.5, q0, docs=table)
    out = []
    for tuning in (GLUON, sa_triton.DEFAULT_TUNING):
        pbar = torch.zeros(idx.numel(), bs, dtype=torch.bfloat16, device="cuda") if teacher else None
        grads = sparse_backward(do, q, k, v, o, lse, idx, bs, D ** -0.5, q0, index, tuning, table, pbar)
        out.append((*grads, pbar))
    for name, x, y in zip(("dq", "dk", "dv", "teacher"), *out):
        if y is not None:
            assert not torch.isnan(x).any(), name
            assert rel(x, y) < 1e-3, (name, rel(x, y))
