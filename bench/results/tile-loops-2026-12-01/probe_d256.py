"""Round 9 (call 10): the tile path at head dim 256: which launch shapes fit in shared memory (forward, tile backward)."""
import dataclasses, os, sys, json
import torch
from msa_model.ops import sparse_attention
from msa_model.ops.sparse_attention import triton as sat
B, T, Hq, G, D, bs, K = 1, 1536, 32, 2, 256, 128, 8
q = torch.randn(B, T, Hq, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
k = torch.randn(B, T, G, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
v = torch.randn(B, T, G, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
loc = (torch.arange(T, device="cuda") // bs)[None, :, None, None].expand(B, T, G, 1)
idx = torch.cat([loc, torch.zeros_like(loc), (loc // 2)], -1).to(torch.int32)
VARS = json.loads(os.environ.get("VARS", '[{}]'))
for over in VARS:
    for tb in (False, True):
        tun = dataclasses.replace(sat.Tuning(), tile_min_queries=0, tile_backward=tb, **over)
        try:
            o, _ = sparse_attention(q, k, v, idx, bs, backend="triton", tuning=tun)
            o.sum().backward()
            torch.cuda.synchronize()
            r = "ok"
        except Exception as e:  # noqa
            r = repr(e)[:100]
        print(os.environ.get("TREE"), over, "tile_backward" if tb else "hybrid", r,
              sat.COMPILED.get("tile_fwd") and sat.COMPILED["tile_fwd"].metadata.shared, flush=True)
