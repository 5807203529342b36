"""Probe: what CUDA graphs would take off an MSA layer core call at short context.

Per geometry and length: fwd+bwd of `msa_attention` (teacher from the backward) eager, the same
under torch.cuda.make_graphed_callables, and SDPA (default backend) on the same q, k, v; ms per
call over back-to-back calls, then the graphed results against the eager ones.

    PYTHONPATH=. python bench/results/short-context-2026-12-02/graph_probe.py
"""
import torch

from msa_model.ops.msa_attention import MSASettings, msa_attention
from probe_common import inputs, sdpa_step, timed

N = 20  # timed calls
CASES = [  # (name, T, Hq, Hkv, D, Di)
    ("small", 8192, 16, 4, 64, 64),
    ("prod-tp2", 8192, 32, 2, 128, 128),
    ("prod", 8192, 64, 4, 128, 128),
    ("small", 32768, 16, 4, 64, 64),
]


for name, T, Hq, Hkv, D, Di in CASES:
    ins, do = inputs(T, Hq, Hkv, D, Di)

    def core(q, k, v, iq, ik):
        out = msa_attention(q, k, v, iq, ik, MSASettings(block_size=128, topk=16, kl_teacher="backward"))
        return out.o, out.kl

    def eager():
        o, kl = core(*ins)
        return torch.autograd.grad((o, kl), ins, (do, torch.ones_like(kl)))

    t_eager = timed(eager, N)
    torch.cuda.reset_peak_memory_stats()
    m0 = torch.cuda.memory_allocated()
    graphed = torch.cuda.make_graphed_callables(core, tuple(x.detach().clone().requires_grad_() for x in ins))
    m1 = torch.cuda.memory_allocated()

    def run_graphed():
        o, kl = graphed(*ins)
        return torch.autograd.grad((o, kl), ins, (do, torch.ones_like(kl))) + (kl,)

    t_graph = timed(run_graphed, N)
    t_sdpa = timed(sdpa_step(*ins[:3], do), N)
    o_e, kl_e = core(*ins)
    gr = torch.autograd.grad((o_e, kl_e), ins, (do, torch.ones_like(kl_e)))
    out = run_graphed()
    errs = [float((a.float() - b.float()).abs().max()) for a, b in zip(gr, out[:5])]
    print(f"{name} T={T}: eager {t_eager:.2f} ms, graphed {t_graph:.2f} ms ({t_eager / t_graph:.2f}x), "
          f"SDPA {t_sdpa:.2f} ms; graph memory {(m1 - m0) / 2**20:.0f} MiB; kl eager {float(kl_e):.5f} "
          f"graphed {float(out[5]):.5f}; max grad diff {max(errs):.2e}", flush=True)
    del graphed
