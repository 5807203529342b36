"""Round 9 probe e (call 11, one machine for both trees: a95f5a6 and the round's final code),
once per tree (PYTHONPATH=<tree>, TREE=<name>), for RESULTS: the sparse
forward at the tree's defaults on realistic, mixed (probe d) and random sets at 32K and 128K,
FlexAttention on the realistic support, the layer (random inputs) at 128K, SDPA. JSON lines to
$OUT/probe-round9e.jsonl."""
import json, os, sys
import torch
sys.path.insert(0, "bench")
from bench_sparse_attention import BS, HKV, TOPK, flex, flex_sets, fwd_bwd, inputs, random_sets, realistic_sets, timeit  # noqa
from msa_model.ops import sparse_attention
OUT, TREE = os.environ.get("OUT", "."), os.environ.get("TREE", "new")
def log(r):
    r["tree"] = TREE
    print(json.dumps(r), flush=True)
    with open(os.path.join(OUT, "probe-round9e.jsonl"), "a") as f:
        f.write(json.dumps(r) + "\n")
def mixed(T, r):
    idx = realistic_sets(T, HKV, TOPK, BS, "cuda").clone()
    idx[..., TOPK - r:] = random_sets(T, HKV, TOPK, BS, "cuda", seed=1)[..., 1:1 + r]
    return idx
for T in (32768, 131072):
    q, k, v, do = inputs(T)
    for pat in ("realistic", "mixed1", "mixed2", "random"):
        idx = {"realistic": lambda: realistic_sets(T, HKV, TOPK, BS, "cuda"), "random": lambda: random_sets(T, HKV, TOPK, BS, "cuda"),
               "mixed1": lambda: mixed(T, 1), "mixed2": lambda: mixed(T, 2)}[pat]()
        f = lambda: sparse_attention(q, k, v, idx, BS, backend="triton", check_ids=False)[0]
        r = dict(T=T, pat=pat)
        with torch.no_grad():
            r["fwd"] = timeit(f)
        r["fwdbwd"] = timeit(fwd_bwd(lambda a, b, c: sparse_attention(a, b, c, idx, BS, backend="triton", check_ids=False)[0],
                                     q, k, v, do))
        if pat == "realistic" and TREE == "new":
            fx = flex(flex_sets(idx, pat), T)
            with torch.no_grad():
                r["flex"] = timeit(lambda: fx(q, k, v))
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
if TREE == "new":
    def sdpa_fb():
        sdpa(q, k, v).backward(do); clear()
    log(dict(sdpa=T, fwd=timed(lambda: sdpa(q, k, v), 3), fwdbwd=timed(sdpa_fb, 3)))
