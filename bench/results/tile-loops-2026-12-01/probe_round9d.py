"""Round 9 probe d (call 7, one machine for both trees: a95f5a6 and the two-loop kernel, still
at 64 keys and tile_masked_stages=1 by default), once per tree (PYTHONPATH=<tree>, TREE=<name>): the sparse forward on sets
between realistic and random: realistic (local, previous, first block, 13 stripes per group)
with its last r stripes replaced by per-query random causal blocks (mixed1, mixed2: unions of
about 1.1 K and 1.5 K per 8-query tile, as a trained indexer's middle layers); hybrid default,
and (new tree) tile-kernel launch shapes: keys a step, stages of the unmasked and the masked
loop. 32K and 128K, default geometry. JSON lines to $OUT/probe-round9d.jsonl."""
import dataclasses, json, os, sys
import torch
sys.path.insert(0, "bench")
from bench_sparse_attention import BS, HKV, TOPK, flex, flex_sets, inputs, random_sets, realistic_sets, timeit  # noqa
from msa_model.ops import sparse_attention
from msa_model.ops.sparse_attention import triton as sat
OUT, TREE = os.environ.get("OUT", "."), os.environ.get("TREE", "new")
def log(r):
    r["tree"] = TREE
    print(json.dumps(r), flush=True)
    with open(os.path.join(OUT, "probe-round9d.jsonl"), "a") as f:
        f.write(json.dumps(r) + "\n")
def mixed(T, r):
    idx = realistic_sets(T, HKV, TOPK, BS, "cuda").clone()
    rnd = random_sets(T, HKV, TOPK, BS, "cuda", seed=1)  # local block in its slot 0
    idx[..., TOPK - r:] = rnd[..., 1:1 + r]
    return idx
base = sat.Tuning()
VARS = {"hybrid": {}}
if TREE == "new":
    VARS.update({"kb64_s3m1": dict(tile_keys=64), "kb64_s3m2": dict(tile_keys=64, tile_masked_stages=2),
                 "kb64_s3m3": dict(tile_keys=64, tile_masked_stages=3),
                 "kb128_s3m1": dict(tile_keys=128), "kb128_s3m2": dict(tile_keys=128, tile_masked_stages=2),
                 "kb128_s2m2": dict(tile_keys=128, tile_stages=2, tile_masked_stages=2)})
for T in (32768, 131072):
    q, k, v, do = inputs(T)
    for pat in ("realistic", "mixed1", "mixed2"):
        idx = realistic_sets(T, HKV, TOPK, BS, "cuda") if pat == "realistic" else mixed(T, int(pat[-1]))
        clean = sat.clean_block_idx(idx, BS)
        u = sat.tile_union(clean, 8)
        r = dict(T=T, pat=pat, union8=round(float(u.count.float().mean()) / TOPK, 3),
                 over_limit=round(float((u.count > 1.5 * TOPK).float().mean()), 3))
        if getattr(u, "full", None) is not None:
            r["full8"] = round(float(u.full.float().mean()) / TOPK, 3)
        for name, over in VARS.items():
            tun = dataclasses.replace(base, **over)
            f = lambda: sparse_attention(q, k, v, idx, BS, backend="triton", check_ids=False, tuning=tun)[0]
            try:
                with torch.no_grad():
                    o = f()
                    if name == "hybrid":
                        ref = o
                    r[name] = timeit(f)
                    r[name + "_dev"] = float((o.float() - ref.float()).abs().max())
            except Exception as e:  # noqa: a launch shape may not fit
                r[name] = repr(e)[:120]
        if TREE == "new":
            ref64 = sparse_attention(q.double()[:, :4096], k.double()[:, :4096], v.double()[:, :4096], idx[:, :4096], BS,
                                     backend="reference")[0]
            with torch.no_grad():
                o = sparse_attention(q[:, :4096], k[:, :4096], v[:, :4096], idx[:, :4096], BS, backend="triton",
                                     tuning=dataclasses.replace(base, tile_min_queries=0))[0]
            r["err4k_vs_fp64"] = float((o.double() - ref64).norm() / ref64.norm())
        log(r)
    del q, k, v, do
    torch.cuda.empty_cache()
