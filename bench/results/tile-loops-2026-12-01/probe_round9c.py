"""Round 9 probe c (call 4: HEAD of the day, a95f5a6; call 6: the two-loop tile kernel with its
first defaults, 64 keys a step and an unpipelined masked loop), run once per tree (PYTHONPATH=<tree>, TREE=<name>): the sparse forward
(hybrid default, gather only, every tile on the tile kernel) on realistic and random sets at 32K
and 128K, FlexAttention on the same block-granular support, and the layer (random inputs) at
128K: training forward and fwd+bwd. TUNE=1 adds tile-kernel launch shapes. JSON lines to
$OUT/probe-round9c.jsonl."""
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
    with open(os.path.join(OUT, "probe-round9c.jsonl"), "a") as f:
        f.write(json.dumps(r) + "\n")
base = sat.Tuning()
VARS = {"hybrid": {}, "gather": dict(tile_rows=0), "tiles": dict(tile_union_max=16.0)}
if os.environ.get("TUNE"):
    VARS.update({"tiles_m2": dict(tile_union_max=16.0, tile_masked_stages=2),
                 "tiles_s2": dict(tile_union_max=16.0, tile_stages=2),
                 "tiles_s2m2": dict(tile_union_max=16.0, tile_stages=2, tile_masked_stages=2),
                 "tiles_kb128": dict(tile_union_max=16.0, tile_keys=128)})
for T in (32768, 131072):
    q, k, v, do = inputs(T)
    for pat in ("realistic", "random"):
        idx = (random_sets if pat == "random" else realistic_sets)(T, HKV, TOPK, BS, "cuda")
        r = dict(T=T, pat=pat)
        for name, over in VARS.items():
            if pat == "random" and name.startswith("tiles_"):
                continue
            tun = dataclasses.replace(base, **over)
            f = lambda: sparse_attention(q, k, v, idx, BS, backend="triton", check_ids=False, tuning=tun)[0]
            try:
                with torch.no_grad():
                    r[name] = timeit(f)
                if name.startswith("tiles"):
                    r[name + "_regs"] = (sat.COMPILED["tile_fwd"].n_regs, sat.COMPILED["tile_fwd"].n_spills,
                                         sat.COMPILED["tile_fwd"].metadata.shared)
            except Exception as e:  # noqa: a launch shape may not fit
                r[name] = repr(e)[:120]
        if pat == "realistic" and TREE == "new":
            fx = flex(flex_sets(idx, pat), T)
            with torch.no_grad():
                r["flex"] = timeit(lambda: fx(q, k, v))
        log(r)
    del q, k, v, do
    torch.cuda.empty_cache()
from bench_msa_layer import BK, make_inputs, timed  # noqa
from msa_model.ops import msa_attention
T = 131072
q, k, v, iq, ik = make_inputs(T); leaves = [q, k, v, iq, ik]; do = torch.randn_like(q)
def layer_fb(prec):
    o, kl_ = msa_attention(q, k, v, iq, ik, BK, TOPK, backend="triton", kl_teacher="backward", index_precision=prec)
    torch.autograd.backward([o, kl_], [do, torch.ones_like(kl_)])
    for x in leaves: x.grad = None
def layer_f(prec):
    msa_attention(q, k, v, iq, ik, BK, TOPK, backend="triton", kl_teacher="backward", index_precision=prec)
for rep in range(2):
    log(dict(layer=T, rep=rep, train_fwd=timed(lambda: layer_f("input"), 5), fwdbwd=timed(lambda: layer_fb("input"), 5),
             train_fwd_fp8=timed(lambda: layer_f("fp8"), 5), fwdbwd_fp8=timed(lambda: layer_fb("fp8"), 5)))
if TREE == "new":
    from bench_msa_layer import sdpa  # noqa
    def sdpa_fb():
        sdpa(q, k, v).backward(do)
        for x in leaves: x.grad = None
    log(dict(sdpa=T, fwd=timed(lambda: sdpa(q, k, v), 3), fwdbwd=timed(sdpa_fb, 3)))
