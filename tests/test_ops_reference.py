"""The MSA method pinned down on the PyTorch reference ops (CPU).

Every check compares against an independent, deliberately naive formulation written here
(full [T, T] masks, Python loops), never against the code under test.
"""

import math

import pytest
import torch

from msa_model.ops import MSASettings, indexer_kl_loss, msa_attention, select_blocks, sparse_attention

REF = dict(backend="reference")


def rand_inputs(B, T, Hq, Hkv, D, Di, dtype=torch.float32, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(dtype).requires_grad_(requires_grad)  # noqa: E731
    return mk(B, T, Hq, D), mk(B, T, Hkv, D), mk(B, T, Hkv, D), mk(B, T, Hkv, Di), mk(B, T, Di)


def naive_support(block_idx, T, block_size):
    """Bool [B, T, G, T]: key j visible to (t, g); None = dense causal."""
    causal = torch.arange(T)[None, :] <= torch.arange(T)[:, None]
    if block_idx is None:
        return causal[None, :, None, :]
    key_blk = torch.arange(T) // block_size
    chosen = (block_idx.long()[..., None] == key_blk).any(-2)
    return chosen & causal[None, :, None, :]


def naive_attention(q, k, v, support, scale=None):
    """Dense masked softmax attention in float64: o [B,T,Hq,D], lse [B,T,Hq]."""
    B, T, Hq, D = q.shape
    G = Hq // k.shape[2]
    support = support.expand(B, T, k.shape[2], T)
    scale = 1 / math.sqrt(D) if scale is None else scale
    kk, vv = k.double().repeat_interleave(G, 2), v.double().repeat_interleave(G, 2)
    s = torch.einsum("bthd,bjhd->bthj", q.double(), kk) * scale
    s = s.masked_fill(~support.repeat_interleave(G, 2), -math.inf)
    lse = torch.logsumexp(s, -1)
    return torch.einsum("bthj,bjhd->bthd", torch.softmax(s, -1), vv), lse


def naive_teacher_student(q, k, iq, ik, support, scale=None, index_scale=None):
    """Teacher p_bar and student p_I [B, T, G, T] in float64, built from their definitions."""
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    scale = 1 / math.sqrt(D) if scale is None else scale
    index_scale = 1 / math.sqrt(iq.shape[-1]) if index_scale is None else index_scale
    support = support.expand(B, T, Hkv, T)
    s = torch.einsum("bthd,bjhd->bthj", q.double(), k.double().repeat_interleave(G, 2)) * scale
    p = torch.softmax(s.masked_fill(~support.repeat_interleave(G, 2), -math.inf), -1)
    p_bar = p.view(B, T, Hkv, G, T).mean(3)
    z = torch.einsum("btgi,bji->btgj", iq.double(), ik.double()) * index_scale
    p_student = torch.softmax(z.masked_fill(~support, -math.inf), -1)
    return p_bar, p_student


def naive_kl(p_bar, p_student):
    # logs of 1 off the support keep the masked branch's gradient finite
    on = p_bar > 0
    log_ratio = torch.where(on, p_bar, 1).log() - torch.where(on, p_student, 1).log()
    terms = torch.where(on, p_bar * log_ratio, torch.zeros_like(p_bar))
    return terms.sum(-1).mean()


def brute_force_select(iq, ik, block_size, topk, force_sink=False):
    """Python-loop selection: a list (per b, t, g) of the chosen block sets."""
    B, T, G, _ = iq.shape
    s = torch.einsum("btgi,bji->btgj", iq.double(), ik.double())
    out = {}
    for b in range(B):
        for t in range(T):
            local = t // block_size
            for g in range(G):
                scores = []
                for n in range(local + 1):
                    keys = range(n * block_size, min((n + 1) * block_size, t + 1))
                    best = max(s[b, t, g, j].item() for j in keys)
                    # the local block outranks the sink, which outranks every scored block
                    forced = 2 if n == local else int(force_sink and n == 0)
                    scores.append((forced, best, n))
                scores.sort(reverse=True)
                out[b, t, g] = sorted(n for _, _, n in scores[:topk])
    return out


def as_sets(block_idx):
    return {key: sorted(x for x in block_idx[key].tolist() if x >= 0)
            for key in [(b, t, g) for b in range(block_idx.shape[0]) for t in range(block_idx.shape[1])
                        for g in range(block_idx.shape[2])]}


@pytest.mark.parametrize("T,block_size,topk,Hkv,force_sink", [
    (1, 16, 4, 1, False), (63, 16, 2, 2, False), (200, 16, 3, 4, True), (130, 64, 2, 2, False),
    (300, 128, 1, 1, False), (97, 16, 16, 2, True), (96, 16, 1, 2, True), (96, 16, 2, 2, True),
])
def test_selection_matches_brute_force(T, block_size, topk, Hkv, force_sink):
    _, _, _, iq, ik = rand_inputs(2, T, Hkv, Hkv, 8, 8, seed=T)
    block_idx = select_blocks(iq, ik, block_size=block_size, topk=topk, force_sink=force_sink, **REF)
    assert block_idx.dtype == torch.int32 and block_idx.shape == (2, T, Hkv, topk)
    assert as_sets(block_idx) == brute_force_select(iq, ik, block_size, topk, force_sink)


def test_selection_invariants():
    T, bs, topk = 500, 16, 5
    _, _, _, iq, ik = rand_inputs(2, T, 4, 4, 8, 16, seed=3)
    block_idx = select_blocks(iq, ik, block_size=bs, topk=topk, **REF).long()
    local = (torch.arange(T) // bs)[None, :, None]
    assert ((block_idx == local[..., None]).sum(-1) == 1).all(), "local block missing or duplicated"
    assert (block_idx <= local[..., None]).all(), "a block past the causal horizon was selected"
    n_visible = (torch.arange(T) // bs + 1)[None, :, None]
    assert ((block_idx >= 0).sum(-1) == n_visible.clamp(max=topk)).all(), "wrong number of filled slots"
    chosen = block_idx.clamp(min=0)
    dup = (chosen[..., :, None] == chosen[..., None, :]) & (block_idx[..., None] >= 0) & (block_idx[..., None, :] >= 0)
    assert (dup.sum((-1, -2)) == (block_idx >= 0).sum(-1)).all(), "a block was selected twice"


def test_scale_does_not_change_selection():
    _, _, _, iq, ik = rand_inputs(1, 257, 2, 2, 8, 8, seed=5)
    a = select_blocks(iq, ik, block_size=16, topk=4, **REF)
    b = select_blocks(iq * 7.5, ik, block_size=16, topk=4, **REF)
    assert torch.equal(a, b)


@pytest.mark.parametrize("T,block_size", [(1, 16), (63, 16), (200, 64), (129, 128)])
def test_full_topk_equals_dense(T, block_size):
    q, k, v, iq, ik = rand_inputs(2, T, 4, 2, 16, 8, seed=7)
    topk = math.ceil(T / block_size)
    settings = MSASettings(block_size=block_size, topk=topk, **REF)
    o_sparse, kl_sparse, block_idx, _ = msa_attention(q, k, v, iq, ik, settings)
    o_dense, kl_dense, _, _ = msa_attention(q, k, v, iq, ik, settings, dense=True)
    assert (block_idx >= 0).sum(-1).eq((torch.arange(T) // block_size + 1)[None, :, None]).all()
    _, lse_sparse = sparse_attention(q, k, v, block_idx, block_size=block_size, **REF)
    _, lse_dense = sparse_attention(q, k, v, None, block_size=block_size, **REF)
    assert torch.equal(o_sparse, o_dense) and torch.equal(lse_sparse, lse_dense)
    assert torch.equal(kl_sparse, kl_dense)


# (T, Hq, Hkv, block_size, topk, dtype): odd lengths, GQA ratios G in {1, 2, 8, 16}, block sizes
SHAPES = [
    (1, 2, 2, 16, 2, torch.float32),
    (63, 4, 2, 16, 2, torch.float32),
    (200, 8, 1, 16, 3, torch.bfloat16),
    (1000, 16, 2, 64, 4, torch.float32),
    (257, 16, 1, 128, 1, torch.bfloat16),
    (333, 16, 4, 16, 5, torch.float32),
    (129, 64, 4, 16, 3, torch.bfloat16),
]


@pytest.mark.parametrize("T,Hq,Hkv,block_size,topk,dtype", SHAPES)
def test_sparse_attention_matches_naive(T, Hq, Hkv, block_size, topk, dtype):
    q, k, v, iq, ik = rand_inputs(2 if T < 500 else 1, T, Hq, Hkv, 16, 8, dtype=dtype, seed=T + Hq)
    block_idx = select_blocks(iq, ik, block_size=block_size, topk=topk, **REF)
    o, lse = sparse_attention(q, k, v, block_idx, block_size=block_size, **REF)
    o_ref, lse_ref = naive_attention(q, k, v, naive_support(block_idx, T, block_size))
    assert o.dtype == dtype and lse.dtype == torch.float32
    # bf16 only rounds the output; everything inside runs in fp32
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(o.double(), o_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), lse_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("T,Hq,Hkv,block_size,topk", [(63, 4, 2, 16, 2), (150, 8, 1, 32, 2), (97, 16, 2, 16, 3)])
def test_reference_backward_matches_autograd(T, Hq, Hkv, block_size, topk):
    q, k, v, iq, ik = rand_inputs(2, T, Hq, Hkv, 8, 8, dtype=torch.float64, seed=11, requires_grad=True)
    for block_idx in (select_blocks(iq, ik, block_size=block_size, topk=topk, **REF), None):
        support = naive_support(block_idx, T, block_size)
        o, _ = sparse_attention(q, k, v, block_idx, block_size=block_size, **REF)
        o_ref, _ = naive_attention(q, k, v, support)
        do = torch.randn_like(o)
        grads = torch.autograd.grad(o, (q, k, v), do)
        grads_ref = torch.autograd.grad(o_ref, (q, k, v), do)
        for g, g_ref in zip(grads, grads_ref):
            torch.testing.assert_close(g, g_ref, atol=1e-10, rtol=1e-10)
        _, lse = sparse_attention(q, k, v, block_idx, block_size=block_size, **REF)
        kl = indexer_kl_loss(q, k, iq, ik, block_idx, lse, block_size=block_size, **REF)
        kl_ref = naive_kl(*naive_teacher_student(q, k, iq, ik, support))
        torch.testing.assert_close(kl, kl_ref, atol=1e-12, rtol=1e-10)
        grads = torch.autograd.grad(kl, (iq, ik))
        grads_ref = torch.autograd.grad(kl_ref, (iq, ik))
        for g, g_ref in zip(grads, grads_ref):
            torch.testing.assert_close(g, g_ref, atol=1e-12, rtol=1e-9)


def test_causality():
    T, bs = 160, 16
    q, k, v, iq, ik = rand_inputs(1, T, 4, 2, 16, 8, seed=13)
    o, kl, block_idx, _ = msa_attention(q, k, v, iq, ik, MSASettings(block_size=bs, topk=3, **REF))
    t = 71
    q2, k2, v2, iq2, ik2 = (x.clone() for x in (q, k, v, iq, ik))
    for x in (q2, k2, v2, iq2, ik2):
        x[:, t + 1:] = torch.randn_like(x[:, t + 1:]) * 3
    o2, _, block_idx2, _ = msa_attention(q2, k2, v2, iq2, ik2, MSASettings(block_size=bs, topk=3, **REF))
    assert torch.equal(o[:, : t + 1], o2[:, : t + 1])
    assert torch.equal(block_idx[:, : t + 1], block_idx2[:, : t + 1])
    assert not torch.equal(o[:, t + 1:], o2[:, t + 1:])


def test_gradient_isolation():
    q, k, v, iq, ik = rand_inputs(2, 100, 4, 2, 16, 8, seed=17, requires_grad=True)
    for dense in (False, True):
        o, kl, _, _ = msa_attention(q, k, v, iq, ik, MSASettings(block_size=16, topk=3, **REF), dense=dense)
        lm = (o * torch.randn_like(o)).sum()
        g_lm = torch.autograd.grad(lm, (q, k, v, iq, ik), allow_unused=True)
        assert all(g is not None and g.abs().sum() > 0 for g in g_lm[:3])
        assert all(g is None or not g.any() for g in g_lm[3:]), "LM loss reached the index branch"
        g_kl = torch.autograd.grad(kl, (q, k, v, iq, ik), allow_unused=True)
        assert all(g is None or not g.any() for g in g_kl[:3]), "KL reached the main branch"
        assert all(g is not None and g.abs().sum() > 0 for g in g_kl[3:])


def test_kl_nonnegative_and_zero_when_student_is_teacher():
    T, bs = 90, 16
    q, k, v, iq, ik = rand_inputs(2, T, 2, 2, 8, 8, seed=19)
    for block_idx in (select_blocks(iq, ik, block_size=bs, topk=2, **REF), None):
        _, lse = sparse_attention(q, k, v, block_idx, block_size=bs, **REF)
        assert indexer_kl_loss(q, k, iq, ik, block_idx, lse, block_size=bs, **REF) > 0
    # one group, one head, index q/k equal to the main q/k and the same scale: student == teacher
    q1, k1 = q[:, :, :1].double(), k[:, :, :1].double()
    block_idx = select_blocks(q1, k1[:, :, 0], block_size=bs, topk=2, **REF)
    _, lse = sparse_attention(q1, k1, k1, block_idx, block_size=bs, **REF)
    kl = indexer_kl_loss(q1, k1, q1, k1[:, :, 0], block_idx, lse, block_size=bs, index_scale=1 / math.sqrt(8), **REF)
    assert abs(kl.item()) < 1e-12


@pytest.mark.parametrize("dense", [False, True])
def test_kl_gradient_wrt_student_logits(dense):
    """With ik = identity, the student logits are iq itself: d KL / d iq = (p_I - p_bar) * index_scale / count.
    Four blocks, the last one partial, top-2: a sparse support. Then gradcheck in its fast mode
    (finite differences along a random direction of all B*T*Hkv*T inputs at once, instead of one
    input at a time) with float64 tolerances: it fails on a 1% error in one entry of the gradient
    or a 0.1% error of its scale, which the default full check at default tolerances lets pass."""
    B, T, Hq, Hkv, bs = 2, 22, 4, 2, 6
    q, k, v, iq, _ = rand_inputs(B, T, Hq, Hkv, 8, T, dtype=torch.float64, seed=23)
    ik = torch.eye(T, dtype=torch.float64)[None].expand(B, T, T).contiguous()
    iq.requires_grad_(True)
    index_scale = 0.37
    block_idx = None if dense else select_blocks(iq, ik, block_size=bs, topk=2, **REF)
    _, lse = sparse_attention(q, k, v, block_idx, block_size=bs, **REF)
    kl = indexer_kl_loss(q, k, iq, ik, block_idx, lse, block_size=bs, index_scale=index_scale, **REF)
    (grad,) = torch.autograd.grad(kl, iq)
    p_bar, p_student = naive_teacher_student(q, k, iq.detach(), ik, naive_support(block_idx, T, bs),
                                             index_scale=index_scale)
    expected = (p_student - p_bar) * index_scale / (B * T * Hkv)
    torch.testing.assert_close(grad, expected, atol=1e-14, rtol=1e-9)
    assert torch.autograd.gradcheck(
        lambda x: indexer_kl_loss(q, k, x, ik, block_idx, lse, block_size=bs, index_scale=index_scale, **REF),
        (iq,), fast_mode=True, atol=1e-12, rtol=1e-7)


def test_empty_support_gives_zero_output():
    q, k, v, _, _ = rand_inputs(1, 40, 2, 1, 8, 8)
    block_idx = torch.full((1, 40, 1, 2), -1, dtype=torch.int32)
    block_idx[:, 20:, :, 0] = 0
    o, lse = sparse_attention(q, k, v, block_idx, block_size=16, **REF)
    assert torch.isinf(lse[:, :20]).all() and (o[:, :20] == 0).all()
    assert torch.isfinite(lse[:, 20:]).all()


def test_bad_inputs_raise_clear_errors():
    q, k, v, iq, ik = rand_inputs(1, 32, 4, 2, 8, 8)
    with pytest.raises(ValueError, match="divisible"):
        sparse_attention(q[:, :, :3], k, v, None, **REF)
    with pytest.raises(ValueError, match="shape of k"):
        sparse_attention(q, k, v[:, :, :1], None, **REF)
    with pytest.raises(TypeError, match="dtype"):
        sparse_attention(q, k.double(), v, None, **REF)
    with pytest.raises(ValueError, match="block_idx"):
        sparse_attention(q, k, v, torch.zeros(1, 32, 2, 2, dtype=torch.int32) + 5, block_size=16, **REF)
    with pytest.raises(ValueError, match="block_idx must be"):
        sparse_attention(q, k, v, torch.zeros(1, 32, 3, 2, dtype=torch.int32), block_size=16, **REF)
    with pytest.raises(TypeError, match="int32 or int64"):
        sparse_attention(q, k, v, torch.zeros(1, 32, 2, 2), block_size=16, **REF)
    with pytest.raises(ValueError, match="ik"):
        select_blocks(iq, ik[:, :, :4], **REF)
    with pytest.raises(ValueError, match="index heads"):
        msa_attention(q, k, v, iq[:, :, :1], ik, MSASettings(block_size=16, topk=2, **REF))
    with pytest.raises(ValueError, match="lse"):
        indexer_kl_loss(q, k, iq, ik, None, torch.zeros(1, 32, 2), block_size=16, **REF)
    with pytest.raises(ValueError, match="backend"):
        select_blocks(iq, ik, backend="cuda")
    with pytest.raises(ValueError, match="block_size"):
        select_blocks(iq, ik, block_size=0)
