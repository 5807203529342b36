"""Round 10 probe b (call 2, both trees on one machine; the new tree then had TMA in the tile
kernel and a `Tuning.combine_rows` whose combine programs looped over that many queries one by
one in the hybrid's gather pass, default 16; slower on random sets, replaced by the combine over
several queries at once that call 4 measured): the sparse forward (and
fwd+bwd) at the tree's defaults on realistic, mixed and random sets at 32K and 128K;
FlexAttention with its block mask built outside the timing and inside it (from the same sets);
for the new tree the combine's rows a program; the MSA layer at 128K (random inputs) and SDPA.
JSON lines to $OUT/probe-round10b.jsonl."""
import dataclasses, json, os, sys
import torch
sys.path.insert(0, "bench")
from bench_sparse_attention import BS, HKV, TOPK, flex, flex_sets, fwd_bwd, inputs, random_sets, realistic_sets, timeit  # noqa
from msa_model.ops import sparse_attention
from msa_model.ops.sparse_attention import triton as st
OUT, TREE = os.environ.get("OUT", "."), os.environ.get("TREE", "new")
def log(r):
    r["tree"] = TREE
    print(json.dumps(r), flush=True)
    with open(os.path.join(OUT, "probe-round10b.jsonl"), "a") as f:
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
        run = lambda tuning=None: sparse_attention(q, k, v, idx, BS, backend="triton", check_ids=False, tuning=tuning)[0]
        with torch.no_grad():
            r["fwd"] = timeit(run)
            if new and T == 131072 and pat in ("realistic", "mixed2", "random"):
                for cr in (1, 4, 64):
                    tu = dataclasses.replace(st.DEFAULT_TUNING, combine_rows=cr)
                    r[f"fwd_combine_rows{cr}"] = timeit(lambda: run(tu))
                tu = dataclasses.replace(st.DEFAULT_TUNING, tile_keys=64, tile_masked_stages=3)
                r["fwd_keys64_stages3"] = timeit(lambda: run(tu))
        r["fwdbwd"] = timeit(fwd_bwd(lambda a, b, c: sparse_attention(a, b, c, idx, BS, backend="triton", check_ids=False)[0],
                                     q, k, v, do))
        if pat == "realistic" and new:
            fx = flex(flex_sets(idx, pat), T)
            with torch.no_grad():
                r["flex"] = timeit(lambda: fx(q, k, v))
                r["flex_mask_build"] = timeit(lambda: flex(flex_sets(idx, pat), T))
                r["flex_with_mask"] = timeit(lambda: flex(flex_sets(idx, pat), T)(q, k, v))
        log(r)
    del q, k, v, do
    torch.cuda.empty_cache()
from bench_msa_layer import BK, make_inputs, sdpa, timed  # noqa
from msa_model.ops import msa_attention
T = 131072
q, k, v, iq, ik = make_inputs(T); leaves = [q, k, v, iq, ik]; do = torch.randn_like(q)
def clear():
    for x in leaves: x.grad = None
def layer_fb(prec):
    o, kl_ = msa_attention(q, k, v, iq, ik, BK, TOPK, backend="triton", kl_teacher="backward", index_precision=prec)
    torch.autograd.backward([o, kl_], [do, torch.ones_like(kl_)]); clear()
def layer_f(prec):
    msa_attention(q, k, v, iq, ik, BK, TOPK, backend="triton", kl_teacher="backward", index_precision=prec)
for rep in range(2):
    log(dict(layer=T, rep=rep, train_fwd=timed(lambda: layer_f("input"), 5), fwdbwd=timed(lambda: layer_fb("input"), 5),
             train_fwd_fp8=timed(lambda: layer_f("fp8"), 5), fwdbwd_fp8=timed(lambda: layer_fb("fp8"), 5)))
if new:
    def sdpa_fb():
        sdpa(q, k, v).backward(do); clear()
    log(dict(sdpa=T, fwd=timed(lambda: sdpa(q, k, v), 3), fwdbwd=timed(sdpa_fb, 3)))
