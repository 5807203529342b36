"""(with prefetch.patch applied) The prefetch changes no bit: o, lse, dq, dk, dv (and the teacher rows) with and without it."""
import dataclasses, sys, torch
sys.path.insert(0, "bench")
from msa_model.ops.sparse_attention import gather
from msa_model.ops.sparse_attention.tuning import DEFAULT_TUNING
from msa_model.ops.sparse_attention.reference import clean_block_idx_reference
from bench_sparse_attention import random_sets
import os
DEV = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(4096, 64, 4, 128, 128, 16), (3001, 16, 4, 64, 64, 8), (2500, 12, 2, 64, 128, 4)] if DEV == "cuda" else [(300, 8, 2, 32, 64, 4)]
torch.manual_seed(0)
for (T, Hq, G, D, bs, K) in SHAPES:
    q = torch.randn(1, T, Hq, D, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(1, T, G, D, device=DEV, dtype=torch.bfloat16)
    v = torch.randn(1, T, G, D, device=DEV, dtype=torch.bfloat16)
    do = torch.randn_like(q)
    idx = clean_block_idx_reference(random_sets(T, G, K, bs, DEV), bs).contiguous()
    outs = []
    for pf in (0, 1, 2):
        tu = dataclasses.replace(DEFAULT_TUNING, fwd_prefetch=pf, bwd_prefetch=pf)
        o, lse, index = gather.sparse_forward(q, k, v, idx, bs, D ** -0.5, tuning=tu)
        teacher = torch.zeros(idx.numel(), bs, dtype=torch.bfloat16, device=DEV)
        dq, dk, dv = gather.sparse_backward(do, q, k, v, o, lse, idx, bs, D ** -0.5, index=index, tuning=tu, teacher=teacher)
        outs.append((o, lse, dq, dk, dv, teacher))
    same = all(torch.equal(a, b) for other in outs[1:] for a, b in zip(outs[0], other))
    print(f"prefetch bit-identical T={T} Hq={Hq} G={G} D={D} bs={bs} K={K}: {same}", flush=True)
    assert same
