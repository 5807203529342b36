"""Round 8 probe: one inverse index for attention and KL, d iq per entry (late_partials), late
teacher in query chunks beyond teacher_bytes. Writes $OUT/probe-round8.json.
Ran (call 1) with a `late_partials` switch on by default (since removed; PART below set it) and the chunked late path as one
autograd node per chunk (since one node for all chunks); the 128K rows do not chunk.
Run from the repository root: PYTHONPATH=. OUT=<dir> python bench/results/chunked-late-2026-12-01/probe_round8.py
"""
import dataclasses, json, os, sys, time
import torch
sys.path.insert(0, "bench")
from bench_msa_layer import BK, TOPK, make_inputs, timed, peak_gib  # noqa
from msa_model.ops import msa_attention, select_blocks
from msa_model.ops.sparse_attention import triton as sat
from msa_model.ops.indexer_kl import triton as klt
from msa_model.ops import inverse_index as ii
T0 = time.time(); OUT = {}
def say(*a): print(f"[{time.time()-T0:5.0f}s]", *a, flush=True)
def rel(a, b): return ((a.double()-b.double()).norm()/b.double().norm().clamp_min(1e-30)).item()
def clear(xs):
    for x in xs: x.grad = None
def dump():
    json.dump(OUT, open(os.path.join(os.environ.get("OUT", "."), "probe-round8.json"), "w"), indent=1)
NOATOM = {"indexer_kl": dataclasses.replace(klt.DEFAULT_TUNING, late_partials=False)}
PART = {"indexer_kl": dataclasses.replace(klt.DEFAULT_TUNING, late_partials=True)}  # the default when it ran
# correctness at 8K: late (partials / atomics) against the forward teacher
q, k, v, iq, ik = make_inputs(8192); leaves = [q, k, v, iq, ik]; do = torch.randn_like(q)
def grads(teacher, tun=None):
    o, kl = msa_attention(q, k, v, iq, ik, BK, TOPK, backend="triton", kl_teacher=teacher, tuning=tun)
    g = torch.autograd.grad([o, kl], leaves, [do, torch.ones_like(kl)]); return kl.item(), g
kf, gf = grads("forward")
for name, tun in (("partials", PART), ("atomics", NOATOM)):
    kb, gb = grads("backward", tun)
    OUT[f"check_{name}"] = dict(kl_f=kf, kl_b=kb, **{n: rel(x, y) for n, x, y in zip("dq dk dv diq dik".split(), gb, gf)})
    say(OUT[f"check_{name}"])
# determinism of d iq with partials: two runs bit-identical
g1 = grads("backward", PART)[1][3]; g2 = grads("backward", PART)[1][3]
OUT["diq_deterministic_partials"] = bool(torch.equal(g1, g2))
g1 = grads("backward", NOATOM)[1][3]; g2 = grads("backward", NOATOM)[1][3]
OUT["diq_deterministic_atomics"] = bool(torch.equal(g1, g2))
say("deterministic", OUT["diq_deterministic_partials"], OUT["diq_deterministic_atomics"])
del q, k, v, iq, ik, leaves, do, g1, g2, gf; torch.cuda.empty_cache(); dump()

T = 131072
q, k, v, iq, ik = make_inputs(T); leaves = [q, k, v, iq, ik]; do = torch.randn_like(q)
def fb(teacher, prec="input", tun=None):
    o, kl_ = msa_attention(q, k, v, iq, ik, BK, TOPK, backend="triton", kl_teacher=teacher, index_precision=prec,
                           tuning=tun)
    torch.autograd.backward([o, kl_], [do, torch.ones_like(kl_)]); clear(leaves)
r = {}
for rep in range(2):
    r[f"late_{rep}"] = timed(lambda: fb("backward", tun=PART), 5)
    r[f"late_atomics_{rep}"] = timed(lambda: fb("backward", tun=NOATOM), 5)
    r[f"late_fp8_{rep}"] = timed(lambda: fb("backward", "fp8", PART), 5)
    r[f"forward_{rep}"] = timed(lambda: fb("forward"), 3)
    say(r)
# the index builds: the attention's chunked one (which the KL now also walks) and the KL's own
with torch.no_grad():
    bi = select_blocks(iq, ik, BK, TOPK, backend="triton")
    idx = ii.clean_block_idx(bi, BK)
    N = T // BK
    chunked = sat.sparse_index(idx, 16, 128, 2, N, sat.DEFAULT_TUNING)
    r["n_chunks"] = chunked.n_chunks
    r["build_chunked_ms"] = timed(lambda: sat.sparse_index(idx, 16, 128, 2, N, sat.DEFAULT_TUNING), 10)
    r["build_kl_own_ms"] = timed(lambda: klt.inverse_index(bi, BK), 10)
    r["clean_ms"] = timed(lambda: ii.clean_block_idx(bi, BK), 10)
OUT["t131072"] = r; say(r); dump()
# kernel profile of one late step
from torch.profiler import profile, ProfilerActivity
fb("backward", tun=PART); torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    fb("backward", tun=PART); torch.cuda.synchronize()
rows = []
for e in prof.key_averages():
    if e.device_time_total > 0:
        rows.append((e.key[:90], round(e.device_time_total / 1000, 2), e.count))
rows.sort(key=lambda x: -x[1])
OUT["profile_late_128k"] = rows[:25]; OUT["profile_total_ms"] = round(sum(x[1] for x in rows), 1)
for x in rows[:25]: print(x)
del q, k, v, iq, ik, leaves, do, bi, idx, chunked; torch.cuda.empty_cache(); dump()

T = 524288
q, k, v, iq, ik = make_inputs(T); leaves = [q, k, v, iq, ik]; do = torch.randn_like(q)
r = {}
r["late_chunked"] = timed(lambda: fb("backward"), 2)
r["late_chunked_peak_gib"] = peak_gib(lambda: fb("backward"))
r["forward"] = timed(lambda: fb("forward"), 2)
r["forward_peak_gib"] = peak_gib(lambda: fb("forward"))
r["late_chunked_fp8"] = timed(lambda: fb("backward", "fp8"), 2)
OUT["t524288"] = r; say(r); dump()
