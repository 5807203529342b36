"""megatron's Apex-free multi-tensor fallbacks replaced by torch's foreach ops
(`msa_model.platform.compat.use_foreach_multi_tensor_ops`): the same norm and scaled copies, on fresh
random tensors of several shapes and dtypes, and the replacement only where the fallback is in use."""

from __future__ import annotations

import torch

from msa_model.platform import compat


def _tensors(seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    shapes = [(7,), (3, 5), (1,), (64, 33), (2, 3, 4)]
    return [(torch.randn(s, generator=g) * (i + 1)).to(dtype) for i, s in enumerate(shapes)]


def test_foreach_norm_is_the_norm_of_all_tensors_as_one_vector():
    ts = _tensors(0)
    got, per_tensor = compat._foreach_l2_norm(2048 * 32, None, [ts], False)
    want = torch.linalg.vector_norm(torch.cat([t.double().flatten() for t in ts]))
    assert per_tensor is None and got.shape == (1,) and got.dtype == torch.float32
    assert abs(got.item() - want.item()) <= 1e-6 * want.item()


def test_foreach_scale_copies_scales_and_scales_in_place():
    src = _tensors(1)
    dst = [torch.empty_like(t, dtype=torch.bfloat16) for t in src]
    compat._foreach_scale(0, None, [src, dst], 1.0)
    assert all(torch.equal(d, s.to(torch.bfloat16)) for s, d in zip(src, dst))
    out = [torch.empty_like(t) for t in src]
    compat._foreach_scale(0, None, [src, out], 0.25)
    assert all(torch.equal(o, s * 0.25) for s, o in zip(src, out))
    grads = _tensors(2)
    want = [g * 0.5 for g in grads]
    compat._foreach_scale(0, None, [grads, grads], 0.5)
    assert all(torch.equal(g, w) for g, w in zip(grads, want))


def test_only_megatrons_fallbacks_are_replaced(monkeypatch):
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    monkeypatch.setattr(clip_grads, "l2_norm_impl", utils.local_multi_tensor_l2_norm)
    monkeypatch.setattr(clip_grads, "multi_tensor_scale_impl", utils.local_multi_tensor_scale)
    other = object()
    monkeypatch.setattr(optimizer, "multi_tensor_scale_impl", other)  # an Apex or TE kernel stays
    assert compat.use_foreach_multi_tensor_ops()
    assert clip_grads.l2_norm_impl is compat._foreach_l2_norm
    assert clip_grads.multi_tensor_scale_impl is compat._foreach_scale
    assert optimizer.multi_tensor_scale_impl is other
    assert not compat.use_foreach_multi_tensor_ops()


def test_empty_lists_do_nothing():
    """A rank whose shard holds no parameter of a group passes empty lists (megatron's loops ran
    zero times)."""
    compat._foreach_scale(0, None, [[], []], 0.5)
    compat._foreach_scale(0, None, [[], []], 1.0)
    norm, _ = compat._foreach_l2_norm(0, torch.zeros(1, dtype=torch.int), [[]], False)
    assert norm.shape == (1,) and norm.item() == 0.0
