"""Round 7 probe: the KL teacher from the attention's backward. Correctness at 8K, registers of
the backward kernel, 128K timings (forward vs backward teacher, bf16/fp8 scores), a profile.
Ran three times (calls 1, 2 and 5 of round 7; probe-round7.json is call 5's, with the teacher rows
taken before dV from their own fp16 copy and a zeroed row buffer). PYTHONPATH=. python <this file> [seconds]
"""
import dataclasses, json, sys, time
import torch
sys.path.insert(0, "bench")
from bench_msa_layer import BK, TOPK, make_inputs, timed, sdpa  # noqa
from msa_model.ops import msa_attention, sparse_attention, select_blocks, indexer_kl_loss
from msa_model.ops.sparse_attention import triton as sat

T0 = time.time(); OUT = {}
LIMIT = float(sys.argv[1]) if len(sys.argv) > 1 else 400
def say(*a): print(f"[{time.time()-T0:5.0f}s]", *a, flush=True)
def rel(a, b): return ((a.double()-b.double()).norm()/b.double().norm().clamp_min(1e-30)).item()
def clear(xs):
    for x in xs: x.grad = None

def correctness():
    for T in (8192,):
        q, k, v, iq, ik = make_inputs(T)
        leaves = [q, k, v, iq, ik]
        do = torch.randn_like(q)
        res = {}
        for teacher in ("forward", "backward"):
            o, kl = msa_attention(q, k, v, iq, ik, BK, TOPK, backend="triton", kl_teacher=teacher)
            before = kl.item()
            g = torch.autograd.grad([o, kl], leaves, [do, torch.ones_like(kl)])
            res[teacher] = (before, kl.item(), g)
        f, b = res["forward"], res["backward"]
        r = dict(kl_forward=f[1], kl_backward_before=b[0], kl_backward=b[1],
                 **{n: rel(x, y) for n, x, y in zip("dq dk dv diq dik".split(), b[2], f[2])})
        r["bwd_regs"] = getattr(sat.COMPILED["bwd"], "n_regs", None); r["bwd_spills"] = getattr(sat.COMPILED["bwd"], "n_spills", None)
        OUT[f"check_{T}"] = r; say("check", T, r)

def timings():
    T = 131072
    q, k, v, iq, ik = make_inputs(T)
    leaves = [q, k, v, iq, ik]
    do = torch.randn_like(q)
    r = {}
    for prec in ("input", "fp8"):
        for teacher in ("forward", "backward"):
            def fwd(): return msa_attention(q, k, v, iq, ik, BK, TOPK, backend="triton", kl_teacher=teacher, index_precision=prec)
            def fb():
                o, kl = fwd(); torch.autograd.backward([o, kl], [do, torch.ones_like(kl)]); clear(leaves)
            r[f"fwd_{prec}_{teacher}"] = timed(fwd, 5)
            r[f"fwdbwd_{prec}_{teacher}"] = timed(fb, 5)
            torch.cuda.reset_peak_memory_stats(); fb(); torch.cuda.synchronize()
            r[f"peak_{prec}_{teacher}"] = torch.cuda.max_memory_allocated() / 2**30
            say(prec, teacher, {k_: v_ for k_, v_ in r.items() if prec in k_ and teacher in k_})
    # the attention backward alone, with and without teacher rows
    bi = select_blocks(iq.detach(), ik.detach(), BK, TOPK, backend="triton")
    with torch.no_grad():
        o, lse = sparse_attention(q, k, v, bi, BK, backend="triton", check_ids=False)
    idx = bi.to(torch.int32).contiguous()
    B, T_, G, K = idx.shape
    qq, kk, vv = q.detach(), k.detach(), v.detach()
    def bw(teach):
        t = None
        if teach:
            t = torch.zeros(B*T_*G*K, BK, dtype=torch.float16, device="cuda")
        return sat.sparse_backward(do, qq, kk, vv, o, lse, idx, BK, 128 ** -0.5, teacher=t)
    r["attn_bwd_ms"] = timed(lambda: bw(False), 5)
    r["attn_bwd_teacher_ms"] = timed(lambda: bw(True), 5)
    r["bwd_regs_teacher"] = sat.COMPILED["bwd"].n_regs; r["bwd_spills_teacher"] = sat.COMPILED["bwd"].n_spills
    bw(False); r["bwd_regs"] = sat.COMPILED["bwd"].n_regs; r["bwd_spills"] = sat.COMPILED["bwd"].n_spills
    say("attn bwd", r["attn_bwd_ms"], r["attn_bwd_teacher_ms"], r["bwd_regs"], r["bwd_regs_teacher"], r["bwd_spills_teacher"])
    r["sdpa_fwd_ms"] = timed(lambda: sdpa(q, k, v), 3)
    def sfb():
        sdpa(q, k, v).backward(do); clear(leaves)
    r["sdpa_fwdbwd_ms"] = timed(sfb, 3)
    say("sdpa", r["sdpa_fwd_ms"], r["sdpa_fwdbwd_ms"])
    OUT["t128k"] = r
    # profile of the late step
    from torch.profiler import profile, ProfilerActivity
    def fb():
        o, kl = msa_attention(q, k, v, iq, ik, BK, TOPK, backend="triton", kl_teacher="backward")
        torch.autograd.backward([o, kl], [do, torch.ones_like(kl)]); clear(leaves)
    fb(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fb(); torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        rows.append((e.key[:60], round(e.device_time_total / 1000, 2)))
    rows.sort(key=lambda x: -x[1])
    OUT["profile_late_128k"] = rows[:16]; say("profile", rows[:16])

for name, fn in (("correctness", correctness), ("timings", timings)):
    if time.time() - T0 > LIMIT: say("skip", name); continue
    try: fn()
    except Exception as e:
        import traceback; traceback.print_exc(); say("FAILED", name, e)
    torch.cuda.empty_cache()
import os
os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
json.dump(OUT, open(os.path.join(os.environ.get("OUT", "/tmp"), "round7.json"), "w"), indent=1, default=str)
