"""Round 10 probe a (call 1, both trees on one machine: TREE=head PYTHONPATH=<d79361b>, then
TREE=new): the index preparation kernels (clean, tile union) against their torch definitions,
32-bit against 64-bit sort keys, the sparse forward, the tile forward through TMA descriptors
(tma_tile.py, beside the tile kernel of the time, which loaded by pointers), FlexAttention, a
kernel profile of the 128K realistic forward. The new tree then had the cleaning kernel by pairs
of slots (probe_round10c.py's `pair_kernel`), the union kernel as committed, 32-bit keys, and
neither TMA in the tile kernel nor several-query combines. Run from the repository root with
PYTHONPATH=<tree>:bench/results/index-prep-2026-12-01. JSON lines to $OUT/probe-round10.jsonl."""
import json, os, sys, math
import torch
sys.path.insert(0, "bench")
from bench_sparse_attention import BS, HKV, TOPK, flex, flex_sets, inputs, random_sets, realistic_sets, timeit  # noqa
from msa_model.ops import sparse_attention
from msa_model.ops import inverse_index as ii
from msa_model.ops.sparse_attention import triton as st
OUT, TREE = os.environ.get("OUT", "."), os.environ.get("TREE", "new")
def log(r):
    r["tree"] = TREE
    print(json.dumps(r), flush=True)
    with open(os.path.join(OUT, "probe-round10.jsonl"), "a") as f:
        f.write(json.dumps(r) + "\n")
def mixed(T, r):
    idx = realistic_sets(T, HKV, TOPK, BS, "cuda").clone()
    idx[..., TOPK - r:] = random_sets(T, HKV, TOPK, BS, "cuda", seed=1)[..., 1:1 + r]
    return idx
SETS = {"realistic": lambda T: realistic_sets(T, HKV, TOPK, BS, "cuda"), "mixed1": lambda T: mixed(T, 1),
        "mixed2": lambda T: mixed(T, 2), "random": lambda T: random_sets(T, HKV, TOPK, BS, "cuda")}
new = TREE == "new"
for T in (32768, 131072):
    q, k, v, do = inputs(T)
    for pat in ("realistic", "mixed1", "mixed2", "random"):
        idx = SETS[pat](T)
        r = dict(T=T, pat=pat)
        with torch.no_grad():
            r["fwd"] = timeit(lambda: sparse_attention(q, k, v, idx, BS, backend="triton", check_ids=False)[0])
        if new:
            ref_clean = ii.clean_block_idx_reference(idx, BS)
            clean = ii.clean_block_idx(idx, BS)
            r["clean_same"] = bool(torch.equal(clean, ref_clean))
            r["clean_ms"] = timeit(lambda: ii.clean_block_idx(idx, BS))
            r["clean_ref_ms"] = timeit(lambda: ii.clean_block_idx_reference(idx, BS))
            a, b = st.tile_union_triton(clean, 8), st.tile_union_reference(clean, 8)
            r["union_same"] = all(bool(torch.equal(getattr(a, n), getattr(b, n))) for n in ("blocks", "count", "full"))
            r["union_ms"] = timeit(lambda: st.tile_union_triton(clean, 8))
            r["union_ref_ms"] = timeit(lambda: st.tile_union_reference(clean, 8))
            N = math.ceil(T / BS)
            r["index_ms"] = timeit(lambda: ii.build_inverse_index(clean, N))
            key = torch.randint(0, 4 * N, (clean.numel(),), device="cuda")
            r["sort64_ms"] = timeit(lambda: torch.sort(key, stable=True))
            k32 = key.to(torch.int32)
            r["sort32_ms"] = timeit(lambda: torch.sort(k32, stable=True))
            if pat != "random":
                from tma_tile import tma_tile_forward
                scale = 1 / math.sqrt(q.shape[-1])
                with torch.no_grad():
                    o1, l1 = st.tile_forward(q, k, v, a, BS, scale)
                    o2, l2 = tma_tile_forward(q, k, v, a, BS, scale)
                    r["tma_maxdiff"] = float((o1.float() - o2.float()).abs().max())
                    r["tile_ms"] = timeit(lambda: st.tile_forward(q, k, v, a, BS, scale))
                    for kk, s1, s2, w in ((128, 3, 2, 8), (128, 2, 2, 8), (64, 3, 3, 8), (128, 3, 2, 4)):
                        r[f"tma_ms_{kk}_{s1}_{s2}_{w}"] = timeit(lambda: tma_tile_forward(q, k, v, a, BS, scale, keys=kk, stages=s1, masked_stages=s2, warps=w))
            if pat == "realistic":
                fx = flex(flex_sets(idx, pat), T)
                with torch.no_grad():
                    r["flex"] = timeit(lambda: fx(q, k, v))
        log(r)
        if new and T == 131072 and pat == "realistic":
            from torch.profiler import profile, ProfilerActivity
            with torch.no_grad():
                f = lambda: sparse_attention(q, k, v, idx, BS, backend="triton", check_ids=False)[0]
                f(); torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(5):
                        f()
                    torch.cuda.synchronize()
            tab = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
            print(tab)
            open(os.path.join(OUT, "profile-128k-realistic.txt"), "w").write(tab)
    del q, k, v, do
    torch.cuda.empty_cache()
