"""Round 8 probe e: the backward's dK/dV written directly by a bucket's only work item, against
the tree before (run once per tree from its root, TREE=. PYTHONPATH=.; call 6 ran the tree
before (`git archive` of d2ca555 under probe/head), this one, and both again; the JSON lines in
probe-round8e.jsonl alternate in that order). The variant it measured is not kept: the only item
of a bucket added its dK/dV straight into the fp32 outputs (a load and store after the tile loop,
the reduction skipping such buckets); bench/RESULTS.md, round 8."""
import json, os, sys, time
import torch
sys.path.insert(0, os.path.join(os.environ.get("TREE", "."), "bench"))
from bench_msa_layer import BK, TOPK, make_inputs, timed  # noqa
from msa_model.ops import msa_attention, sparse_attention, select_blocks
from msa_model.ops.sparse_attention import triton as sat
def clear(xs):
    for x in xs: x.grad = None
T = 131072
q, k, v, iq, ik = make_inputs(T); leaves = [q, k, v, iq, ik]; do = torch.randn_like(q)
with torch.no_grad():
    bi = select_blocks(iq, ik, BK, TOPK, backend="triton")
def fb(prec="input"):
    o, kl_ = msa_attention(q, k, v, iq, ik, BK, TOPK, backend="triton", kl_teacher="backward", index_precision=prec)
    torch.autograd.backward([o, kl_], [do, torch.ones_like(kl_)]); clear(leaves)
def afb():
    o, _ = sparse_attention(q, k, v, bi, BK, backend="triton", check_ids=False)
    o.backward(do); clear(leaves)
r = {"tree": os.environ.get("TREE", ".")}
for rep in range(2):
    r[f"attn_fwdbwd_{rep}"] = timed(afb, 5)
    r[f"layer_fwdbwd_{rep}"] = timed(fb, 5)
    r[f"layer_fwdbwd_fp8_{rep}"] = timed(lambda: fb("fp8"), 5)
r["bwd_regs_spills"] = (sat.COMPILED["bwd"].n_regs, sat.COMPILED["bwd"].n_spills)
print(json.dumps(r), flush=True)
with open(os.path.join(os.environ.get("OUT", "."), "probe-round8e.jsonl"), "a") as f:
    f.write(json.dumps(r) + "\n")
