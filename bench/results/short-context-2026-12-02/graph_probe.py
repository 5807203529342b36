"""Probe: what CUDA graphs would take off an MSA layer core call at short context.

Per geometry and length: fwd+bwd of `msa_attention` (teacher from the backward) eager, the same
under torch.cuda.make_graphed_callables, and SDPA (default backend) on the same q, k, v; ms per
call over back-to-back calls, then the graphed results against the eager ones.

    PYTHONPATH=. python bench/results/short-context-2026-12-02/graph_probe.py
"""
import os
import time

import torch
import torch.nn.functional as F

from msa_model.ops.msa_attention import msa_attention

dev, dt = "cuda", torch.bfloat16
CASES = [  # (name, T, Hq, Hkv, D, Di)
    ("small", 8192, 16, 4, 64, 64),
    ("prod-tp2", 8192, 32, 2, 128, 128),
    ("prod", 8192, 64, 4, 128, 128),
    ("small", 32768, 16, 4, 64, 64),
]


def timed(fn, n=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e3


for name, T, Hq, Hkv, D, Di in CASES:
    g = torch.Generator(device=dev).manual_seed(0)

    def r(*s):
        return torch.randn(*s, device=dev, dtype=dt, generator=g).requires_grad_()

    q, k, v = r(1, T, Hq, D), r(1, T, Hkv, D), r(1, T, Hkv, D)
    iq, ik = r(1, T, Hkv, Di), r(1, T, Di)
    do = torch.randn(1, T, Hq, D, device=dev, dtype=dt)
    ins = (q, k, v, iq, ik)

    def core(q, k, v, iq, ik):
        return msa_attention(q, k, v, iq, ik, block_size=128, topk=16, kl_teacher="backward")

    def eager():
        o, kl = core(*ins)
        return torch.autograd.grad((o, kl), ins, (do, torch.ones_like(kl)))

    t_eager = timed(eager)
    torch.cuda.reset_peak_memory_stats()
    m0 = torch.cuda.memory_allocated()
    graphed = torch.cuda.make_graphed_callables(core, tuple(x.detach().clone().requires_grad_() for x in ins))
    m1 = torch.cuda.memory_allocated()

    def run_graphed():
        o, kl = graphed(*ins)
        return torch.autograd.grad((o, kl), ins, (do, torch.ones_like(kl))) + (kl,)

    t_graph = timed(run_graphed)
    qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
    dot = do.transpose(1, 2)

    def sdpa():
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
        return torch.autograd.grad(o, (qt, kt, vt), dot)

    t_sdpa = timed(sdpa)
    ref = eager()
    o_e, kl_e = core(*ins)
    gr = torch.autograd.grad((o_e, kl_e), ins, (do, torch.ones_like(kl_e)))
    out = run_graphed()
    errs = [float((a.float() - b.float()).abs().max()) for a, b in zip(gr, out[:5])]
    print(f"{name} T={T}: eager {t_eager:.2f} ms, graphed {t_graph:.2f} ms ({t_eager / t_graph:.2f}x), "
          f"SDPA {t_sdpa:.2f} ms; graph memory {(m1 - m0) / 2**20:.0f} MiB; kl eager {float(kl_e):.5f} "
          f"graphed {float(out[5]):.5f}; max grad diff {max(errs):.2e}", flush=True)
    del graphed
