"""The first probe of round 6 (bench/RESULTS.md): fp8 scores through the select kernel, the KL
forward launch shapes at 128K, a profile of one 128K layer step, long selections. Wrote
probe-round6.json. PYTHONPATH=. python bench/results/index-precision-2026-12-01/probe_round6.py [seconds]
(run before fp8.py existed: fp8 inputs were quantized here, iq per row and ik per tensor)."""
import dataclasses
import json
import sys
import time

import torch

sys.path.insert(0, "bench")
from bench_msa_layer import BK, TOPK, make_inputs, timed  # noqa: E402

from msa_model.ops import indexer_kl_loss, msa_attention, sparse_attention  # noqa: E402
from msa_model.ops.indexer_kl import triton as klt  # noqa: E402
from msa_model.ops.select_blocks.triton import Tuning as ST  # noqa: E402
from msa_model.ops.select_blocks.triton import score_only_triton, select_blocks_triton  # noqa: E402
from msa_model.ops.sparse_attention import triton as sat  # noqa: E402

T0 = time.time()
OUT = {}
LIMIT = float(sys.argv[1]) if len(sys.argv) > 1 else 520


def say(*a):
    print(f"[{time.time() - T0:5.0f}s]", *a, flush=True)


def q8(iq, ik):
    s = iq.float().abs().amax(-1, keepdim=True).clamp_min(1e-12) / 448
    sk = ik.float().abs().amax().clamp_min(1e-12) / 448
    return (iq.float() / s).to(torch.float8_e4m3fn), (ik.float() / sk).to(torch.float8_e4m3fn)


def agree(a, b):
    A, B = a.long(), b.long()
    hit = ((A[..., :, None] == B[..., None, :]) & (A[..., :, None] >= 0)).any(-1).sum().item()
    return hit / max(1, (A >= 0).sum().item())


def step(name, fn):
    if time.time() - T0 > LIMIT:
        say("skip", name)
        return
    try:
        fn()
    except Exception as e:
        say("FAILED", name, type(e).__name__, str(e)[:600])
    torch.cuda.empty_cache()


def select_fp8():
    for T in (32768, 131072):
        _, _, _, iq, ik = make_inputs(T, grad=False)
        iq8, ik8 = q8(iq, ik)
        b16 = select_blocks_triton(iq, ik, BK, TOPK)
        b8 = select_blocks_triton(iq8, ik8, BK, TOPK)
        ms16 = timed(lambda: select_blocks_triton(iq, ik, BK, TOPK), 5)
        ms8 = timed(lambda: select_blocks_triton(iq8, ik8, BK, TOPK), 5)
        so16 = timed(lambda: score_only_triton(iq, ik, BK), 5)
        so8 = timed(lambda: score_only_triton(iq8, ik8, BK), 5)
        qt = timed(lambda: q8(iq, ik), 5)
        OUT[f"select_{T}"] = dict(bf16=ms16, fp8=ms8, score_bf16=so16, score_fp8=so8, quant=qt, agree=agree(b16, b8))
        say("select", T, OUT[f"select_{T}"])


def select_long():
    for T in (524288, 1048576):
        _, _, _, iq, ik = make_inputs(T, grad=False)
        iq8, ik8 = q8(iq, ik)
        r = {}
        r["bf16"] = timed(lambda: select_blocks_triton(iq, ik, BK, TOPK), 2)
        r["fp8"] = timed(lambda: select_blocks_triton(iq8, ik8, BK, TOPK), 2)
        if T == 524288:
            for tun in (ST(128, 128, 4, 3), ST(128, 128, 8, 3), ST(256, 128, 8, 2), ST(64, 128, 4, 2)):
                key = f"{tun.rows}x{tun.cols}w{tun.num_warps}s{tun.num_stages}"
                r["bf16_" + key] = timed(lambda: select_blocks_triton(iq, ik, BK, TOPK, tuning=tun), 2)
                r["fp8_" + key] = timed(lambda: select_blocks_triton(iq8, ik8, BK, TOPK, tuning=tun), 2)
        OUT[f"select_{T}"] = r
        say("select", T, r)


def kl_sweep():
    T = 131072
    q, k, v, iq, ik = make_inputs(T)
    bi = select_blocks_triton(iq.detach(), ik.detach(), BK, TOPK)
    with torch.no_grad():
        _, lse = sparse_attention(q, k, v, bi, BK, backend="triton", check_ids=False)
    variants = [dict(), dict(warps=4), dict(warps=4, rows=64), dict(M=8), dict(M=8, warps=4), dict(fwd_stages=3),
                dict(fwd_stages=1), dict(fwd_per_program=1024), dict(M=32, rows=256)]
    r = {}
    for var in variants:
        if time.time() - T0 > LIMIT:
            break
        cfg = dataclasses.replace(klt.DEFAULT_TUNING, **var)

        def f():
            return indexer_kl_loss(q.detach(), k.detach(), iq, ik, bi, lse, BK, backend="triton", tuning=cfg,
                                   check_ids=False)
        try:
            r[json.dumps(var)] = timed(f, 3)
        except Exception as e:
            r[json.dumps(var)] = f"{type(e).__name__}: {str(e)[:200]}"
        say("kl fwd", var, r[json.dumps(var)])
    OUT["kl_fwd_128k"] = r


def layer_1m():
    T = 1048576
    q, k, v, iq, ik = make_inputs(T, grad=False)
    r = {}
    with torch.no_grad():
        r["layer_fwd"] = timed(lambda: msa_attention(q, k, v, iq, ik, BK, TOPK, backend="triton"), 2)
        r["layer_fwd_gather_only"] = timed(lambda: msa_attention(
            q, k, v, iq, ik, BK, TOPK, backend="triton", tuning={"sparse_attention": sat.Tuning(tile_rows=0)}), 2)
    OUT["layer_1m"] = r
    say("layer 1M", r)


def profile_128k():
    T = 131072
    q, k, v, iq, ik = make_inputs(T)
    do = torch.randn_like(q)

    def fb():
        o, kl = msa_attention(q, k, v, iq, ik, BK, TOPK, backend="triton")
        torch.autograd.backward([o, kl], [do, torch.ones_like(kl)])
        for x in (q, k, v, iq, ik):
            x.grad = None
    fb()
    OUT["layer_128k_fwdbwd"] = timed(fb, 3)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fb()
        torch.cuda.synchronize()
    tab = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    print(tab)
    OUT["profile_128k"] = tab


step("select_fp8", select_fp8)
step("kl_sweep", kl_sweep)
step("profile_128k", profile_128k)
step("select_long", select_long)
step("layer_1m", layer_1m)
import os  # noqa: E402

with open(os.path.join(os.environ.get("OUT", "."), "probe1.json"), "w") as fh:
    json.dump(OUT, fh, indent=1)
say("done")
