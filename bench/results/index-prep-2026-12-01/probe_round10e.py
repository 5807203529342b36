"""Round 10 probe e (call 6, both trees on one machine: TREE=head is 0e8c94a, whose tile kernel
lets value rows past a block's end enter as p = 0 times the value, as committed; TREE=new was a
variant not kept, which zeroed them in the masked loop: `vt = tl.where((j < end)[:, None], vt,
0.0)` in `_fwd_block`'s masked branch, with the block ends passed down to `_kv_step`): the
sparse forward at 32K and 128K on realistic, mixed2 and random sets, and
FlexAttention on the realistic support. JSON lines to $OUT/probe-round10e.jsonl."""
import json, os, sys
import torch
sys.path.insert(0, "bench")
from bench_sparse_attention import BS, HKV, TOPK, flex, flex_sets, inputs, random_sets, realistic_sets, timeit  # noqa
from msa_model.ops import sparse_attention
OUT, TREE = os.environ.get("OUT", "."), os.environ.get("TREE", "new")
def log(r):
    r["tree"] = TREE
    print(json.dumps(r), flush=True)
    with open(os.path.join(OUT, "probe-round10e.jsonl"), "a") as f:
        f.write(json.dumps(r) + "\n")
def mixed(T, r):
    idx = realistic_sets(T, HKV, TOPK, BS, "cuda").clone()
    idx[..., TOPK - r:] = random_sets(T, HKV, TOPK, BS, "cuda", seed=1)[..., 1:1 + r]
    return idx
SETS = {"realistic": lambda T: realistic_sets(T, HKV, TOPK, BS, "cuda"), "mixed2": lambda T: mixed(T, 2),
        "random": lambda T: random_sets(T, HKV, TOPK, BS, "cuda")}
for T in (32768, 131072):
    q, k, v, do = inputs(T)
    for pat in ("realistic", "mixed2", "random"):
        idx = SETS[pat](T)
        r = dict(T=T, pat=pat)
        with torch.no_grad():
            r["fwd"] = timeit(lambda: sparse_attention(q, k, v, idx, BS, backend="triton", check_ids=False)[0])
            if pat == "realistic" and TREE == "new":
                fx = flex(flex_sets(idx, pat), T)
                r["flex"] = timeit(lambda: fx(q, k, v))
        log(r)
    del q, k, v, do
    torch.cuda.empty_cache()
