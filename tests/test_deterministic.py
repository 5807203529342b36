"""trainer.deterministic=true: the indexer KL's sparse backward sums in a fixed order under
torch.use_deterministic_algorithms(True) (its programs store per entry and per work item instead
of adding by atomics), with the reference's values; the mode's settings; and two runs (one of
them stopped and resumed) that give the same losses and weights bit for bit. On CPU the kernels
run in Triton's interpreter, so shapes are small."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from msa_model.ops import KernelTuning, MSASettings, indexer_kl_loss, msa_attention, select_blocks, sparse_attention
from msa_model.ops.indexer_kl import triton as kl_triton
from skeleton_helpers import metrics, run_train

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


@contextlib.contextmanager
def deterministic():
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


class Spy:
    """Stands in for a Triton kernel and counts its launches."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def case(B, T, Hq, G, D, Di, bs, topk, seed, doc_cut=None):
    gen = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=gen).to(DEV)  # noqa: E731
    q, k, v, iq, ik = mk(B, T, Hq, D), mk(B, T, G, D), mk(B, T, G, D), mk(B, T, G, Di) * 2, mk(B, T, Di)
    doc = None
    if doc_cut is not None:
        doc = torch.where(torch.arange(T) < doc_cut, 0, doc_cut).to(torch.int32).expand(B, T).contiguous().to(DEV)
    idx = select_blocks(iq, ik, block_size=bs, topk=topk, backend="reference", doc_start=doc)
    _, lse = sparse_attention(q, k, v, idx, block_size=bs, backend="reference", doc_start=doc)
    return q, k, v, iq, ik, idx, lse, doc


def kl_grads(q, k, iq, ik, idx, lse, bs, backend, doc, tuning=None):
    iq, ik = iq.detach().clone().requires_grad_(), ik.detach().clone().requires_grad_()
    loss = indexer_kl_loss(q, k, iq, ik, idx, lse, block_size=bs, backend=backend, doc_start=doc, tuning=tuning)
    loss.backward()
    return loss.detach(), iq.grad, ik.grad


@pytest.mark.parametrize("teacher", ["stored", "recompute"])
@pytest.mark.parametrize("doc_cut", [None, 37], ids=["one-document", "documents"])
def test_deterministic_kl_backward_matches_the_reference(teacher, doc_cut, monkeypatch):
    """Popular blocks split over several work items (small `bwd_per_program`), so a bucket's
    partials are several and their ordered sum is exercised."""
    tuning = dataclasses.replace(kl_triton.DEFAULT_TUNING, bwd_per_program=16, stored_M=16,
                                 teacher_bytes=0 if teacher == "recompute" else 4 << 30)
    q, k, _, iq, ik, idx, lse, doc = case(1, 70, 4, 2, 16, 16, 16, 3, seed=5, doc_cut=doc_cut)
    want = kl_grads(q, k, iq, ik, idx, lse, 16, "reference", doc)
    spy = Spy(kl_triton.kl_dik_reduce_kernel)
    monkeypatch.setattr(kl_triton, "kl_dik_reduce_kernel", spy)
    with deterministic():
        got = kl_grads(q, k, iq, ik, idx, lse, 16, "triton", doc, tuning)
        again = kl_grads(q, k, iq, ik, idx, lse, 16, "triton", doc, tuning)
    assert spy.launches == 2
    assert abs(float(got[0]) - float(want[0])) <= 1e-5 * max(1.0, abs(float(want[0])))
    for name, x, w in zip(("d iq", "d ik"), got[1:], want[1:]):
        assert rel(x, w) < 2e-5, name
    for x, y in zip(got, again):
        assert torch.equal(x, y)
    # outside the mode the atomics path runs: no ordered reduction
    kl_grads(q, k, iq, ik, idx, lse, 16, "triton", doc, tuning)
    assert spy.launches == 2


def test_deterministic_late_teacher_matches_the_reference(monkeypatch):
    """The KL's teacher from the attention's backward (ops/msa_attention/late_teacher.py) sums its loss (bz)
    and gradients in the same fixed order; against the float64 reference ops on its selection."""
    B, T, Hq, G, D, Di, bs, topk = 1, 70, 4, 2, 16, 16, 16, 3
    gen = torch.Generator().manual_seed(8)
    # fp32 in the interpreter (exact products); the compiled sparse attention takes bf16
    dtype = torch.bfloat16 if CUDA else torch.float32
    leaves = [torch.randn(*s, generator=gen).to(DEV, dtype).requires_grad_()
              for s in ((B, T, Hq, D), (B, T, G, D), (B, T, G, D), (B, T, G, Di), (B, T, Di))]
    do = torch.randn(B, T, Hq, D, generator=gen).to(DEV, dtype)
    spy = Spy(kl_triton.kl_dik_reduce_kernel)
    monkeypatch.setattr(kl_triton, "kl_dik_reduce_kernel", spy)
    tuning = KernelTuning(indexer_kl=dataclasses.replace(kl_triton.DEFAULT_TUNING, bwd_per_program=16))
    settings = MSASettings(bs, topk, backend="triton", kl_teacher="backward", tuning=tuning)
    runs = []
    with deterministic():
        for _ in range(2):
            o, kl, idx, _ = msa_attention(*leaves, settings)
            runs.append((kl.detach(), idx, torch.autograd.grad([o, kl], leaves, [do, torch.full_like(kl, 0.7)])))
    assert spy.launches == 2
    (kl, idx, grads), (kl2, _, grads2) = runs
    assert torch.equal(kl, kl2) and all(torch.equal(x, y) for x, y in zip(grads, grads2))
    ref = [x.detach().double().requires_grad_() for x in leaves]
    rq, rk, rv, riq, rik = ref
    ro, rlse = sparse_attention(rq, rk, rv, idx, bs, backend="reference")
    rkl = indexer_kl_loss(rq.detach(), rk.detach(), riq, rik, idx, rlse.detach(), bs, backend="reference")
    want = torch.autograd.grad([ro, rkl], ref, [do.double(), torch.full_like(rkl, 0.7)])
    tol = 2e-2 if CUDA else 1e-5
    assert abs(float(kl) - float(rkl)) <= tol * abs(float(rkl))
    for name, x, w in zip(("dq", "dk", "dv", "d iq", "d ik"), grads, want):
        assert rel(x, w) < tol, name


def test_the_mode_sets_torch_and_the_libraries():
    from msa_model.training.determinism import deterministic_mode

    env = {}
    before = torch.are_deterministic_algorithms_enabled()
    try:
        lines = deterministic_mode(env)
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()
        assert not torch.backends.cudnn.benchmark and torch.backends.cudnn.deterministic
        assert env["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and env["NCCL_ALGO"] == "Ring"
        assert any("CUBLAS_WORKSPACE_CONFIG" in line for line in lines)
        # a user's own choice of NCCL algorithm among the deterministic ones stays
        env = {"NCCL_ALGO": "Tree"}
        deterministic_mode(env)
        assert env["NCCL_ALGO"] == "Tree"
    finally:
        torch.use_deterministic_algorithms(before)


COMMON = ("trainer.max_steps=4", "trainer.indexer_warmup_tokens=2048", "checkpoint.interval=0",
          "trainer.deterministic=true")
COMPARED = ("lm_loss", "kl_loss", "moe_aux_loss", "grad_norm", "lr", "keys_per_query", "phase", "tokens")


def _tensors(step_dir, tmp):
    """Every tensor of a checkpoint: the weights and the optimizer's state."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(step_dir), str(tmp))
    return {k: v for k, v in torch.load(tmp, weights_only=False).items() if torch.is_tensor(v)}


def test_two_deterministic_runs_one_resumed_are_identical(tmp_path, data_cache):
    """Warmup for steps 1-2, top-k for 3-4; the second run stops after step 2 (at the switch) and
    is resumed: every logged number, every weight and every optimizer moment of the last
    checkpoint agree bit for bit."""
    a, b = tmp_path / "a", tmp_path / "b"
    proc = run_train(a, *COMMON, data_cache=data_cache)
    assert "deterministic mode:" in proc.stdout + proc.stderr
    run_train(b, *COMMON, "trainer.stop_at_step=2", data_cache=data_cache)
    run_train(b, *COMMON, data_cache=data_cache)
    ma, mb = metrics(a), metrics(b)
    assert sorted(ma) == sorted(mb) == [1, 2, 3, 4]
    assert [ma[s]["phase"] for s in ma] == ["warmup"] * 2 + ["sparse"] * 2
    for step in ma:
        assert {k: ma[step][k] for k in COMPARED} == {k: mb[step][k] for k in COMPARED}, step
    wa = _tensors(a / "checkpoints" / "step_00000004", tmp_path / "a.pt")
    wb = _tensors(b / "checkpoints" / "step_00000004", tmp_path / "b.pt")
    assert "output_layer.weight" in wa and "optimizer.state.exp_avg.output_layer.weight" in wa
    assert set(wa) == set(wb)
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name
