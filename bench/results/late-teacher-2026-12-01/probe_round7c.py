"""Round 7 probe 2: where to take the teacher rows in the attention backward (TEACHER_AT 1 end,
2 after dV from the bf16 operand, 3 before dV), the KL backward with and without the value.
Ran with a temporary switch sat.TEACHER_AT (1: rows at the tile's end, 2: after dV from P's bf16
copy, 3: before dV from an fp16 copy), since removed; wrote probe-round7c.json.
"""
import dataclasses, json, os, sys, time
import torch
sys.path.insert(0, "bench")
from bench_msa_layer import BK, TOPK, make_inputs, timed  # noqa
from msa_model.ops import msa_attention, sparse_attention, select_blocks
from msa_model.ops.sparse_attention import triton as sat
from msa_model.ops.indexer_kl import triton as klt
T0 = time.time(); OUT = {}
def say(*a): print(f"[{time.time()-T0:5.0f}s]", *a, flush=True)
def clear(xs):
    for x in xs: x.grad = None
T = 131072
q, k, v, iq, ik = make_inputs(T); leaves = [q, k, v, iq, ik]; do = torch.randn_like(q)
bi = select_blocks(iq.detach(), ik.detach(), BK, TOPK, backend="triton")
with torch.no_grad():
    o, lse = sparse_attention(q, k, v, bi, BK, backend="triton", check_ids=False)
idx = bi.to(torch.int32).contiguous(); B, T_, G, K = idx.shape
qq, kk, vv = q.detach(), k.detach(), v.detach()
pbar = torch.zeros(B*T_*G*K, BK, dtype=torch.float16, device="cuda")
def bw(teach, tuning=sat.DEFAULT_TUNING):
    return sat.sparse_backward(do, qq, kk, vv, o, lse, idx, BK, 128 ** -0.5, teacher=pbar if teach else None, tuning=tuning)
r = {}
r["none"] = timed(lambda: bw(False), 5); r["none_regs"] = (sat.COMPILED["bwd"].n_regs, sat.COMPILED["bwd"].n_spills)
for at in (1, 2, 3):
    sat.TEACHER_AT[0] = at
    r[f"at{at}"] = timed(lambda: bw(True), 5); r[f"at{at}_regs"] = (sat.COMPILED["bwd"].n_regs, sat.COMPILED["bwd"].n_spills)
    for rows, warps in ((32, 4), (32, 8), (128, 8)):
        tun = dataclasses.replace(sat.DEFAULT_TUNING, bwd_rows=rows, bwd_warps=warps)
        key = f"at{at}_rows{rows}w{warps}"
        try:
            r[key] = timed(lambda: bw(True, tun), 3); r[key + "_regs"] = (sat.COMPILED["bwd"].n_regs, sat.COMPILED["bwd"].n_spills)
        except Exception as e:
            r[key] = str(e)[:100]
    say(at, {k_: v_ for k_, v_ in r.items() if k_.startswith(f"at{at}")})
for rows, warps in ((32, 4), (32, 8)):
    tun = dataclasses.replace(sat.DEFAULT_TUNING, bwd_rows=rows, bwd_warps=warps)
    r[f"none_rows{rows}w{warps}"] = timed(lambda: bw(False, tun), 3)
say("none", r["none"], r["none_regs"], r.get("none_rows32w4"), r.get("none_rows32w8"))
OUT["attn_bwd_128k"] = r
# KL backward on the teacher rows: with the value (late path) and without
sat.TEACHER_AT[0] = 2
bw(True)
cfg = klt.DEFAULT_TUNING
index = klt.inverse_index(idx, BK)
lse_z = klt.student_lse(iq.detach(), ik.detach(), index, K, BK, 128 ** -0.5, cfg)
r2 = {}
r2["student_lse"] = timed(lambda: klt.student_lse(iq.detach(), ik.detach(), index, K, BK, 128 ** -0.5, cfg), 5)
r2["teacher_backward"] = timed(lambda: klt.teacher_backward(iq.detach(), ik.detach(), pbar, lse_z, index, K, BK, 128 ** -0.5, cfg), 5)
inv_s = torch.ones(B, T_, G, device="cuda")
r2["stored_backward_novalue"] = timed(lambda: klt._stored_backward(iq.detach(), ik.detach(), pbar, lse_z, inv_s, index, K, BK, 128 ** -0.5, cfg, 0), 5)
for sm, sw in ((64, 8), (32, 4), (128, 8)):
    c2 = dataclasses.replace(cfg, stored_M=sm, stored_warps=sw)
    r2[f"teacher_backward_M{sm}w{sw}"] = timed(lambda: klt.teacher_backward(iq.detach(), ik.detach(), pbar, lse_z, index, K, BK, 128 ** -0.5, c2), 3)
say("kl", r2); OUT["kl_128k"] = r2
# the layer, each placement
r3 = {}
for at in (1, 2, 3):
    sat.TEACHER_AT[0] = at
    def fb():
        o_, kl = msa_attention(q, k, v, iq, ik, BK, TOPK, backend="triton", kl_teacher="backward")
        torch.autograd.backward([o_, kl], [do, torch.ones_like(kl)]); clear(leaves)
    r3[f"late_at{at}"] = timed(fb, 5)
def fbf():
    o_, kl = msa_attention(q, k, v, iq, ik, BK, TOPK, backend="triton", kl_teacher="forward")
    torch.autograd.backward([o_, kl], [do, torch.ones_like(kl)]); clear(leaves)
r3["forward"] = timed(fbf, 5)
say("layer", r3); OUT["layer_128k"] = r3
json.dump(OUT, open(os.path.join(os.environ.get("OUT", "/tmp"), "round7c.json"), "w"), indent=1, default=str)
