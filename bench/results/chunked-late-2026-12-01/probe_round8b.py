"""Round 8 probe b: the late teacher in query chunks (one autograd node) at 512K and 1M against
the forward teacher; SDPA at 256K for the 1M extrapolation. Writes $OUT/probe-round8b.json;
with ONLY_512K=1 only the 512K part, to $OUT/probe-round8c.json (call 3 ran it so, after the
chunks wrote in place).
Ran (call 2) with the chunked late path copying each chunk's outputs (since written in place,
ONLY_512K=1 re-measured 512K after that change, call 3).
Run from the repository root: PYTHONPATH=. OUT=<dir> python bench/results/chunked-late-2026-12-01/probe_round8b.py
"""
import json, os, sys, time
import torch
sys.path.insert(0, "bench")
from bench_msa_layer import BK, TOPK, make_inputs, timed, peak_gib, sdpa  # noqa
from msa_model.ops import msa_attention
T0 = time.time(); OUT = {}
def say(*a): print(f"[{time.time()-T0:5.0f}s]", *a, flush=True)
def clear(xs):
    for x in xs: x.grad = None
ONLY_512K = os.environ.get("ONLY_512K") == "1"
def dump():
    name = "probe-round8c.json" if ONLY_512K else "probe-round8b.json"
    json.dump(OUT, open(os.path.join(os.environ.get("OUT", "."), name), "w"), indent=1)
T = 524288
q, k, v, iq, ik = make_inputs(T); leaves = [q, k, v, iq, ik]; do = torch.randn_like(q)
def fb(teacher, prec="input"):
    o, kl_ = msa_attention(q, k, v, iq, ik, BK, TOPK, backend="triton", kl_teacher=teacher, index_precision=prec)
    torch.autograd.backward([o, kl_], [do, torch.ones_like(kl_)]); clear(leaves)
def fwd(teacher, prec="input"):
    msa_attention(q, k, v, iq, ik, BK, TOPK, backend="triton", kl_teacher=teacher, index_precision=prec)
r = {}
r["late_fwdbwd"] = timed(lambda: fb("backward"), 2)
r["late_fwdbwd_peak_gib"] = peak_gib(lambda: fb("backward"))
r["forward_fwdbwd"] = timed(lambda: fb("forward"), 2)
r["forward_fwdbwd_peak_gib"] = peak_gib(lambda: fb("forward"))
r["late_fwdbwd_fp8"] = timed(lambda: fb("backward", "fp8"), 2)
r["late_fwd"] = timed(lambda: fwd("backward"), 2)
r["forward_fwd"] = timed(lambda: fwd("forward"), 2)
OUT["t524288"] = r; say(r); dump()
if ONLY_512K:
    sys.exit(0)
del q, k, v, iq, ik, leaves, do; torch.cuda.empty_cache()
q, k, v, iq, ik = make_inputs(262144, grad=False)
with torch.no_grad():
    OUT["sdpa_fwd_256k"] = timed(lambda: sdpa(q, k, v), 2)
say(OUT); del q, k, v, iq, ik; torch.cuda.empty_cache(); dump()
T = 1048576
q, k, v, iq, ik = make_inputs(T); leaves = [q, k, v, iq, ik]
r = {}
r["late_fwd"] = timed(lambda: fwd("backward"), 2)
r["late_fwd_peak_gib"] = peak_gib(lambda: fwd("backward"))
r["late_fwd_fp8"] = timed(lambda: fwd("backward", "fp8"), 2)
r["forward_fwd"] = timed(lambda: fwd("forward"), 2)
r["forward_fwd_fp8"] = timed(lambda: fwd("forward", "fp8"), 2)
est = OUT["sdpa_fwd_256k"] * 16
r["speedup_late"] = est / r["late_fwd"]; r["speedup_late_fp8"] = est / r["late_fwd_fp8"]
r["speedup_forward"] = est / r["forward_fwd"]; r["speedup_forward_fp8"] = est / r["forward_fwd_fp8"]
OUT["t1048576"] = r; say(r); dump()
