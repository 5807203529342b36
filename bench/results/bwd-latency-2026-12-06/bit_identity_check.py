"""A kernel experiment changes no bit: o, lse, dq, dk, dv and the KL teacher's rows of the gather
path with each Tuning variant equal the default's. Run from the repository root with the
experiment's patch applied:

    python bench/results/bwd-latency-2026-12-06/bit_identity_check.py prefetch     # prefetch.patch
    python bench/results/bwd-latency-2026-12-06/bit_identity_check.py ahead-i32    # ahead-i32.patch
"""
import dataclasses
import sys

import torch

sys.path.insert(0, "bench")
from bench_sparse_attention import random_sets  # noqa: E402
from msa_model.ops.sparse_attention import gather  # noqa: E402
from msa_model.ops.sparse_attention.reference import clean_block_idx_reference  # noqa: E402
from msa_model.ops.sparse_attention.tuning import DEFAULT_TUNING  # noqa: E402

VARIANTS = {
    "prefetch": [dict(fwd_prefetch=1, bwd_prefetch=1), dict(fwd_prefetch=2, bwd_prefetch=2)],
    "ahead-i32": [dict(bwd_ahead=True), dict(bwd_i32=True), dict(bwd_ahead=True, bwd_i32=True)],
}[sys.argv[1]]
DEV = "cuda" if torch.cuda.is_available() else "cpu"
# (T, Hq, G, D, block size, K); on a CPU the interpreter runs one small shape
SHAPES = ([(4096, 64, 4, 128, 128, 16), (3001, 16, 4, 64, 64, 8), (2500, 12, 2, 64, 128, 4)] if DEV == "cuda"
          else [(300, 8, 2, 32, 64, 4)])
torch.manual_seed(0)
for T, Hq, G, D, bs, K in SHAPES:
    q, do = (torch.randn(1, T, Hq, D, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(1, T, G, D, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    idx = clean_block_idx_reference(random_sets(T, G, K, bs, DEV), bs).contiguous()
    outs = []
    for var in [{}, *VARIANTS]:
        tu = dataclasses.replace(DEFAULT_TUNING, **var)
        o, lse, index = gather.sparse_forward(q, k, v, idx, bs, D ** -0.5, tuning=tu)
        teacher = torch.zeros(idx.numel(), bs, dtype=torch.bfloat16, device=DEV)
        dq, dk, dv = gather.sparse_backward(do, q, k, v, o, lse, idx, bs, D ** -0.5, index=index, tuning=tu,
                                            teacher=teacher)
        outs.append((o, lse, dq, dk, dv, teacher))
    same = all(torch.equal(a, b) for other in outs[1:] for a, b in zip(outs[0], other))
    print(f"{sys.argv[1]} bit-identical T={T} Hq={Hq} G={G} D={D} bs={bs} K={K}: {same}", flush=True)
    assert same
