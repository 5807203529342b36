"""msa_attention with kl_teacher="backward" (ops/msa_attention/late_teacher.py): the KL's teacher rows come from
the attention's backward, the KL's value is filled in there. Against the float64 reference ops on
the same selection (value and every gradient) and against kl_teacher="forward"; on CPU the
kernels run in Triton's interpreter, so shapes are small."""

from __future__ import annotations

import math

import pytest
import torch

from msa_model.ops import (KernelTuning, MSASettings, indexer_kl_loss, late_teacher_applies, msa_attention,
                           sparse_attention)

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
# fp32 in the interpreter (exact products), bf16 on a GPU
DTYPE = torch.bfloat16 if CUDA else torch.float32
TOL = 2e-2 if CUDA else 1e-4


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def inputs(B, T, Hq, G, D, Di, q_offset=0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=gen).to(DEV, DTYPE).requires_grad_()  # noqa: E731
    TK = q_offset + T
    return mk(B, T, Hq, D), mk(B, TK, G, D), mk(B, TK, G, D), mk(B, T, G, Di), mk(B, TK, Di)


def starts(B, T, q_offset, cut):
    """Documents: one ending at position `cut`, the next from there (positions q_offset + t)."""
    pos = q_offset + torch.arange(T)
    return torch.where(pos < cut, 0, cut).to(torch.int32).expand(B, T).contiguous().to(DEV)


def settings(block_size, topk, tuning=None, **kw):
    """The Triton backend's settings, `tuning` a KernelTuning or None (the defaults)."""
    return MSASettings(block_size=block_size, topk=topk, backend="triton", tuning=tuning or KernelTuning(), **kw)


def step(leaves, do, teacher, block_size, topk, tuning=None, **kw):
    seen = []
    out = msa_attention(*leaves, settings(block_size, topk, tuning, kl_teacher=teacher), on_kl=seen.append, **kw)
    o, kl, block_idx = out.o, out.kl, out.block_idx
    # every call here takes the teacher it asks for
    assert out.kl_in_backward == (teacher == "backward")
    before = kl.detach().clone()
    grads = torch.autograd.grad([o, kl], leaves, [do, torch.full_like(kl, 0.7)])
    return o, kl, before, seen, block_idx, grads


# (B, T, Hq, G, D, Di, block_size, topk, q_offset, document cut): odd lengths, 1-3 heads per group
# (3: padded head rows), slots left empty early in the sequence, context-parallel offsets, documents
CASES = [
    (1, 70, 4, 2, 16, 16, 16, 3, 0, None),
    (2, 45, 6, 2, 16, 32, 16, 4, 0, None),
    (1, 50, 2, 2, 32, 16, 16, 2, 30, None),
    (2, 64, 4, 1, 16, 16, 16, 3, 0, 29),
    (1, 40, 4, 2, 16, 16, 16, 3, 24, 37),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}T{}Hq{}G{}D{}Di{}bs{}k{}off{}doc{}".format(*c))
def test_late_teacher_matches_the_reference(case):
    check_against_the_reference(case)


@pytest.mark.parametrize("case", [CASES[0], CASES[4]], ids=["plain", "offset-documents"])
def test_late_teacher_after_the_hybrid_forward(case):
    """The attention's forward on the hybrid path (tiles whose union is small on the tile kernel,
    the others' queries gathered; calls of 8K queries and more at the production geometry), the
    backward and its teacher rows on the gather path."""
    import dataclasses

    from msa_model.ops.sparse_attention import tiles
    from msa_model.ops.sparse_attention.inverse_index import clean_block_idx, document_blocks
    from msa_model.ops.sparse_attention import triton as sa_triton

    # tiles of 4 queries of 2 heads; a tile whose union passes topk blocks is gathered
    hybrid = dataclasses.replace(sa_triton.DEFAULT_TUNING, tile_rows=8, tile_keys=16, tile_min_heads=1,
                                 tile_min_queries=0, tile_union_max=1.0)
    block_idx = check_against_the_reference(case, KernelTuning(sparse_attention=hybrid))
    # both paths ran: some tiles' unions are within the limit, some beyond it (in the interpreter,
    # whose tiles hold 4 queries; a GPU's hold at least 16 rows, 8 queries, mostly beyond it)
    if CUDA:
        return
    B, T, Hq, G, D, Di, bs, topk, off, cut = case
    doc = None if cut is None else starts(B, T, off, cut).to(torch.int32)
    union = tiles.tile_union(clean_block_idx(block_idx, bs, off, doc), tiles.tile_queries(hybrid, Hq // G),
                                 None if doc is None else document_blocks(doc, bs, off))
    over = int((union.count > topk).sum())
    assert 0 < over < union.count.numel()


def check_against_the_reference(case, tuning=None):
    B, T, Hq, G, D, Di, bs, topk, off, cut = case
    leaves = inputs(B, T, Hq, G, D, Di, off, seed=T + Hq)
    doc = None if cut is None else starts(B, T, off, cut)
    kw = dict(block_size=bs, topk=topk, q_offset=off, doc_start=doc, tuning=tuning)
    assert late_teacher_applies(*leaves, settings(bs, topk, tuning))
    do = torch.randn(leaves[0].shape, generator=torch.Generator().manual_seed(1)).to(DEV, DTYPE)
    o, kl, before, seen, block_idx, grads = step(leaves, do, "backward", **kw)
    # the value comes with the backward: NaN before, filled in place and reported once after
    assert math.isnan(before.item())
    assert len(seen) == 1 and seen[0].item() == kl.item()

    ref = [x.detach().double().requires_grad_() for x in leaves]
    rq, rk, rv, riq, rik = ref
    ro, rlse = sparse_attention(rq, rk, rv, block_idx, bs, backend="reference", q_offset=off, doc_start=doc)
    rkl = indexer_kl_loss(rq.detach(), rk.detach(), riq, rik, block_idx, rlse.detach(), bs, backend="reference",
                          q_offset=off, doc_start=doc)
    want = torch.autograd.grad([ro, rkl], ref, [do.double(), torch.full_like(rkl, 0.7)])
    assert rel(o, ro) < TOL and abs(kl.item() - rkl.item()) < TOL * max(1.0, abs(rkl.item()))
    for name, g, w in zip(("dq", "dk", "dv", "d iq", "d ik"), grads, want):
        assert torch.isfinite(g).all(), name
        assert rel(g, w) < TOL, (name, rel(g, w))

    # and the forward-teacher path on the same inputs: same value and gradients (the value on
    # return, so on_kl is not called)
    _, kl_f, before_f, seen_f, idx_f, grads_f = step(leaves, do, "forward", **kw)
    assert torch.equal(idx_f, block_idx) and before_f.item() == kl_f.item() and not seen_f
    assert abs(kl_f.item() - kl.item()) < 1e-3 * max(1.0, abs(kl.item()))
    for name, g, w in zip(("dq", "dk", "dv", "d iq", "d ik"), grads, grads_f):
        assert rel(g, w) < (1e-2 if CUDA else 1e-5), (name, rel(g, w))
    return block_idx


def test_tile_backward_setting_keeps_the_late_teacher_where_the_gather_backward_runs():
    """`Tuning.tile_backward` refuses the late teacher only for calls that take the tile backward
    (which writes no teacher rows); a shorter call, or heads of 256, runs the gather backward, so
    the teacher still comes from it, with the default tuning's result."""
    from msa_model.ops.sparse_attention.triton import DEFAULT_TUNING
    import dataclasses

    leaves = inputs(1, 40, 4, 2, 16, 16, seed=5)
    bs, topk = 16, 2
    wanting = dataclasses.replace(DEFAULT_TUNING, tile_backward=True)  # 32768 queries at least
    taking = dataclasses.replace(wanting, tile_min_queries=0, tile_min_heads=1)
    assert late_teacher_applies(*leaves, settings(bs, topk, KernelTuning(sparse_attention=wanting)))
    assert not late_teacher_applies(*leaves, settings(bs, topk, KernelTuning(sparse_attention=taking)))
    wide = [x.detach()[..., :1].expand(*x.shape[:-1], 256) for x in leaves[:3]] + list(leaves[3:])
    assert late_teacher_applies(*wide, settings(bs, topk, KernelTuning(sparse_attention=taking)))
    do = torch.randn(leaves[0].shape, generator=torch.Generator().manual_seed(1)).to(DEV, DTYPE)
    o, kl, before, seen, _, grads = step(leaves, do, "backward", block_size=bs, topk=topk,
                                         tuning=KernelTuning(sparse_attention=wanting))
    assert math.isnan(before.item()) and len(seen) == 1
    o1, kl1, _, _, _, grads1 = step(leaves, do, "backward", block_size=bs, topk=topk)
    assert torch.equal(o, o1) and kl.item() == kl1.item()
    for g, w in zip(grads, grads1):
        assert torch.equal(g, w)


def test_without_a_graph_the_teacher_comes_from_the_forward():
    """No backward will run (no_grad, or the reference backend): kl holds its value on return (the
    output says so, and on_kl, which the backward would call, is not)."""
    leaves = inputs(1, 40, 4, 2, 16, 16)
    for ctx, backend in ((torch.no_grad, "triton"), (torch.enable_grad, "reference")):
        late = MSASettings(block_size=16, topk=2, backend=backend, kl_teacher="backward")
        with ctx():
            assert not late_teacher_applies(*leaves, late)
            seen = []
            out = msa_attention(*leaves, late, on_kl=seen.append)
        assert math.isfinite(out.kl.item()) and not out.kl_in_backward and not seen
    with pytest.raises(ValueError, match="kl_teacher"):
        MSASettings(block_size=16, topk=2, kl_teacher="later")


def test_only_the_kl_needs_a_gradient():
    """A backward from the KL alone still runs the attention's backward for the teacher (o's
    gradient is zero): the index inputs get the forward path's gradients."""
    leaves = inputs(1, 48, 4, 2, 16, 16, seed=3)
    got = {}
    for teacher in ("backward", "forward"):
        o, kl, _, _ = msa_attention(*leaves, settings(16, 3, kl_teacher=teacher))
        got[teacher] = (*torch.autograd.grad(kl, leaves[3:]), kl.item())
    assert abs(got["backward"][2] - got["forward"][2]) < 1e-4
    for g, w in zip(got["backward"][:2], got["forward"][:2]):
        assert rel(g, w) < (1e-2 if CUDA else 1e-5)


def test_the_backward_writes_every_teacher_row_the_loss_reads():
    """The attention's backward writes the rows of every selected slot and the KL reads no other:
    rows left NaN elsewhere (as an uninitialised buffer may hold) do not reach the loss."""
    from msa_model.ops import select_blocks
    from msa_model.ops.indexer_kl import triton as kl_triton
    from msa_model.ops.sparse_attention.inverse_index import clean_block_idx
    from msa_model.ops.sparse_attention import gather

    B, T, Hq, G, D, Di, bs, topk = 2, 53, 4, 2, 16, 16, 16, 4
    q, k, v, iq, ik = (x.detach() for x in inputs(B, T, Hq, G, D, Di, seed=9))
    block_idx = select_blocks(iq, ik, bs, topk, backend="reference")
    idx = clean_block_idx(block_idx, bs)
    # early queries have fewer blocks than slots, the last block's queries fill every slot
    assert (idx < 0).any() and (idx >= 0).all(-1).any()
    o, lse, index = gather.sparse_forward(q, k, v, idx, bs, D ** -0.5)
    pbar = torch.full((B * T * G * topk, bs), float("nan"), dtype=kl_triton.teacher_dtype(q), device=DEV)
    gather.sparse_backward(torch.randn_like(o), q, k, v, o, lse, idx, bs, D ** -0.5, index=index, teacher=pbar)
    written = ~pbar.isnan().any(-1)
    assert torch.equal(written, (idx >= 0).flatten())
    kl_index = index.whole()  # the attention's index serves the KL
    lse_z = kl_triton.student_lse(iq, ik, kl_index, topk, bs, Di ** -0.5)
    want = indexer_kl_loss(q.double(), k.double(), iq.double(), ik.double(), block_idx, lse.double(), bs,
                           backend="reference")
    kl_BTG, dik, diq = kl_triton.teacher_backward(iq, ik, pbar, idx, lse_z, kl_index, topk, bs, Di ** -0.5)
    assert torch.isfinite(kl_BTG).all() and torch.isfinite(dik).all() and torch.isfinite(diq).all()
    assert abs(kl_BTG.double().mean().item() - want.item()) < TOL * max(1.0, want.item())


def test_without_the_kl():
    """with_kl=False (passes that drop the KL) gives the same output and no KL."""
    leaves = inputs(1, 40, 4, 2, 16, 16, seed=5)
    seen = []
    with torch.no_grad():
        o, kl, _, _ = msa_attention(*leaves, settings(16, 2), with_kl=False, on_kl=seen.append)
        o_kl = msa_attention(*leaves, settings(16, 2)).o
    assert kl is None and not seen and torch.equal(o, o_kl)


# batch 2: the chunks' slices are copies; batch 1: views, which the kernels write into
@pytest.mark.parametrize("B,cut", [(2, None), (1, 30)])
def test_calls_over_the_row_budget_run_as_query_chunks(B, cut, monkeypatch):
    """Teacher rows over the KL's teacher_bytes: the call runs as query chunks whose rows fit
    (here three, of 14, 14 and 12 queries; with documents, the cut inside the second), with the
    same output, KL and gradients as one call; the KL is NaN until the backward has run and is
    then reported once."""
    from msa_model.ops.indexer_kl.tuning import Tuning as KLTuning
    from msa_model.ops.msa_attention import late_teacher
    from msa_model.ops.msa_attention.late_teacher import query_chunk, teacher_bytes

    calls, index_chunks = [], []  # each attention forward the late path runs: its queries, its index's chunks
    forward = late_teacher.sa_triton.attention_forward

    def spy(q, *a, **kw):
        o, lse, state = forward(q, *a, **kw)
        calls.append(q.shape[1])
        index_chunks.append(state.index.n_chunks)
        return o, lse, state

    monkeypatch.setattr(late_teacher.sa_triton, "attention_forward", spy)

    T, Hq, G, D, Di, bs, topk, off = 40, 4, 2, 16, 16, 16, 3, 10
    leaves = inputs(B, T, Hq, G, D, Di, off, seed=11)
    one = teacher_bytes(leaves[0], G, topk, bs, queries=1)
    tight = KernelTuning(indexer_kl=KLTuning(teacher_bytes=15 * one))
    assert query_chunk(leaves[0], G, topk, bs, 15 * one) == 14
    assert late_teacher_applies(*leaves, settings(bs, topk, tight))
    kw = dict(block_size=bs, topk=topk, q_offset=off, doc_start=None if cut is None else starts(B, T, off, cut))
    do = torch.randn(leaves[0].shape, generator=torch.Generator().manual_seed(2)).to(DEV, DTYPE)
    o1, kl1, before1, seen1, idx1, grads1 = step(leaves, do, "backward", **kw)
    assert calls == [T]
    o3, kl3, before3, seen3, idx3, grads3 = step(leaves, do, "backward", tuning=tight, **kw)
    assert calls == [T, 14, 14, 12]
    assert math.isnan(before3.item()) and len(seen3) == 1 and seen3[0].item() == kl3.item()
    assert torch.equal(idx1, idx3)
    assert rel(o3, o1) < 1e-6 and abs(kl3.item() - kl1.item()) < 1e-5 * max(1.0, abs(kl1.item()))
    for name, g, w in zip(("dq", "dk", "dv", "d iq", "d ik"), grads3, grads1):
        assert rel(g, w) < (1e-2 if CUDA else 1e-5), (name, rel(g, w))
    # the attention's index in query chunks (small partial buffers): the KL walks its unchunked view
    from msa_model.ops.sparse_attention.tuning import Tuning as SATuning

    per_query = B * G * topk * (Hq // G) * (D * 4 + 4)
    small = KernelTuning(sparse_attention=SATuning(partial_bytes=16 * per_query, partial_min_bytes=0))
    o5, kl5, _, seen5, _, grads5 = step(leaves, do, "backward", tuning=small, **kw)
    assert calls[4:] == [T] and index_chunks[4] > 1
    assert len(seen5) == 1 and rel(o5, o1) < 1e-6 and abs(kl5.item() - kl1.item()) < 1e-5 * max(1.0, abs(kl1.item()))
    for name, g, w in zip(("dq", "dk", "dv", "d iq", "d ik"), grads5, grads1):
        assert rel(g, w) < (1e-2 if CUDA else 1e-5), (name, rel(g, w))
    # no query's rows fit: the teacher stays in the forward
    none_fits = KernelTuning(indexer_kl=KLTuning(teacher_bytes=one - 1))
    assert not late_teacher_applies(*leaves, settings(bs, topk, none_fits))


@pytest.mark.parametrize("B,cut,chunked", [(1, None, False), (2, 37, True)], ids=["whole", "documents-chunked"])
def test_the_call_keeps_for_its_backward_only_what_dense_attention_keeps_and_the_kl_inputs(B, cut, chunked):
    """What the forward saves for the backward, each storage once: what dense attention keeps
    (q, k, v, o, the fp32 lse per head), the KL's inputs iq and ik and its student lse_z (fp32
    per group), the cleaned block ids (int32), and the documents' starts; q, k, v, iq and ik are
    the caller's tensors, not copies. A second copy of any of them, or another per-entry tensor
    kept from forward to backward, is memory a layer holds through the whole step."""
    from msa_model.ops.indexer_kl.tuning import Tuning as KLTuning
    from msa_model.ops.msa_attention.late_teacher import query_chunk, teacher_bytes

    T, Hq, G, D, Di, bs, topk = 40, 4, 2, 16, 16, 16, 3
    leaves = inputs(B, T, Hq, G, D, Di, seed=13)
    doc = None if cut is None else starts(B, T, 0, cut).to(torch.int32)
    kl_tuning = KLTuning(teacher_bytes=15 * teacher_bytes(leaves[0], G, topk, bs, queries=1)) if chunked else None
    if chunked:  # three calls (of 14, 14 and 12 queries), the documents' cut in the last
        assert query_chunk(leaves[0], G, topk, bs, kl_tuning.teacher_bytes) == 14
    late = settings(bs, topk, KernelTuning(indexer_kl=kl_tuning), kl_teacher="backward")
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = msa_attention(*leaves, late, doc_start=doc)
    assert out.kl_in_backward
    assert {x.untyped_storage().data_ptr() for x in leaves} <= saved.keys()
    size = torch.finfo(DTYPE).bits // 8
    dense = (2 * B * T * Hq * D + 2 * B * T * G * D) * size + B * T * Hq * 4
    kl_inputs = (B * T * G * Di + B * T * Di) * size + B * T * G * 4
    ids = B * T * G * topk * 4 + (0 if doc is None else B * T * 4)
    assert sum(saved.values()) == dense + kl_inputs + ids, (sum(saved.values()), dense, kl_inputs, ids)
    # and the backward still runs on what was kept
    torch.autograd.grad([out.o, out.kl], leaves, [torch.ones_like(out.o), torch.ones_like(out.kl)])
