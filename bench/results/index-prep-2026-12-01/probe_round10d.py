"""Round 10 probe d (call 4, both trees on one machine: head d79361b, new the committed kernels
with combine_queries = combine_queries_rows = 1 as defaults, so `fwd` of the new tree is that
and the `rc` variants are the defaults since chosen: 2 and 4): the sparse forward at 32K and
128K on realistic, mixed and random sets; for the new tree the forward combine's queries a
program (hybrid rows: combine_queries_rows; gather path alone: combine_queries, tile_rows=0),
FlexAttention (block mask built outside the timing), 16/32/64-bit sort keys; the MSA layer at 128K
(random inputs) and SDPA. JSON lines to $OUT/probe-round10d.jsonl."""
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
    with open(os.path.join(OUT, "probe-round10d.jsonl"), "a") as f:
        f.write(json.dumps(r) + "\n")
def mixed(T, r):
    idx = realistic_sets(T, HKV, TOPK, BS, "cuda").clone()
    idx[..., TOPK - r:] = random_sets(T, HKV, TOPK, BS, "cuda", seed=1)[..., 1:1 + r]
    return idx
SETS = {"realistic": lambda T: realistic_sets(T, HKV, TOPK, BS, "cuda"), "mixed1": lambda T: mixed(T, 1),
        "mixed2": lambda T: mixed(T, 2), "random": lambda T: random_sets(T, HKV, TOPK, BS, "cuda")}
new = TREE == "new"
tu = lambda **kw: dataclasses.replace(st.DEFAULT_TUNING, **kw)
for T in (32768, 131072):
    q, k, v, do = inputs(T)
    for pat in ("realistic", "mixed1", "mixed2", "random"):
        idx = SETS[pat](T)
        r = dict(T=T, pat=pat)
        run = lambda tuning=None: sparse_attention(q, k, v, idx, BS, backend="triton", check_ids=False, tuning=tuning)[0]
        with torch.no_grad():
            r["fwd"] = timeit(run)
            if new:
                for rc in (1, 2, 4, 8):
                    r[f"fwd_rows_rc{rc}"] = timeit(lambda: run(tu(combine_queries_rows=rc)))
                if pat == "random":
                    for rc in (1, 2, 4, 8):
                        r[f"gather_rc{rc}"] = timeit(lambda: run(tu(combine_queries=rc, tile_rows=0)))
                if pat == "realistic":
                    fx = flex(flex_sets(idx, pat), T)
                    r["flex"] = timeit(lambda: fx(q, k, v))
        log(r)
    del q, k, v, do
    torch.cuda.empty_cache()
if new:
    key = torch.randint(0, 4096, (8 << 20,), device="cuda")
    log(dict(sort_keys=8 << 20, int64=timeit(lambda: torch.sort(key, stable=True)),
             int32=timeit(lambda: torch.sort(key.int(), stable=True)), int16=timeit(lambda: torch.sort(key.short(), stable=True))))
from bench_msa_layer import BK, make_inputs, sdpa, timed  # noqa
from msa_model.ops import msa_attention
T = 131072
q, k, v, iq, ik = make_inputs(T); leaves = [q, k, v, iq, ik]; do = torch.randn_like(q)
def clear():
    for x in leaves: x.grad = None
TUNE = {}
def layer_fb(prec):
    o, kl_ = msa_attention(q, k, v, iq, ik, BK, TOPK, backend="triton", kl_teacher="backward", index_precision=prec,
                           tuning=dict(TUNE))
    torch.autograd.backward([o, kl_], [do, torch.ones_like(kl_)]); clear()
def layer_f(prec):
    msa_attention(q, k, v, iq, ik, BK, TOPK, backend="triton", kl_teacher="backward", index_precision=prec,
                  tuning=dict(TUNE))
variants = [1, 2, 4] if new else [None]
for rep in range(2):
    for rc in variants:
        if rc is not None:
            TUNE["sparse_attention"] = tu(combine_queries_rows=rc)
        log(dict(layer=T, rep=rep, rc=rc, train_fwd=timed(lambda: layer_f("input"), 5), fwdbwd=timed(lambda: layer_fb("input"), 5),
                 train_fwd_fp8=timed(lambda: layer_f("fp8"), 5), fwdbwd_fp8=timed(lambda: layer_fb("fp8"), 5)))
if new:
    def sdpa_fb():
        sdpa(q, k, v).backward(do); clear()
    log(dict(sdpa=T, fwd=timed(lambda: sdpa(q, k, v), 3), fwdbwd=timed(sdpa_fb, 3)))
