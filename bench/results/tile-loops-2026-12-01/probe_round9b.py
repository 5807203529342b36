"""Round 9 probe b (call 3), on a tree whose Tuning had two switches, since removed:
`fwd_skip_masks` (the gather kernel's test below, now unconditional) and `tile_skip_masks` (a
runtime branch per step of the tile kernel, slower, dropped for the two loops of probe c).
Mask-free steps in the sparse forwards (the gather kernel's tiles after the
block, the tile kernel's blocks every row of the tile reads whole) against masking every step;
the tile path against FlexAttention on the same (block-granular) support; where the hybrid
forward's time goes. Default geometry, bf16. JSON lines to $OUT/probe-round9b.jsonl."""
import dataclasses, json, os, sys
import torch
sys.path.insert(0, "bench")
import bench_sparse_attention as bsa  # noqa
from bench_sparse_attention import BS, HKV, TOPK, flex, flex_sets, inputs, random_sets, realistic_sets, timeit  # noqa
from msa_model.ops import sparse_attention
from msa_model.ops.sparse_attention import triton as sat
OUT = os.environ.get("OUT", ".")
def log(r):
    print(json.dumps(r), flush=True)
    with open(os.path.join(OUT, "probe-round9b.jsonl"), "a") as f:
        f.write(json.dumps(r) + "\n")
base = sat.Tuning()
VARS = {"gather": dict(tile_rows=0), "gather_skip": dict(tile_rows=0, fwd_skip_masks=True),
        "hybrid": {}, "hybrid_skip": dict(fwd_skip_masks=True, tile_skip_masks=True),
        "tiles": dict(tile_union_max=16.0), "tiles_skip": dict(tile_union_max=16.0, tile_skip_masks=True),
        "tiles_skip_kb128": dict(tile_union_max=16.0, tile_skip_masks=True, tile_keys=128),
        "tiles_skip_s2": dict(tile_union_max=16.0, tile_skip_masks=True, tile_stages=2)}
for T in (32768, 131072):
    q, k, v, do = inputs(T)
    for pat in ("realistic", "random"):
        idx = (random_sets if pat == "random" else realistic_sets)(T, HKV, TOPK, BS, "cuda")
        r = dict(T=T, pat=pat)
        ref = None
        for name, over in VARS.items():
            tun = dataclasses.replace(base, **over)
            f = lambda: sparse_attention(q, k, v, idx, BS, backend="triton", check_ids=False, tuning=tun)[0]
            with torch.no_grad():
                o = f()
                if ref is None:
                    ref = o
                r[name] = timeit(f)
                r[name + "_err"] = float((o.float() - ref.float()).abs().max())
            if name.startswith("tiles"):
                r[name + "_regs"] = (sat.COMPILED["tile_fwd"].n_regs, sat.COMPILED["tile_fwd"].n_spills)
        if pat == "realistic":
            fx = flex(flex_sets(idx, pat), T)
            with torch.no_grad():
                r["flex"] = timeit(lambda: fx(q, k, v))
        log(r)
    del q, k, v, do
    torch.cuda.empty_cache()
# where the hybrid forward's time goes, 128K realistic and random, masks skipped
T = 131072
q, k, v, do = inputs(T)
from torch.profiler import ProfilerActivity, profile
for pat in ("realistic", "random"):
    idx = (random_sets if pat == "random" else realistic_sets)(T, HKV, TOPK, BS, "cuda")
    tun = dataclasses.replace(base, **VARS["hybrid_skip"])
    f = lambda: sparse_attention(q, k, v, idx, BS, backend="triton", check_ids=False, tuning=tun)[0]
    with torch.no_grad():
        f(); torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                f()
            torch.cuda.synchronize()
    rows = sorted(((e.key, e.device_time_total / 3e3, e.count // 3) for e in prof.key_averages()), key=lambda x: -x[1])
    log(dict(profile=pat, kernels=[(a[:60], round(b, 3), c) for a, b, c in rows[:14]]))
del q, k, v, do
torch.cuda.empty_cache()
# the layer (default geometry, random inputs): training forward and fwd+bwd with and without
from bench_msa_layer import BK, make_inputs, timed  # noqa
from msa_model.ops import msa_attention
q, k, v, iq, ik = make_inputs(T); leaves = [q, k, v, iq, ik]; do = torch.randn_like(q)
def layer_fb(tun):
    o, kl_ = msa_attention(q, k, v, iq, ik, BK, TOPK, backend="triton", kl_teacher="backward", tuning={"sparse_attention": tun})
    torch.autograd.backward([o, kl_], [do, torch.ones_like(kl_)])
    for x in leaves: x.grad = None
def layer_f(tun):
    msa_attention(q, k, v, iq, ik, BK, TOPK, backend="triton", kl_teacher="backward", tuning={"sparse_attention": tun})
for rep in range(2):
    for name in ("hybrid", "hybrid_skip"):
        tun = dataclasses.replace(base, **VARS[name])
        log(dict(layer=name, rep=rep, train_fwd=timed(lambda: layer_f(tun), 5), fwdbwd=timed(lambda: layer_fb(tun), 5)))
