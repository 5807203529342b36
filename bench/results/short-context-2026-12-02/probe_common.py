"""What both probes of this folder share: wall-clock ms per call over back-to-back calls, the
layer core's random inputs (seed 0) and SDPA's fwd+bwd on the same q, k, v."""
import time

import torch
import torch.nn.functional as F

dev, dt = "cuda", torch.bfloat16


def timed(fn, n):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e3


def inputs(T, Hq, Hkv, D, Di):
    """(q, k, v, iq, ik) requiring grad, and do: bf16, B = 1."""
    g = torch.Generator(device=dev).manual_seed(0)

    def r(*s):
        return torch.randn(*s, device=dev, dtype=dt, generator=g).requires_grad_()

    q, k, v = r(1, T, Hq, D), r(1, T, Hkv, D), r(1, T, Hkv, D)
    iq, ik = r(1, T, Hkv, Di), r(1, T, Di)
    return (q, k, v, iq, ik), torch.randn(1, T, Hq, D, device=dev, dtype=dt)


def sdpa_step(q, k, v, do):
    """fwd+bwd of SDPA (default backend) on copies of q, k, v: a callable."""
    qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))

    def step():
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
        return torch.autograd.grad(o, (qt, kt, vt), do.transpose(1, 2))

    return step
