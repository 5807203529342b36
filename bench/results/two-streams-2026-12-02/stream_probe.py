"""Probe: the hybrid forward on shared (realistic) sets with and without its second stream, the tile
kernel alone, FlexAttention on the same support; then a timeline of one 32K call (each kernel's
start, length and stream, from the torch profiler's trace).

    PYTHONPATH=.:bench python bench/results/two-streams-2026-12-02/stream_probe.py
"""
import json
import os
import sys

import torch

import bench_sparse_attention as bsa
from msa_model.ops.sparse_attention import hybrid, inverse_index, tiles

LENGTHS = [int(x) for x in os.environ.get("LENGTHS", "32768,131072").split(",")]
real_side = hybrid.side_stream

for T in LENGTHS:
    q, k, v, _ = bsa.inputs(T)
    idx = bsa.realistic_sets(T, bsa.HKV, bsa.TOPK, bsa.BS, "cuda")
    fwd = bsa.ours(idx)
    row = {"T": T}
    with torch.no_grad():
        row["two streams"] = bsa.timeit(lambda: fwd(q, k, v))
        hybrid.side_stream = lambda device: None
        row["one stream"] = bsa.timeit(lambda: fwd(q, k, v))
        hybrid.side_stream = real_side
        clean = inverse_index.clean_block_idx(idx, bsa.BS)
        union = tiles.tile_union(clean, 8)
        row["tile kernel alone"] = bsa.timeit(lambda: tiles.tile_forward(q, k, v, union, bsa.BS, bsa.D ** -0.5))
        row["union + clean"] = bsa.timeit(lambda: tiles.tile_union(inverse_index.clean_block_idx(idx, bsa.BS), 8))
        fx = bsa.flex(bsa.flex_sets(idx, "realistic"), T)
        row["flex"] = bsa.timeit(lambda: fx(q, k, v))
        row["two streams again"] = bsa.timeit(lambda: fwd(q, k, v))
    print(json.dumps({a: round(b, 3) for a, b in row.items()}), flush=True)
    if T == LENGTHS[0]:
        from torch.profiler import ProfilerActivity, profile
        with torch.no_grad():
            for _ in range(3):
                fwd(q, k, v)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                for _ in range(2):
                    fwd(q, k, v)
                torch.cuda.synchronize()
        path = os.path.join(os.environ.get("OUT", "."), "trace.json")
        prof.export_chrome_trace(path)
        ev = [e for e in json.load(open(path))["traceEvents"] if e.get("cat") == "kernel"]
        t0 = min(e["ts"] for e in ev)
        print(f"timeline of two {T // 1024}K forwards (us from the first kernel): start, length, stream, kernel")
        for e in sorted(ev, key=lambda e: e["ts"]):
            print(f"{e['ts'] - t0:9.1f} {e['dur']:8.1f}  s{e['args'].get('stream')}  {e['name'][:70]}")
    del q, k, v
    torch.cuda.empty_cache()
