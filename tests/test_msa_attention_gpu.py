"""msa_attention's Triton composition on a GPU (select -> sparse attention -> KL, and the dense
warmup through PyTorch's fused attention) against the float64 reference ops, gradients included.
Skipped without CUDA; CPU runs cover the kernels one by one under Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from gpu_sync import assert_no_host_sync
from msa_model.ops import KernelTuning, MSASettings, indexer_kl_loss, msa_attention, select_blocks, sparse_attention
from msa_model.ops.indexer_kl.tuning import Tuning as KLTuning
from msa_model.ops.dense_attention import attach_host_copy, document_plan

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def packed_starts(B: int, T: int, seed: int) -> torch.Tensor:
    """int32 [B, T] document starts of rows packed with documents of 1 to 700 tokens."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(B):
        row = []
        while len(row) < T:
            n = int(torch.randint(1, 700, (1,), generator=gen))
            row += [len(row)] * n
        rows.append(row[:T])
    return torch.tensor(rows, dtype=torch.int32, device="cuda")


@pytest.mark.parametrize("teacher", ["forward", "backward"])
@pytest.mark.parametrize("docs", [False, True], ids=["rows", "documents"])
@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
def test_composition_matches_reference(dense, docs, teacher):
    if dense and teacher == "backward":
        pytest.skip("the warmup's KL has its teacher in the forward")
    B, T, Hq, G, D, Di, bs, topk = 2 if docs else 1, 1500, 16, 2, 128, 64, 64, 8
    gen = torch.Generator(device="cuda").manual_seed(3)
    mk = lambda *s: torch.randn(*s, device="cuda", generator=gen).bfloat16()  # noqa: E731
    q, k, v, iq, ik = mk(B, T, Hq, D), mk(B, T, G, D), mk(B, T, G, D), mk(B, T, G, Di), mk(B, T, Di)
    do = mk(B, T, Hq, D)
    doc_start = packed_starts(B, T, seed=4) if docs else None
    leaves = [x.requires_grad_() for x in (q, k, v, iq, ik)]
    o, kl, block_idx, _ = msa_attention(q, k, v, iq, ik, MSASettings(bs, topk, backend="triton", kl_teacher=teacher),
                                        dense=dense, doc_start=doc_start)
    assert (block_idx is None) == dense
    got = (o, kl, *torch.autograd.grad([o, kl], leaves, [do, torch.ones_like(kl)]))

    # the same selection through the float64 reference ops
    ref_leaves = [x.detach().double().requires_grad_() for x in leaves]
    rq, rk, rv, riq, rik = ref_leaves
    if docs and not dense:
        # the selection itself, against the reference's (sets; bf16 ties may swap a few blocks)
        want_idx = select_blocks(iq.detach(), ik.detach(), bs, topk, backend="reference", doc_start=doc_start)
        same = (block_idx.sort(-1).values == want_idx.sort(-1).values).all(-1).float().mean().item()
        assert same > 0.99, same
    ro, rlse = sparse_attention(rq, rk, rv, block_idx, bs, backend="reference", doc_start=doc_start)
    rkl = indexer_kl_loss(rq.detach(), rk.detach(), riq, rik, block_idx, rlse.detach(), bs, backend="reference",
                          doc_start=doc_start)
    want = (ro, rkl, *torch.autograd.grad([ro, rkl], ref_leaves, [do.double(), torch.ones_like(rkl)]))
    for name, x, r in zip(("o", "kl", "dq", "dk", "dv", "d iq", "d ik"), got, want):
        assert torch.isfinite(x).all(), name
        assert rel(x, r) < 2e-2, (name, rel(x, r))


# packed documents need no synchronisation either: the warmup's dense attention plans from the
# starts' host copy, and the sparse phase sizes the documents' block table from it, as the layers
# get it from the trainer (msa_model.ops.common.attach_host_copy; docs/msa.md); chunks: the late
# teacher's call as query chunks (rows over its teacher_bytes), whose tables come from the copy's rows
@pytest.mark.parametrize("dense,docs,teacher,chunks",
                         [(False, False, "forward", False), (False, False, "backward", False),
                          (True, False, "forward", False), (True, True, "forward", False),
                          (False, True, "forward", False), (False, True, "backward", False),
                          (False, True, "backward", True)],
                         ids=["sparse", "sparse-late-teacher", "dense", "dense-documents", "sparse-documents",
                              "sparse-documents-late-teacher", "sparse-documents-late-teacher-chunks"])
def test_a_training_step_never_waits_on_the_device(dense, docs, teacher, chunks):
    """Forward and backward of the layer issue their work without a host synchronisation (one
    would drain the queue every layer): CUDA's sync debug mode turns any into an error."""
    B, T, Hq, G, D, Di, bs, topk = 1, 1000, 8, 2, 64, 64, 64, 4
    # a query's teacher rows are B*G*topk*bs bf16 values: 300 queries' a chunk, four chunks
    tuning = KernelTuning(indexer_kl=KLTuning(teacher_bytes=300 * B * G * topk * bs * 2)) if chunks else None
    gen = torch.Generator(device="cuda").manual_seed(5)
    mk = lambda *s: torch.randn(*s, device="cuda", generator=gen).bfloat16().requires_grad_()  # noqa: E731
    q, k, v, iq, ik = mk(B, T, Hq, D), mk(B, T, G, D), mk(B, T, G, D), mk(B, T, G, Di), mk(B, T, Di)
    doc_start = None
    if docs:
        doc_start = packed_starts(B, T, seed=6)
        attach_host_copy(doc_start, doc_start.cpu())
    plan = document_plan(doc_start, 0, T, 0) if docs and dense else None

    def step():
        settings = MSASettings(bs, topk, backend="triton", kl_teacher=teacher, tuning=tuning or KernelTuning())
        o, kl, _, _ = msa_attention(q, k, v, iq, ik, settings, dense=dense, doc_start=doc_start, check_ids=False,
                                    document_plan=plan)
        torch.autograd.backward([o, kl], [torch.ones_like(o), torch.ones_like(kl)])

    assert_no_host_sync(step)
