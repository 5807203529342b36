"""Dense attention on packed documents (msa_model/ops/dense_attention): every path of the dispatch
gives what running each document alone gives (output, log-sum-exp, every gradient), the plan
covers every row once and chooses as the dispatch rule says, and the warmup's KL, whose teacher
is built from that log-sum-exp, is the reference's. On CPU the reference stands in for torch's
fused causal kernels and the Triton kernels run in the interpreter, so shapes are small."""

from __future__ import annotations

import math

import pytest
import torch

from msa_model.ops import MSASettings, indexer_kl_loss, msa_attention
from msa_model.ops.dense_attention import (attach_host_copy, build_plan, document_attention, document_plan,
                                           fused_causal_takes)
from msa_model.ops import dense_attention as dense_attention_module
from msa_model.ops.dense_attention import plan as plan_module
from msa_model.ops.dense_attention.plan import (Bucket, CudnnShapes, bucket_count, bucket_length, bucket_uses_cudnn,
                                                segments_of)
from msa_model.ops.sparse_attention.reference import sparse_attention_reference

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
# fp32 in the interpreter and the reference; torch's fused kernels and the compiled Triton ones
# take bf16 (against a float64 truth, within bf16's error)
DTYPE = torch.bfloat16 if CUDA else torch.float32
TOL = 2e-2 if CUDA else 1e-5


def starts(C: int, *rows_cuts) -> torch.Tensor:
    """int32 [B, C] document starts of rows cut at the given positions (each row starts a
    document at 0)."""
    out = torch.zeros(len(rows_cuts), C, dtype=torch.int32)
    for b, cuts in enumerate(rows_cuts):
        for s in cuts:
            out[b, s:] = s
    return out


def inputs(B, C, Hq, G, D, seed, dtype=DTYPE):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=gen).to(DEV, dtype).requires_grad_() for s in
            ((B, C, Hq, D), (B, C, G, D), (B, C, G, D))]


def one_by_one(q, k, v, doc):
    """Each document run alone from its first token (the reference's dense causal attention, in
    float64): o [B, C, Hq, D] and lse [B, C, Hq], assembled row by row."""
    q, k, v = q.double(), k.double(), v.double()
    B, C = doc.shape
    rows_o, rows_l = [], []
    for b in range(B):
        outs, lses = [], []
        for _, s, n in segments_of(doc[b:b + 1].cpu().numpy()):
            o, lse = sparse_attention_reference(q[b:b + 1, s:s + n], k[b:b + 1, s:s + n], v[b:b + 1, s:s + n], None, 16,
                                                1 / math.sqrt(q.shape[-1]))
            outs.append(o)
            lses.append(lse)
        rows_o.append(torch.cat(outs, 1))
        rows_l.append(torch.cat(lses, 1))
    return torch.cat(rows_o), torch.cat(rows_l)


def grads(o, leaves, seed):
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(seed)).to(o.device, DTYPE)
    return torch.autograd.grad(o, leaves, do.to(o.dtype))


def close(x, y, tol):
    return (x.double() - y.double()).abs().max().item() <= tol * max(1.0, y.double().abs().max().item())


# (C, Hq, G, D, row cuts): one document a row, a few, many short ones (length-1 documents
# included), two rows of different mixes; GQA ratios 1, 2 and 4; odd lengths. Head dims 64 and
# 128 on a GPU, where the fused kernels run
SMALL_D, LARGE_D = (64, 128) if CUDA else (16, 32)
MIXES = {
    "one-each": (63, 4, 2, SMALL_D, ((), ())),
    "few": (100, 4, 1, SMALL_D, ((37, 38, 90), (51,))),
    "many": (90, 8, 2, SMALL_D, (tuple(range(3, 90, 7)), (1, 2, 3, 45, 89))),
    "mha": (70, 2, 2, LARGE_D, ((20,), ())),
}


@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("path", ["causal", "segments", "kernel"])
def test_every_path_is_each_document_alone(path, mix):
    C, Hq, G, D, cuts = MIXES[mix]
    doc = starts(C, *cuts).to(DEV)
    if path == "causal" and doc.any():
        with pytest.raises(ValueError, match="does not take these inputs"):
            document_attention(*inputs(len(cuts), C, Hq, G, D, seed=1), doc, path=path)
        return
    leaves = inputs(len(cuts), C, Hq, G, D, seed=C + Hq)
    # on a GPU "auto" runs the fused kernels; on CPU the reference stands in for them
    backend = "triton" if path == "kernel" else ("auto" if CUDA else "reference")
    o, lse = document_attention(*leaves, doc, path=path, backend=backend)
    want_o, want_lse = one_by_one(*leaves, doc)
    assert o.dtype == leaves[0].dtype and lse.dtype == torch.float32
    assert close(o, want_o, TOL) and close(lse, want_lse, TOL), path
    for name, g, w in zip(("dq", "dk", "dv"), grads(o, leaves, 3), grads(want_o, leaves, 3)):
        assert close(g, w, TOL), (path, name)


@pytest.mark.skipif(not CUDA, reason="torch's fused kernels run on CUDA only")
@pytest.mark.parametrize("build_ms", [0.0, math.inf], ids=["cudnn", "flash"])
def test_segments_on_either_fused_kernel_is_each_document_alone(build_ms, monkeypatch):
    """The segments path runs a shape on flash attention until it has earned a cuDNN build: both
    kernels give each document alone (cuDNN at once with a free build, flash with a priceless one)."""
    monkeypatch.setattr(plan_module, "CUDNN_SHAPES", CudnnShapes(build_ms=build_ms))
    C, Hq, G, D, cuts = MIXES["few"]
    doc = starts(C, *cuts).to(DEV)
    leaves = inputs(len(cuts), C, Hq, G, D, seed=5)
    o, lse = document_attention(*leaves, doc, path="segments")
    want_o, want_lse = one_by_one(*leaves, doc)
    assert close(o, want_o, TOL) and close(lse, want_lse, TOL)
    for name, g, w in zip(("dq", "dk", "dv"), grads(o, leaves, 3), grads(want_o, leaves, 3)):
        assert close(g, w, TOL), name


def test_a_shape_runs_on_flash_until_its_extra_time_pays_a_cudnn_build():
    """Rent, then buy: each flash call of a shape charges its estimated extra time; once the charges
    reach one build, the shape's next micro-batch runs cuDNN. The choice holds for every layer's
    call within a micro-batch (and a recomputed forward); shapes keep separate accounts."""
    shapes = CudnnShapes(build_ms=90.0, extra_ms_per_tflop=1.5)
    layers = 8

    def micro_batch(count, length, backward=True):
        bucket = Bucket(length, count, 0, count)  # a fresh plan's bucket
        return [bucket_uses_cudnn(bucket, 64, 4, 128, torch.bfloat16, backward, shapes) for _ in range(layers)]

    # a 3.4K-row segment at the production geometry: 0.68 TFLOP fwd+bwd, 1.03 ms of flash's extra
    # time a call, 8.2 ms a micro-batch of 8 layers: its 11th micro-batch has paid for the build
    per_batch = layers * 4 * (3456 * 3457 / 2) * 128 * 64 * 3.5 / 1e12 * 1.5
    wanted = math.ceil(90.0 / per_batch)
    runs = [micro_batch(1, 3456) for _ in range(wanted + 2)]
    assert all(set(r) == {False} for r in runs[:wanted]) and all(set(r) == {True} for r in runs[wanted:])
    # a 12K-row segment earns its build within its first micro-batch (13 ms of extra time a call)
    assert micro_batch(1, 12288) == [False] * layers and micro_batch(1, 12288) == [True] * layers
    # another count is another shape, another account
    assert micro_batch(2, 3456) == [False] * layers
    # a forward without backward (evaluation, or the first forward under activation recompute)
    # charges the shape's account for the forward alone
    fresh = CudnnShapes(build_ms=90.0, extra_ms_per_tflop=1.5)
    bucket_uses_cudnn(Bucket(3456, 1, 0, 1), 64, 4, 128, torch.bfloat16, False, fresh)
    assert list(fresh.spent.values()) == pytest.approx([per_batch / layers / 3.5])
    # a bucket decides once: a call after the account is full keeps the micro-batch's choice
    bucket = Bucket(4096, 1, 0, 1)
    assert not bucket_uses_cudnn(bucket, 64, 4, 128, torch.bfloat16, True, CudnnShapes(build_ms=1e-9))
    assert not bucket_uses_cudnn(bucket, 64, 4, 128, torch.bfloat16, True, CudnnShapes(build_ms=0.0))


def test_the_segments_path_runs_each_bucket_on_the_kernel_its_shape_earned(monkeypatch):
    """What `_segments` hands the fused kernel wrapper per bucket: flash (cudnn=False) until the
    shape's account holds a build, cuDNN after, the same for every call of a micro-batch's plan."""
    seen = []
    real = dense_attention_module._causal

    def spy(q, k, v, scale, cudnn=True):
        seen.append((q.shape[1], cudnn))
        return real(q, k, v, scale, cudnn)

    monkeypatch.setattr(dense_attention_module, "_causal", spy)
    monkeypatch.setattr(plan_module, "CUDNN_SHAPES", CudnnShapes(build_ms=1e-12))
    C, Hq, G, D, cuts = MIXES["few"]
    doc = starts(C, *cuts)
    leaves = [x.detach().cpu().float().requires_grad_() for x in inputs(len(cuts), C, Hq, G, D, seed=2)]
    plan = build_plan(doc, 0, "cpu", segments=True)
    lengths = [b.length for b in plan.buckets]
    for _ in range(2):  # two layers of one micro-batch: flash, as the plan's first call chose
        document_attention(*leaves, doc, plan=plan)
    document_attention(*leaves, doc, plan=build_plan(doc, 0, "cpu", segments=True))  # the next micro-batch
    assert seen == [(n, False) for n in lengths] * 2 + [(n, True) for n in lengths]


def test_the_plan_covers_every_row_once_and_buckets_by_length():
    doc = starts(300, (5, 6, 100, 250), (1,), ())
    plan = build_plan(doc, 0, "cpu", segments=True)
    assert plan.path == "segments"
    B, C = doc.shape
    assert sorted(plan.src.tolist()) == list(range(B * C))
    assert len(set(plan.dst.tolist())) == B * C and max(plan.dst.tolist()) < plan.packed
    assert sorted(plan.lengths) == sorted([5, 1, 94, 150, 50, 1, 299, 300])
    # one bucket per padded length, longest first, each holding its documents; short buckets
    # compute a power of two of segments (empty ones padded)
    assert [(b.length, b.n, b.count) for b in plan.buckets] == [(512, 2, 2), (256, 1, 1), (128, 5, 8)]
    assert plan.packed == sum(b.count * b.length for b in plan.buckets)
    assert plan.key_area() == sum(n * (n + 1) // 2 for n in plan.lengths) < B * C * (C + 1) // 2
    assert plan.padded_area() >= plan.key_area()
    # the shapes come from a small set: powers of two up to 1024, eight lengths an octave above
    assert [bucket_length(n) for n in (1, 128, 129, 1024, 1025, 4095, 4097, 5000)] == [128, 128, 256, 1024, 1152,
                                                                                        4096, 4608, 5120]
    assert len({bucket_length(n) for n in range(1025, 32769)}) == 5 * 8
    assert [bucket_count(n, 512) for n in (1, 3, 5)] == [1, 4, 8] and bucket_count(3, 2048) == 3


@pytest.mark.parametrize("C, cuts, q_offset, fused, want", [
    (64, ((), ()), 0, True, "causal"),
    (64, ((40,), ()), 0, True, "kernel"),  # 3 documents of 43 rows on average: short ones
    (8192, ((4096,), ()), 0, True, "segments"),  # of 5461 rows
    (8192, ((1000, 2000, 3000), ()), 0, True, "segments"),  # 5 documents of 3277 rows
    (8192, (range(900, 8192, 900), range(900, 8192, 900)), 0, True, "kernel"),  # 20 of 819 rows
    (64, ((), ()), 16, True, "kernel"),  # a later query chunk (context parallelism)
    (8192, ((4096,), ()), 0, False, "kernel"),  # no fused causal kernel for these inputs
])
def test_the_dispatch_rule(C, cuts, q_offset, fused, want):
    assert build_plan(starts(C, *cuts) + 0, q_offset, "cpu", fused).path == want


def test_fused_kernels_only_where_torch_has_them():
    assert not fused_causal_takes(torch.zeros(1, 8, 2, 64))  # CPU
    if CUDA:
        x = torch.zeros(1, 8, 2, 64, device="cuda", dtype=torch.bfloat16)
        assert fused_causal_takes(x) and not fused_causal_takes(x, "reference")
        assert not fused_causal_takes(x.float()) and not fused_causal_takes(x[..., :48])


def test_a_micro_batch_plans_once_from_its_host_copy():
    """Every layer gets the same doc_start tensor: its plan per query chunk is built once, from
    the host copy the trainer attaches (here one that differs from the tensor, to show which is
    read), without reading the device."""
    dev_starts = starts(64, (30,)).to(DEV)
    attach_host_copy(dev_starts, starts(64, ()))
    first = document_plan(dev_starts, 0, 64, 0)
    assert first.path == "causal"
    assert document_plan(dev_starts, 0, 64, 0) is first
    assert document_plan(dev_starts, 0, 32, 0) is not first


@pytest.mark.parametrize("path", ["segments", "kernel"])
def test_the_warmup_kl_takes_its_teacher_from_this_lse(path):
    """msa_attention's dense warmup on packed documents: attention by the plan's path, the KL's
    dense teacher rebuilt from that path's lse; against the reference ops (value and gradients)."""
    B, C, Hq, G, D, Di = 2, 80, 4, 2, SMALL_D, 16
    doc = starts(C, (9, 10, 60), (33,)).to(DEV)
    q, k, v = inputs(B, C, Hq, G, D, seed=4)
    gen = torch.Generator().manual_seed(6)
    iq = torch.randn(B, C, G, Di, generator=gen).to(DEV, DTYPE).requires_grad_()
    ik = torch.randn(B, C, Di, generator=gen).to(DEV, DTYPE).requires_grad_()
    plan = build_plan(doc.cpu(), 0, DEV, fused=path == "segments", segments=path == "segments")
    assert plan.path == path
    leaves = [q, k, v, iq, ik]
    backend = "triton" if path == "kernel" or CUDA else "reference"
    o, kl, _, _ = msa_attention(q, k, v, iq, ik, MSASettings(16, 2, backend=backend), dense=True, doc_start=doc,
                                document_plan=plan)
    got = torch.autograd.grad([o, kl], leaves, [torch.ones_like(o), torch.full_like(kl, 0.7)])
    ref = [x.detach().double().requires_grad_() for x in leaves]
    rq, rk, rv, riq, rik = ref
    ro, rlse = sparse_attention_reference(rq, rk, rv, None, 16, 1 / math.sqrt(D), doc_start=doc)
    rkl = indexer_kl_loss(rq.detach(), rk.detach(), riq, rik, None, rlse.detach(), 16, backend="reference",
                          doc_start=doc)
    want = torch.autograd.grad([ro, rkl], ref, [torch.ones_like(ro), torch.full_like(rkl, 0.7)])
    assert abs(float(kl) - float(rkl)) <= TOL * abs(float(rkl))
    for name, g, w in zip(("dq", "dk", "dv", "d iq", "d ik"), got, want):
        assert close(g, w, TOL), name
