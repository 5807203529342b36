"""Round 11 probe a (call 2, tree dac2cb1): where a 32K / 128K sparse forward goes (kernel profile
of five calls, per call), the tiles over the hybrid's union limit, the tile kernel alone,
FlexAttention (block mask built beforehand), on realistic and random sets. Run from the
repository root: PYTHONPATH=. OUT=<dir> python bench/results/layer-kernels-2026-12-01/probe_round11a.py;
JSON lines to $OUT/p11a.jsonl (here probe-round11a.jsonl)."""
import json, os, sys, math
import torch
sys.path.insert(0, "bench")
from bench_sparse_attention import BS, HKV, TOPK, flex, flex_sets, inputs, random_sets, realistic_sets, timeit  # noqa
from msa_model.ops import sparse_attention
from msa_model.ops import inverse_index as ii
from msa_model.ops.sparse_attention import triton as st
from torch.profiler import ProfilerActivity, profile
OUT = os.environ.get("OUT", ".")
def log(r):
    print(json.dumps(r), flush=True)
    with open(os.path.join(OUT, "p11a.jsonl"), "a") as f:
        f.write(json.dumps(r) + "\n")
for T in (32768, 131072):
    q, k, v, do = inputs(T)
    scale = 1 / math.sqrt(q.shape[-1])
    for pat in ("realistic", "random"):
        idx = realistic_sets(T, HKV, TOPK, BS, "cuda") if pat == "realistic" else random_sets(T, HKV, TOPK, BS, "cuda")
        r = dict(T=T, pat=pat)
        with torch.no_grad():
            f = lambda: sparse_attention(q, k, v, idx, BS, backend="triton", check_ids=False)[0]
            r["fwd"] = timeit(f)
            clean = ii.clean_block_idx(idx, BS)
            u = st.tile_union(clean, 8)
            lim = int(1.5 * TOPK)
            r["tiles"] = u.count.numel(); r["over"] = int((u.count > lim).sum())
            r["tile_ms"] = timeit(lambda: st.tile_forward(q, k, v, u, BS, scale, limit=lim))
            if pat == "realistic":
                fx = flex(flex_sets(idx, pat), T)
                r["flex"] = timeit(lambda: fx(q, k, v))
            for _ in range(3): f()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5): f()
                torch.cuda.synchronize()
            rows = []
            for e in prof.key_averages():
                if e.device_time_total > 0:
                    rows.append((e.key[:70], round(e.device_time_total / 5 / 1000, 4), e.count // 5))
            rows.sort(key=lambda x: -x[1])
            r["kernels"] = rows[:25]
            r["kernel_total_ms"] = round(sum(x[1] for x in rows), 3)
        log(r)
    del q, k, v, do
    torch.cuda.empty_cache()
