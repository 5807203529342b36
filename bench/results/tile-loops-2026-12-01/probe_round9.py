"""Round 9 probe (call 2): the sparse kernels' occupancy. ptxas gives the gather forward and
backward kernels 255 registers (2 CTAs of 4 warps / 1 CTA of 8 warps per SM); capped with
Triton's `maxnreg`, more warps per SM would fit. Sweeps launch shapes at 128K (default geometry,
random inputs), checks each against the default's outputs, then times the layer with the best.
It ran on a tree whose Tuning had `fwd_maxnreg` / `bwd_maxnreg` (passed as the launches'
`maxnreg`); every cap spilled, and both fields were removed again. Prints and appends JSON
lines to $OUT/probe-round9.jsonl."""
import dataclasses, json, os, sys, time
import torch
sys.path.insert(0, "bench")
from bench_msa_layer import BK, TOPK, make_inputs, timed  # noqa
from msa_model.ops import msa_attention, sparse_attention, select_blocks
from msa_model.ops.sparse_attention import triton as sat
OUT = os.environ.get("OUT", ".")
T = int(os.environ.get("T", 131072))
def log(r):
    print(json.dumps(r), flush=True)
    with open(os.path.join(OUT, "probe-round9.jsonl"), "a") as f:
        f.write(json.dumps(r) + "\n")
q, k, v, iq, ik = make_inputs(T); leaves = [q, k, v, iq, ik]; do = torch.randn_like(q)
with torch.no_grad():
    bi = select_blocks(iq, ik, BK, TOPK, backend="triton")
def clear():
    for x in leaves: x.grad = None
def fwd(tun):
    with torch.no_grad():
        return sparse_attention(q, k, v, bi, BK, backend="triton", check_ids=False, tuning=tun)[0]
def fb(tun):
    o, _ = sparse_attention(q, k, v, bi, BK, backend="triton", check_ids=False, tuning=tun)
    o.backward(do)
    g = (q.grad, k.grad, v.grad); clear(); return g
base = sat.Tuning()
def rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())
o0 = fwd(base); g0 = fb(base)
FWD = {"f_base": {}, "f_r128": dict(fwd_maxnreg=128),
       "f_128x8_r128": dict(fwd_rows=128, fwd_warps=8, fwd_maxnreg=128),
       "f_128x8_r96": dict(fwd_rows=128, fwd_warps=8, fwd_maxnreg=96),
       "f_128x8_r128_t8": dict(fwd_rows=128, fwd_warps=8, fwd_maxnreg=128, fwd_tiles=8),
       "f_256x16_r128_t8": dict(fwd_rows=256, fwd_warps=16, fwd_maxnreg=128, fwd_tiles=8),
       "f_128x8_r128_s2": dict(fwd_rows=128, fwd_warps=8, fwd_maxnreg=128, fwd_stages=2)}
BWD = {"b_base": {}, "b_r200": dict(bwd_maxnreg=200),
       "b_64x16_r128": dict(bwd_warps=16, bwd_maxnreg=128),
       "b_64x16_r128_t64": dict(bwd_warps=16, bwd_maxnreg=128, bwd_tiles=64),
       "b_128x16_r128_t64": dict(bwd_rows=128, bwd_warps=16, bwd_maxnreg=128, bwd_tiles=64)}
res = {}
for name, over in FWD.items():
    tun = dataclasses.replace(base, **over); t0 = time.time()
    try:
        o = fwd(tun)
        r = dict(name=name, fwd_ms=timed(lambda: fwd(tun), 5), err_o=rel(o, o0),
                 regs=(sat.COMPILED["fwd"].n_regs, sat.COMPILED["fwd"].n_spills), wall=time.time() - t0)
    except Exception as e:  # noqa
        r = dict(name=name, error=repr(e)[:300])
    res[name] = r; log(r)
for name, over in BWD.items():
    tun = dataclasses.replace(base, **over); t0 = time.time()
    try:
        g = fb(tun)
        r = dict(name=name, fwdbwd_ms=timed(lambda: fb(tun), 5), err=[rel(a, b) for a, b in zip(g, g0)],
                 regs=(sat.COMPILED["bwd"].n_regs, sat.COMPILED["bwd"].n_spills), wall=time.time() - t0)
    except Exception as e:  # noqa
        r = dict(name=name, error=repr(e)[:300])
    res[name] = r; log(r)
bf = min((n for n in FWD if "fwd_ms" in res[n]), key=lambda n: res[n]["fwd_ms"])
bb = min((n for n in BWD if "fwdbwd_ms" in res[n]), key=lambda n: res[n]["fwdbwd_ms"])
best = dataclasses.replace(base, **FWD[bf], **BWD[bb])
log(dict(best_fwd=bf, best_bwd=bb))
def layer_fb(tun, prec):
    o, kl_ = msa_attention(q, k, v, iq, ik, BK, TOPK, backend="triton", kl_teacher="backward", index_precision=prec,
                           tuning={"sparse_attention": tun})
    torch.autograd.backward([o, kl_], [do, torch.ones_like(kl_)]); clear()
def layer_f(tun, prec):
    with torch.no_grad():
        msa_attention(q, k, v, iq, ik, BK, TOPK, backend="triton", index_precision=prec, tuning={"sparse_attention": tun})
for rep in range(2):
    for tname, tun in (("base", base), ("best", best)):
        r = dict(rep=rep, tuning=tname)
        for prec in ("input", "fp8"):
            r[f"layer_fwdbwd_{prec}"] = timed(lambda: layer_fb(tun, prec), 5)
            r[f"layer_fwd_{prec}"] = timed(lambda: layer_f(tun, prec), 5)
        r["bwd_regs"] = (sat.COMPILED["bwd"].n_regs, sat.COMPILED["bwd"].n_spills)
        log(r)
