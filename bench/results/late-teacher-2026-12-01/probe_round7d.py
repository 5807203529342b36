"""Round 7 probe 3: the teacher rows from a 16-bit copy of P shared with dV (TEACHER_AT 2) or
their own fp16 copy (1), no zeroing of the rows' buffer, the late KL backward's tile shape;
with the forward-teacher layer and SDPA in the same run.
Ran with a temporary switch sat.TEACHER_AT (1: before dV from an fp16 copy, 2: before dV from the
bf16 copy dV multiplies, the one kept), since removed; wrote probe-round7d.json.
"""
import dataclasses, json, os, sys, time
import torch
sys.path.insert(0, "bench")
from bench_msa_layer import BK, TOPK, make_inputs, timed, sdpa  # noqa
from msa_model.ops import msa_attention
from msa_model.ops.sparse_attention import triton as sat
from msa_model.ops.indexer_kl import triton as klt
T0 = time.time(); OUT = {}
def say(*a): print(f"[{time.time()-T0:5.0f}s]", *a, flush=True)
def rel(a, b): return ((a.double()-b.double()).norm()/b.double().norm().clamp_min(1e-30)).item()
def clear(xs):
    for x in xs: x.grad = None
# correctness of each placement at 8K against the forward teacher
q, k, v, iq, ik = make_inputs(8192); leaves = [q, k, v, iq, ik]; do = torch.randn_like(q)
def grads(teacher):
    o, kl = msa_attention(q, k, v, iq, ik, BK, TOPK, backend="triton", kl_teacher=teacher)
    g = torch.autograd.grad([o, kl], leaves, [do, torch.ones_like(kl)]); return kl.item(), g
kf, gf = grads("forward")
for at in (1, 2):
    sat.TEACHER_AT[0] = at
    kb, gb = grads("backward")
    OUT[f"check_at{at}"] = dict(kl_f=kf, kl_b=kb, **{n: rel(x, y) for n, x, y in zip("dq dk dv diq dik".split(), gb, gf)},
                                regs=(sat.COMPILED["bwd"].n_regs, sat.COMPILED["bwd"].n_spills))
    say(OUT[f"check_at{at}"])
del q, k, v, iq, ik, leaves, do; torch.cuda.empty_cache()
T = 131072
q, k, v, iq, ik = make_inputs(T); leaves = [q, k, v, iq, ik]; do = torch.randn_like(q)
def fb(teacher, prec="input", kl=None):
    tun = {} if kl is None else {"indexer_kl": kl}
    o, kl_ = msa_attention(q, k, v, iq, ik, BK, TOPK, backend="triton", kl_teacher=teacher, index_precision=prec, tuning=tun)
    torch.autograd.backward([o, kl_], [do, torch.ones_like(kl_)]); clear(leaves)
r = {}
r["forward"] = timed(lambda: fb("forward"), 5)
r["forward_fp8"] = timed(lambda: fb("forward", "fp8"), 5)
for at in (1, 2):
    sat.TEACHER_AT[0] = at
    for M, w in ((32, 4), (16, 4), (32, 2), (64, 8)):
        cfg = dataclasses.replace(klt.DEFAULT_TUNING, late_M=M, late_warps=w)
        r[f"at{at}_M{M}w{w}"] = timed(lambda: fb("backward", kl=cfg), 5)
    r[f"at{at}_fp8"] = timed(lambda: fb("backward", "fp8"), 5)
    say(at, {k_: v_ for k_, v_ in r.items() if k_.startswith(f"at{at}")})
r["sdpa_fwd"] = timed(lambda: sdpa(q, k, v), 3)
def sfb():
    sdpa(q, k, v).backward(do); clear(leaves)
r["sdpa_fwdbwd"] = timed(sfb, 3)
say(r)
OUT["layer_128k"] = r
json.dump(OUT, open(os.path.join(os.environ.get("OUT", "/tmp"), "round7d.json"), "w"), indent=1, default=str)
