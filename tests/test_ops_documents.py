"""Packed documents (`doc_start`): every document is its own sequence.

A packed row must give exactly what running its documents one by one gives: the same selected
(document-relative) blocks, outputs, KL (the mean over every token) and gradients; query slices
with `q_offset` (context parallelism) must equal the rows of the whole call; the Triton kernels
(Triton's interpreter on CPU) must match the reference.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from msa_model.ops import MSASettings, indexer_kl_loss, msa_attention, select_blocks, sparse_attention

HQ, HKV, D, DI = 4, 2, 16, 8
# documents of each row: shorter than a block, a single token, longer than several blocks
DOCS = [[20, 3, 38], [9, 1, 17, 34]]
T = 61


def doc_starts(lengths_per_row) -> torch.Tensor:
    """int32 [B, T]: the first position of each token's document."""
    rows = []
    for lengths in lengths_per_row:
        row, pos = [], 0
        for n in lengths:
            row += [pos] * n
            pos += n
        rows.append(row)
    return torch.tensor(rows, dtype=torch.int32)


def spans(lengths):
    out, pos = [], 0
    for n in lengths:
        out.append((pos, pos + n))
        pos += n
    return out


def inputs(seed=0, dtype=torch.float64, B=2, T=T, Hq=HQ, G=HKV, d=D, di=DI, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(device, dtype)  # noqa: E731
    return mk(B, T, Hq, d), mk(B, T, G, d), mk(B, T, G, d), mk(B, T, G, di) * 2, mk(B, T, di)


@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
@pytest.mark.parametrize("force_sink", [False, True])
def test_packed_rows_equal_documents_run_alone(dense, force_sink):
    bs, topk = 8, 3
    leaves = [x.requires_grad_() for x in inputs()]
    q, k, v, iq, ik = leaves
    w = torch.randn(q.shape, generator=torch.Generator().manual_seed(1), dtype=q.dtype)
    ds = doc_starts(DOCS)
    settings = MSASettings(bs, topk, force_sink=force_sink, backend="reference")
    o, kl, idx, _ = msa_attention(q, k, v, iq, ik, settings, dense=dense, doc_start=ds)
    grads = torch.autograd.grad((o * w).sum() + 3.0 * kl, leaves)

    kl_docs, loss_docs = 0.0, 0.0
    for b, lengths in enumerate(DOCS):
        for a, e in spans(lengths):
            part = [x[b:b + 1, a:e] for x in leaves]
            o_d, kl_d, idx_d, _ = msa_attention(*part, settings, dense=dense)
            torch.testing.assert_close(o[b:b + 1, a:e], o_d, rtol=1e-12, atol=1e-12)
            if not dense:
                assert torch.equal(idx[b:b + 1, a:e], idx_d), (b, a, e)
            # the packed KL is the mean over every token of the batch
            share = (e - a) / (len(DOCS) * T)
            kl_docs = kl_docs + kl_d * share
            loss_docs = loss_docs + (o_d * w[b:b + 1, a:e]).sum() + 3.0 * kl_d * share
    torch.testing.assert_close(kl, kl_docs, rtol=1e-12, atol=1e-12)
    for name, x, r in zip("q k v iq ik".split(), grads, torch.autograd.grad(loss_docs, leaves)):
        torch.testing.assert_close(x, r, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
def test_query_slices_with_documents_match_the_full_call(dense):
    """Context parallelism: slices of the queries (q_offset, doc_start sliced alike) against the
    whole keys give the rows of the one call, documents crossing the cuts included."""
    bs, topk = 8, 3
    q, k, v, iq, ik = inputs(seed=2)
    ds = doc_starts(DOCS)
    settings = MSASettings(bs, topk, backend="reference")
    o, kl, idx, _ = msa_attention(q, k, v, iq, ik, settings, dense=dense, doc_start=ds)
    total = 0.0
    for t0, t1 in [(0, 16), (45, 61), (16, 30), (30, 45)]:
        o_p, kl_p, idx_p, _ = msa_attention(q[:, t0:t1], k, v, iq[:, t0:t1], ik, settings, dense=dense, q_offset=t0,
                                            doc_start=ds[:, t0:t1])
        torch.testing.assert_close(o_p, o[:, t0:t1], rtol=1e-12, atol=1e-12)
        if not dense:
            assert torch.equal(idx_p, idx[:, t0:t1])
        total = total + kl_p * (t1 - t0) / T
    torch.testing.assert_close(total, kl, rtol=1e-12, atol=1e-12)


def test_one_document_per_row_is_the_default():
    """doc_start of all zeros is one document per row: the same numbers as doc_start=None."""
    q, k, v, iq, ik = inputs(seed=3)
    zeros = torch.zeros(2, T, dtype=torch.int32)
    for dense in (False, True):
        a = msa_attention(q, k, v, iq, ik, MSASettings(8, 3, backend="reference"), dense=dense)
        b = msa_attention(q, k, v, iq, ik, MSASettings(8, 3, backend="reference"), dense=dense, doc_start=zeros)
        for x, y in zip(a[:3], b[:3]):
            assert (x is None and y is None) or torch.equal(x, y)


def test_bad_doc_start_is_refused():
    q, k, v, iq, ik = inputs()
    ds = doc_starts(DOCS)
    with pytest.raises(ValueError, match="doc_start must be"):
        sparse_attention(q, k, v, None, 8, backend="reference", doc_start=ds[:, :10])
    with pytest.raises(TypeError, match="int32 or int64"):
        select_blocks(iq, ik, 8, 3, backend="reference", doc_start=ds.float())
    future = ds.clone()
    future[0, 5] = 6
    with pytest.raises(ValueError, match="outside"):
        select_blocks(iq, ik, 8, 3, backend="reference", doc_start=future)
    gap = ds.clone()
    gap[1, 30:] = 29  # a document "starting" at a position none of its queries holds
    with pytest.raises(ValueError, match="consecutive documents"):
        msa_attention(q, k, v, iq, ik, MSASettings(8, 3, backend="reference"), doc_start=gap)
    # the same starts from the data pipeline pass unchecked (no host synchronisation)
    msa_attention(q, k, v, iq, ik, MSASettings(8, 3, backend="reference"), doc_start=gap, check_ids=False)


# The Triton kernels (Triton's interpreter on CPU) against the reference with documents. fp32 runs
# only in the interpreter (its bf16 dot is emulated), bf16 is checked against PyTorch's own bf16
# error as the other kernel tests do; outputs and partial buffers start as NaN.
CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def random_doc_block_idx(ds, G, K, bs, gen, q_offset=0):
    """Random document-relative sets: the local block in slot 0, -1 slots, repeats and a block
    after the query's own (which reads nothing)."""
    B, T = ds.shape
    local = ((q_offset + torch.arange(T))[None, :] - ds.long()) // bs
    idx = (torch.rand(B, T, G, K, generator=gen) * (local[..., None, None] + 1)).long()
    idx[..., 0] = local[..., None]
    idx = torch.where(torch.rand(B, T, G, K, generator=gen) < 0.2, -1, idx)
    idx[:, ::3, :, 1] = idx[:, ::3, :, 0]
    idx[:, 1::5, :, K - 1] = local[:, 1::5, None] + 1
    return idx.to(torch.int32)


@pytest.fixture
def poisoned(monkeypatch):
    """Uninitialised buffers of the launchers hold NaN (floats) or garbage (ints)."""
    from msa_model.ops.indexer_kl import triton as kl_triton
    from msa_model.ops.sparse_attention import triton as sa_triton
    from test_sparse_attention_triton import _PoisonedTorch

    for module in (sa_triton, kl_triton):
        monkeypatch.setattr(module, "torch", _PoisonedTorch())


@pytest.mark.parametrize("G,bs,topk,force_sink,q0", [(1, 16, 2, False, 0), (3, 16, 3, True, 0), (2, 32, 2, False, 29)])
def test_triton_select_blocks_with_documents(G, bs, topk, force_sink, q0):
    _, _, _, iq, ik = inputs(seed=4, dtype=torch.float32, G=G, di=16, device=DEV)
    ds = doc_starts(DOCS).to(DEV)[:, q0:]
    kw = dict(block_size=bs, topk=topk, force_sink=force_sink, q_offset=q0, doc_start=ds)
    got = select_blocks(iq[:, q0:], ik, backend="triton", **kw)
    want = select_blocks(iq[:, q0:], ik, backend="reference", **kw)
    assert torch.equal(got.sort(-1).values, want.sort(-1).values)


def _attention(q, k, v, idx, ds, bs, backend, q0, w, dt, tuning=None):
    q, k, v = (x.detach().to(dt).requires_grad_() for x in (q, k, v))
    o, lse = sparse_attention(q, k, v, idx, bs, backend=backend, q_offset=q0, doc_start=ds, tuning=tuning)
    return (o, lse, *torch.autograd.grad((o.float() * w).sum(), (q, k, v)))


# (Hq, G, q_offset, dtype): GQA 2 and 3 heads per group, a query slice starting inside a document
ATTENTION_CASES = ([(4, 2, 0, torch.float32), (6, 2, 23, torch.float32), (4, 2, 0, torch.bfloat16)] if not CUDA
                   else [(4, 2, 0, torch.bfloat16), (6, 2, 23, torch.bfloat16)])


@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
@pytest.mark.parametrize("Hq,G,q0,dtype", ATTENTION_CASES, ids=lambda c: str(c))
def test_triton_sparse_attention_with_documents(Hq, G, q0, dtype, dense, poisoned):
    _check_attention_with_documents(Hq, G, q0, dtype, dense)


def test_triton_tile_path_with_documents(poisoned):
    """The tile-union path: a tile's queries straddle documents, so its union holds blocks of
    several (table ids), each row reading its own document's only."""
    import dataclasses

    from msa_model.ops.sparse_attention.triton import DEFAULT_TUNING

    tuning = dataclasses.replace(DEFAULT_TUNING, tile_rows=8, tile_dkdv_tiles=2, tile_backward=True, tile_min_heads=1,
                                 tile_min_queries=0)
    # 8 rows of 3 heads (4 with padding) are tiles of 2 queries: from query 22 on, some tile's two
    # queries are in two documents
    q0 = 22
    starts = doc_starts(DOCS)[:, q0:]
    pairs = starts[:, :starts.shape[1] // 2 * 2].reshape(starts.shape[0], -1, 2)
    assert (pairs[..., 0] != pairs[..., 1]).any()
    _check_attention_with_documents(6, 2, q0, torch.bfloat16 if CUDA else torch.float32, False, tuning)
    # the hybrid forward: the tiles of few blocks on the tile path, the others gathered
    tuning = dataclasses.replace(tuning, tile_backward=False, tile_union_max=1.25)
    _check_attention_with_documents(6, 2, q0, torch.bfloat16 if CUDA else torch.float32, False, tuning)
    # sets shared within a document: the tile kernel reads a document's earlier blocks unmasked;
    # with one query a tile (4 rows of 3 heads) also a document's cut last block would qualify by
    # its end, but the kernel loads a whole block's keys from its start
    for rows in (8, 4):
        _check_attention_with_documents(6, 2, 23, torch.bfloat16 if CUDA else torch.float32, False,
                                        dataclasses.replace(tuning, tile_rows=rows), shared=True)


def shared_doc_block_idx(ds, G, bs, q_offset=0):
    """Each query's local block and its document's blocks 0 and 1 (those after its own read
    nothing): the queries of a tile inside a document share them."""
    B, T = ds.shape
    local = ((q_offset + torch.arange(T))[None, :] - ds.long()) // bs
    idx = torch.stack([local, torch.zeros_like(local), torch.ones_like(local), torch.full_like(local, -1)], -1)
    return idx[:, :, None].expand(B, T, G, 4).to(torch.int32).contiguous()


def _check_attention_with_documents(Hq, G, q0, dtype, dense, tuning=None, shared=False):
    bs = 16
    gen = torch.Generator().manual_seed(5)
    q, k, v, _, _ = inputs(seed=5, dtype=torch.float32, Hq=Hq, G=G, device=DEV)
    ds = doc_starts(DOCS)[:, q0:]
    idx = (None if dense else shared_doc_block_idx(ds, G, bs, q0).to(DEV) if shared
           else random_doc_block_idx(ds, G, 4, bs, gen, q0).to(DEV))
    ds = ds.to(DEV)
    w = torch.randn(q[:, q0:].shape, generator=gen).to(DEV)
    args = (q[:, q0:], k, v, idx, ds, bs)
    out = _attention(*args, "triton", q0, w, dtype, tuning)
    truth = _attention(*args, "reference", q0, w, torch.float64)
    names = ("o", "lse", "dq", "dk", "dv")
    for name, x in zip(names, out):
        assert not torch.isnan(x).any(), name
    # rows whose slots name no causal block have an empty support: lse = -inf in both
    empty = torch.isinf(truth[1])
    assert (dense or shared or empty.any()) and torch.equal(torch.isinf(out[1]), empty)
    out, truth = list(out), list(truth)
    out[1], truth[1] = out[1][~empty], truth[1][~empty]
    if dtype == torch.float32:
        for name, x, r in zip(names, out, truth):
            assert rel(x, r) < 1e-5, (name, rel(x, r))
        return
    from msa_model.ops.sparse_attention.reference import sparse_attention_reference

    # PyTorch computing the same in bf16: the yardstick of the kernel's error
    qq, kk, vv = (x.detach().to(dtype).requires_grad_() for x in (q[:, q0:], k, v))
    o, lse = sparse_attention_reference(qq, kk, vv, idx, bs, D ** -0.5, upcast=False, q_offset=q0, doc_start=ds)
    base = (o, lse[~empty], *torch.autograd.grad((o.float() * w).sum(), (qq, kk, vv)))
    for name, x, b, r in zip(names, out, base, truth):
        assert rel(x, r) <= 2 * rel(b, r) + 1e-6, (name, rel(x, r), rel(b, r))


@pytest.mark.parametrize("dense,teacher_bytes", [(False, None), (False, 0), (True, None)],
                         ids=["sparse-stored", "sparse-recompute", "dense"])
@pytest.mark.parametrize("Hq,G,q0", [(4, 2, 0), (6, 3, 23)])
def test_triton_indexer_kl_with_documents(Hq, G, q0, dense, teacher_bytes):
    from msa_model.ops.indexer_kl.triton import DEFAULT_TUNING

    tuning = DEFAULT_TUNING if teacher_bytes is None else dataclasses.replace(DEFAULT_TUNING, teacher_bytes=0)
    bs, topk = 16, 2
    dtype = torch.bfloat16 if CUDA else torch.float32
    q, k, v, iq, ik = inputs(seed=6, dtype=dtype, Hq=Hq, G=G, di=16, device=DEV)
    ds = doc_starts(DOCS).to(DEV)[:, q0:]
    idx = None if dense else select_blocks(iq[:, q0:], ik, bs, topk, backend="reference", q_offset=q0, doc_start=ds)
    _, lse = sparse_attention(q[:, q0:], k, v, idx, bs, backend="reference", q_offset=q0, doc_start=ds)
    outs = []
    for backend in ("triton", "reference"):
        a, b = (x.detach().clone().requires_grad_() for x in (iq[:, q0:], ik))
        kl = indexer_kl_loss(q[:, q0:], k, a, b, idx, lse, bs, backend=backend, q_offset=q0, doc_start=ds,
                             tuning=tuning)
        outs.append((kl, *torch.autograd.grad(kl, (a, b))))
    (kl, diq, dik), (kl_ref, diq_ref, dik_ref) = outs
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert abs(float(kl) - float(kl_ref)) <= tol * abs(float(kl_ref))
    assert rel(diq, diq_ref) < 2 * tol and rel(dik, dik_ref) < 2 * tol, (rel(diq, diq_ref), rel(dik, dik_ref))


def test_triton_one_document_per_row_is_the_default():
    """All-zero starts (one document per row) run the document paths of every kernel; they give
    what doc_start=None gives."""
    q, k, v, iq, ik = inputs(seed=7, dtype=torch.float32 if not CUDA else torch.bfloat16, device=DEV, di=16, B=1,
                             T=40)
    zeros = torch.zeros(q.shape[:2], dtype=torch.int32, device=DEV)
    tol = 1e-5 if not CUDA else 1e-2
    for dense in (False, True):
        a = msa_attention(q, k, v, iq, ik, MSASettings(16, 2, backend="triton"), dense=dense)
        b = msa_attention(q, k, v, iq, ik, MSASettings(16, 2, backend="triton"), dense=dense, doc_start=zeros)
        assert dense or torch.equal(a[2].sort(-1).values, b[2].sort(-1).values)
        assert rel(b[0], a[0]) < tol and abs(float(b[1]) - float(a[1])) <= tol * abs(float(a[1]))


@pytest.mark.parametrize("q_offset", [0, 7])
def test_document_table_size_comes_from_the_host_copy(q_offset):
    """The sparse paths size their document block table from the starts' host copy when the
    trainer attached one (no read back from the device), once per tensor; layers' query chunks
    and int32 conversions keep the copy; with or without it the table is the same."""
    from msa_model.ops.common import as_int32, attach_host_copy, doc_rows, host_copy
    from msa_model.ops.sparse_attention.inverse_index import document_blocks, table_size

    gen = torch.Generator().manual_seed(3)
    pos = torch.arange(q_offset, q_offset + T, dtype=torch.int32)
    for _ in range(5):
        # documents opening at random queries; the first began before the rows (start 0)
        opens = torch.rand(3, T, generator=gen) < 0.15
        opens[:, 0] = False
        starts = torch.cummax(torch.where(opens, pos, 0), dim=1).values.to(torch.int32)
        want = document_blocks(starts, 8, q_offset)
        # a host copy that disagrees with the tensor shows which one the size is read from: every
        # query of its last row a document of its own (T blocks)
        host = starts.clone()
        host[-1] = pos
        dev = attach_host_copy(starts.clone(), host)
        assert want.n_blocks < T and table_size(dev, 8, q_offset) == T
        host[-1] = starts[-1]
        assert table_size(dev, 8, q_offset) == T  # computed once, cached on the tensor
        fresh = attach_host_copy(starts.clone(), starts.clone())
        got = document_blocks(fresh, 8, q_offset)
        for name in ("base", "start", "end"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        assert got.n_blocks == want.n_blocks
    # what the layers and ops hand on keeps the copy
    assert doc_rows(fresh, 0, T) is fresh
    chunk = doc_rows(fresh, 10, 30)
    assert torch.equal(host_copy(chunk), host_copy(fresh)[:, 10:30])
    wide = attach_host_copy(fresh.long(), host_copy(fresh))
    assert host_copy(as_int32(wide)) is host_copy(fresh) and as_int32(wide).dtype == torch.int32


def _reserved_table_run(starts, teacher, tuning=None):
    """(block_idx, o, kl, and the five gradients) of the Triton msa_attention on the reserved-table
    tests' inputs (B = 2 rows of DOCS, GQA 3) with document starts `starts`."""
    from msa_model.ops import KernelTuning

    bs, topk = 16, 2
    dtype = torch.bfloat16 if CUDA else torch.float32
    q, k, v, iq, ik = inputs(seed=8, dtype=dtype, Hq=6, G=2, di=16, device=DEV)
    w = torch.randn(q.shape, generator=torch.Generator().manual_seed(9)).to(DEV)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, iq, ik)]
    out = msa_attention(*leaves, MSASettings(bs, topk, backend="triton", kl_teacher=teacher,
                                             tuning=tuning or KernelTuning()), doc_start=starts, check_ids=False)
    assert out.kl_in_backward == (teacher == "backward")
    grads = torch.autograd.grad((out.o.float() * w).sum() + out.kl, leaves)
    # the late teacher's KL holds its value after the backward
    return out.block_idx, out.o.detach(), out.kl.detach().clone(), *grads


@functools.cache
def _needed_table_result(teacher):
    """`_reserved_table_run` with DOCS' starts as they are (the table they need), the default
    tuning: what both reserved-table tests compare with, computed once."""
    return _reserved_table_run(doc_starts(DOCS).to(DEV), teacher)


@pytest.mark.parametrize("teacher", ["forward", "backward"])
def test_a_reserved_document_table_gives_the_same_results(teacher):
    """A CUDA graph's starts keep the table size of their capture (`reserve_table`): a table larger
    than the starts need (empty entries past each row's blocks) gives the same output, KL and
    gradients as the table they need."""
    from msa_model.ops.sparse_attention.inverse_index import reserve_table, table_size

    bs = 16
    ds = doc_starts(DOCS).to(DEV)
    want = _needed_table_result(teacher)
    padded = ds.clone()
    reserve_table(padded, bs, table_size(ds, bs) + 37)
    got = _reserved_table_run(padded, teacher)
    assert table_size(padded, bs) == table_size(ds, bs) + 37
    assert torch.equal(got[0], want[0])
    for name, x, r in zip(("o", "kl", "dq", "dk", "dv", "d iq", "d ik"), got[1:], want[1:]):
        assert rel(x, r) < 1e-6, (name, rel(x, r))


def test_a_reserved_document_table_reaches_the_query_chunks(monkeypatch):
    """A graph's static starts have no host copy, only the table size reserved at the capture: the
    query chunks of a late-teacher call over its row budget, and their int32 copies, keep it (a
    chunk's rows have at most the blocks of the whole rows), so no chunk reads its starts back
    from the device (a synchronisation, which a capture refuses) and the results are one call's."""
    from msa_model.ops import KernelTuning
    from msa_model.ops.common import as_int32, doc_rows
    from msa_model.ops.indexer_kl.tuning import Tuning as KLTuning
    from msa_model.ops.msa_attention import late_teacher
    from msa_model.ops.sparse_attention.inverse_index import reserve_table, table_size

    bs, topk = 16, 2
    ds = doc_starts(DOCS).to(DEV)
    n = table_size(ds, bs) + 5
    padded = ds.clone()
    reserve_table(padded, bs, n)
    for a, b in ((10, 30), (0, 40), (45, T)):
        rows = as_int32(doc_rows(padded, a, b))
        assert table_size(rows, bs, a) == n >= table_size(ds[:, a:b].clone(), bs, a), (a, b)

    tables = []  # the table size of each attention forward of the late path
    forward = late_teacher.sa_triton.attention_forward

    def spy(*args, **kwargs):
        o, lse, state = forward(*args, **kwargs)
        tables.append(state.docs.n_blocks)
        return o, lse, state

    monkeypatch.setattr(late_teacher.sa_triton, "attention_forward", spy)
    q = inputs(seed=8, dtype=torch.bfloat16 if CUDA else torch.float32, Hq=6, G=2, di=16, device=DEV)[0]
    one = late_teacher.teacher_bytes(q, 2, topk, bs, queries=1)
    want = _needed_table_result("backward")  # one call, the table the starts need
    tables.clear()
    got = _reserved_table_run(padded, "backward", KernelTuning(indexer_kl=KLTuning(teacher_bytes=25 * one)))
    assert tables == [n] * 3, tables
    assert torch.equal(got[0], want[0])
    for name, x, r in zip(("o", "kl", "dq", "dk", "dv", "d iq", "d ik"), got[1:], want[1:]):
        assert rel(x, r) < (1e-2 if CUDA else 1e-5), (name, rel(x, r))
