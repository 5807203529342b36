"""The layer kernels that are not MSA's own: fused RoPE and the fused GLU activation with routing
probabilities, against their references (outputs and gradients), on CPU in Triton's interpreter
(fp32) and on a GPU in bf16, where the error must stay within twice PyTorch's own in bf16."""

import pytest
import torch
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

from msa_model.ops.glu import glu, glu_reference
from msa_model.ops.rope import rope, rope_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def angles(S, B, R, seed=0, distinct=False):
    """megatron's RotaryEmbedding layout: [S, B or 1, 1, R], both halves the same angles (or, with
    distinct, random angles in each channel, so that a kernel mixing up the halves fails)."""
    g = torch.Generator().manual_seed(seed)
    if distinct:
        return torch.rand(S, B, 1, R, generator=g) * 20 - 10
    inv = 1.0 / (10000 ** (torch.arange(0, R, 2).float() / R))
    pos = torch.arange(S).float() + torch.randint(0, 1000, (B, 1), generator=g).float()  # [B, S]
    f = pos[..., None] * inv  # [B, S, R/2]
    return torch.cat((f, f), -1).permute(1, 0, 2)[:, :, None, :].contiguous()


@pytest.mark.parametrize("S,B,H,D,R,fb,distinct", [(37, 2, 3, 16, 16, 1, False), (5, 1, 8, 64, 64, 1, False),
                                                   (9, 3, 5, 32, 16, 3, True), (130, 1, 2, 128, 128, 1, False),
                                                   (11, 2, 3, 40, 24, 1, True)])
def test_rope_matches_reference_and_megatron(S, B, H, D, R, fb, distinct):
    g = torch.Generator().manual_seed(S * H)
    t = torch.randn(S, B, H, D, generator=g)
    freqs = angles(S, fb, R, distinct=distinct)
    dy = torch.randn(S, B, H, D, generator=g)
    # the reference is megatron's unfused RoPE in fp32
    mega = _apply_rotary_pos_emb_bshd(t, freqs)
    assert torch.allclose(rope_reference(t, freqs), mega, atol=1e-6, rtol=1e-6)

    exact = t.double().requires_grad_()
    y_exact = rope_reference(exact, freqs.double())
    y_exact.backward(dy.double())
    tt = t.to(DEVICE, DTYPE).requires_grad_()
    y = rope(tt, freqs.to(DEVICE), backend="triton")
    y.backward(dy.to(DEVICE, DTYPE))
    assert y.dtype == DTYPE and y.is_contiguous() and not y.isnan().any()
    ours = (rel(y.cpu(), y_exact), rel(tt.grad.cpu(), exact.grad))
    if DTYPE == torch.float32:
        assert max(ours) < 1e-5, ours
    else:
        # PyTorch in bf16 (megatron's path) against the same exact result
        tb = t.to(DEVICE, DTYPE).requires_grad_()
        yb = _apply_rotary_pos_emb_bshd(tb, freqs.to(DEVICE))
        yb.backward(dy.to(DEVICE, DTYPE))
        torch_err = (rel(yb.cpu(), y_exact), rel(tb.grad.cpu(), exact.grad))
        assert ours[0] <= 2 * torch_err[0] + 1e-4 and ours[1] <= 2 * torch_err[1] + 1e-4, (ours, torch_err)


@pytest.mark.parametrize("R", [32, 16])
def test_rope_takes_strided_inputs_and_refuses_bad_angles(R):
    t = torch.randn(6, 2, 4, 3 * 16)[..., :32]  # a view: strided heads and rows
    freqs = angles(6, 1, R, distinct=True)
    y = rope(t.to(DEVICE, DTYPE), freqs.to(DEVICE), backend="triton")
    assert y.is_contiguous()
    assert rel(y.cpu(), rope_reference(t, freqs)) < (1e-5 if DTYPE == torch.float32 else 1e-2)
    # channels past R pass through unchanged
    assert torch.equal(y[..., R:].cpu(), t[..., R:].to(DTYPE))
    with pytest.raises(ValueError, match="do not fit"):
        rope(t, angles(6, 1, 34)[..., :33])
    with pytest.raises(ValueError, match="do not fit"):
        rope(t, angles(5, 1, 32))


@pytest.mark.parametrize("N,F,alpha,offset,probs", [(37, 48, 1.0, 0.0, True), (5, 520, 1.702, 1.0, True),
                                                    (64, 16, 1.0, 0.0, False), (1, 1030, 1.0, 0.5, True)])
def test_glu_matches_reference(N, F, alpha, offset, probs):
    g = torch.Generator().manual_seed(N + F)
    h = torch.randn(N, 2 * F, generator=g) * 2
    p = torch.rand(N, generator=g) if probs else None
    da = torch.randn(N, F, generator=g)

    hx = h.double().requires_grad_()
    px = p.double().requires_grad_() if probs else None
    ax = glu_reference(hx, px, alpha, offset)
    ax.backward(da.double())

    hh = h.to(DEVICE, DTYPE).requires_grad_()
    pp = p.to(DEVICE).requires_grad_() if probs else None
    a = glu(hh, pp, alpha, offset, backend="triton")
    a.backward(da.to(DEVICE, DTYPE))
    assert a.dtype == DTYPE and not a.isnan().any()
    ours = [rel(a.cpu(), ax), rel(hh.grad.cpu(), hx.grad)] + ([rel(pp.grad.cpu(), px.grad)] if probs else [])
    if DTYPE == torch.float32:
        assert max(ours) < 1e-5, ours
        return
    # torch in bf16, as the experts computed it before: act and product in bf16, probs in fp32
    hb = h.to(DEVICE, DTYPE).requires_grad_()
    pb = p.to(DEVICE).requires_grad_() if probs else None
    gate, up = hb.chunk(2, -1)
    ab = gate * torch.sigmoid(alpha * gate) * (up + offset)
    ab = (ab * pb[:, None] if probs else ab).to(DTYPE)
    ab.backward(da.to(DEVICE, DTYPE))
    theirs = [rel(ab.cpu(), ax), rel(hb.grad.cpu(), hx.grad)] + ([rel(pb.grad.cpu(), px.grad)] if probs else [])
    for o, t in zip(ours, theirs):
        assert o <= 2 * t + 1e-4, (ours, theirs)


def test_glu_backward_returns_the_activation():
    from msa_model.ops.glu import glu_backward_triton
    g = torch.Generator().manual_seed(3)
    h = torch.randn(9, 2 * 40, generator=g).to(DEVICE, DTYPE)
    p = torch.rand(9, generator=g).to(DEVICE)
    _, a, _ = glu_backward_triton(h, p, torch.randn(9, 40, generator=g).to(DEVICE, DTYPE), 1.0, 0.0)
    assert torch.equal(a, glu(h, p, backend="triton"))
