"""What a new segment shape costs the "segments" path of dense attention with documents: torch's
cuDNN attention builds a graph the first time it sees a shape (then caches it for the process),
flash attention does not. fwd+bwd ms per call, bf16, on shapes never seen before (cold) and again
(warm), for the `small` and production geometries.

    PYTHONPATH=. python bench/results/document-masking-2026-12-03/segment_shapes.py
"""

import time

import torch

from msa_model.platform.compat import CUDNN_ATTENTION, causal_attention_with_lse


def flash(q, k, v, scale):
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    out = torch.ops.aten._scaled_dot_product_flash_attention(qt, kt, vt, 0.0, True, False, scale=scale)
    return out[0].transpose(1, 2), out[1]


def once(fn, n, L, H, G, D):
    q = torch.randn(n, L, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(n, L, G, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(n, L, G, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch.cuda.synchronize()
    t = time.perf_counter()
    o, _ = fn(q, k, v, D ** -0.5)
    o.float().sum().backward()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


for fn in (causal_attention_with_lse, flash):  # context, libraries, kernels loaded
    once(fn, 1, 256, 16, 4, 64)
    once(fn, 1, 256, 64, 4, 128)

for name, H, G, D in (("small", 16, 4, 64), ("production", 64, 4, 128)):
    for n, L in ((1, 3072 + 128 * (1 if D == 64 else 3)), (1, 5632), (2, 4352), (1, 12288), (3, 9728)):
        row = []
        for label, fn in (("cudnn", causal_attention_with_lse), ("flash", flash)):
            try:
                cold = once(fn, n, L, H, G, D)
                warm = min(once(fn, n, L, H, G, D) for _ in range(3))
                row.append(f"{label} cold {cold:7.1f} warm {warm:6.2f}")
            except RuntimeError as e:
                row.append(f"{label} error {str(e)[:80]}")
        print(f"{name:10s} n={n} L={L:6d}: " + " | ".join(row), f"(cudnn ok: {CUDNN_ATTENTION['ok']})", flush=True)
