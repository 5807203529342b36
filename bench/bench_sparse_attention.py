"""Benchmark and large-shape check of sparse_attention (Triton) against SDPA dense and FlexAttention.

Geometry of the MSA default: Hq=64, Hkv=4, D=128, block 128, top-16, B=1, bf16.
Block sets: "random" (16 random causal blocks per (token, group), local block included) and
"realistic" (local, previous, first block and 13 long-range stripes fixed per group).

    PYTHONPATH=. python bench/bench_sparse_attention.py --parts check,time,profile
    --parts: check (errors vs the PyTorch reference), time (the table), profile (kernel split),
    tune (launch-shape variants at one length). Logs go to $OUT when set.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from msa_model.ops.sparse_attention import sparse_attention
from msa_model.ops.sparse_attention import shared as sa_shared
from msa_model.ops.sparse_attention import tiles as sa_tiles
from msa_model.ops.sparse_attention import triton as sa_triton
from msa_model.ops.sparse_attention.inverse_index import clean_block_idx
from msa_model.ops.sparse_attention.reference import sparse_attention_reference

HQ, HKV, D, BS, TOPK = 64, 4, 128, 128, 16
OUT = os.environ.get("OUT")
LOG = []
# the kernels' launch shapes every timing passes explicitly (--tuning and `tune` set them)
TUNING = {"sparse_attention": sa_triton.DEFAULT_TUNING}


def log(*a):
    line = " ".join(str(x) for x in a)
    print(line, flush=True)
    LOG.append(line)


def random_sets(T, G, K, bs, device, seed=0):
    """int32 [1, T, G, K]: the local block plus K-1 distinct random earlier blocks (fewer when fewer exist)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    n = math.ceil(T / bs)
    out = torch.empty(1, T, G, K, dtype=torch.int32, device=device)
    blocks = torch.arange(n, device=device)
    step = max(1, (1 << 27) // (G * n))
    for t0 in range(0, T, step):
        t = torch.arange(t0, min(T, t0 + step), device=device)
        local = (t // bs)[:, None, None]
        score = torch.rand(t.numel(), G, n, device=device, generator=gen)
        score = torch.where(blocks > local, -1.0, score)
        score = torch.where(blocks == local, 2.0, score)
        val, idx = score.topk(min(K, n), dim=-1)
        idx = torch.where(val < 0, -1, idx)
        if n < K:
            idx = torch.cat([idx, idx.new_full((*idx.shape[:2], K - n), -1)], -1)
        out[0, t0:t0 + t.numel()] = idx.to(torch.int32)
    return out


def realistic_sets(T, G, K, bs, device):
    """int32 [1, T, G, K]: local, previous and first block, and K-3 stripes fixed per group."""
    n = math.ceil(T / bs)
    local = (torch.arange(T, device=device) // bs)[:, None, None]
    s = torch.arange(K - 3, device=device)[None, :]
    g = torch.arange(G, device=device)[:, None]
    stripes = ((s + 0.5 + 0.25 * g / G) * n / (K - 3)).long().clamp(max=n - 1)  # [G, K-3]
    idx = torch.cat([local.expand(T, G, 1), (local - 1).expand(T, G, 1),
                     torch.zeros(T, G, 1, dtype=torch.long, device=device),
                     stripes[None].expand(T, G, K - 3)], -1)
    idx = torch.where((idx >= 0) & (idx <= local), idx, -1)
    return idx[None].to(torch.int32)


def timeit(fn, budget_ms=400.0, max_iters=50):
    """Median ms of fn over CUDA events around each of back-to-back calls, after warm-up; fewer
    iterations for slow functions."""
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    est = (time.perf_counter() - t) * 1e3
    iters = int(max(2, min(max_iters, budget_ms / max(est, 1e-3))))
    # back to back, as in a training step: the host issues the next call while the device runs
    # this one, so launch overhead shows only where the host is slower than the device
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for a, b in events:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in events)


def inputs(T, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, T, HQ, D, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(1, T, HKV, D, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(1, T, HKV, D, device="cuda", dtype=dtype, generator=g)
    do = torch.randn(1, T, HQ, D, device="cuda", dtype=dtype, generator=g)
    return q, k, v, do


def fwd_bwd(fn, q, k, v, do):
    qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))

    def run():
        qq.grad = kk.grad = vv.grad = None
        o = fn(qq, kk, vv)
        o.backward(do)
    return run


def ours(idx, bs=BS, check_ids=False):
    """The Triton op. The benchmark's sets are in range, so by default without the id range check
    (a host synchronisation that msa_attention skips for select_blocks' ids); the table also times
    the forward with it."""
    return lambda q, k, v: sparse_attention(q, k, v, idx, block_size=bs, backend="triton", check_ids=check_ids,
                                            tuning=TUNING["sparse_attention"])[0]


def sdpa(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, enable_gqa=True)
    return o.transpose(1, 2)


_FLEX = {}


def flex(block_sets, T):
    """FlexAttention with one block set per 128-query block and group, broadcast to its heads; the
    diagonal block is masked causally, the others are full blocks."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
    if "fn" not in _FLEX:
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    n = math.ceil(T / BS)
    m = torch.arange(n, device="cuda")
    sel = torch.zeros(1, HKV, n, n + 1, dtype=torch.bool, device="cuda")
    sel.scatter_(-1, torch.where(block_sets < 0, n, block_sets.long()), True)  # block_sets [1, G, n, K']
    sel = sel[..., :n]
    sel[:, :, m, m] = False
    full_num = sel.sum(-1).to(torch.int32)
    full_idx = torch.sort(sel.to(torch.int8), dim=-1, descending=True, stable=True)[1].to(torch.int32)
    part_num = torch.ones(1, HKV, n, dtype=torch.int32, device="cuda")
    part_idx = torch.zeros(1, HKV, n, n, dtype=torch.int32, device="cuda")
    part_idx[..., 0] = m.to(torch.int32)
    H = HQ // HKV
    rep = lambda x: x.repeat_interleave(H, dim=1)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx
    mask = BlockMask.from_kv_blocks(rep(part_num), rep(part_idx), rep(full_num), rep(full_idx),
                                    BLOCK_SIZE=BS, mask_mod=causal, seq_lengths=(T, T))

    def run(q, k, v):
        o = _FLEX["fn"](q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=mask, enable_gqa=True)
        return o.transpose(1, 2)
    return run


def flex_sets(idx, pattern):
    """Per query block: the union of its tokens' sets (realistic), or for random sets, whose union
    is nearly dense, the set of the block's last token (the same FLOPs as ours, block granularity)."""
    T = idx.shape[1]
    n = math.ceil(T / BS)
    pad = n * BS - T
    x = torch.cat([idx, idx[:, -1:].expand(1, pad, HKV, TOPK)], 1) if pad else idx
    x = x.view(1, n, BS, HKV, TOPK)
    if pattern == "random":
        return x[:, :, -1].permute(0, 2, 1, 3).contiguous()
    return x.permute(0, 3, 1, 2, 4).reshape(1, HKV, n, BS * TOPK)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def check():
    """Ours (bf16) and torch-in-bf16 against the fp32 reference at the default geometry and others."""
    cases = [(4096, HQ, HKV, D, BS, TOPK, "random"), (4096, HQ, HKV, D, BS, TOPK, "realistic"),
             (4096, HQ, HKV, D, BS, TOPK, "dense"), (3001, 32, 4, 64, 64, 8, "random"),
             (2500, 16, 4, 128, 64, 4, "random"), (2049, 8, 8, 64, 128, 16, "random")]
    worst = 0.0
    for T, hq, hkv, d, bs, kk, pat in cases:
        g = torch.Generator(device="cuda").manual_seed(T)
        q = torch.randn(2, T, hq, d, device="cuda", generator=g).bfloat16()
        k = torch.randn(2, T, hkv, d, device="cuda", generator=g).bfloat16()
        v = torch.randn(2, T, hkv, d, device="cuda", generator=g).bfloat16()
        do = torch.randn(2, T, hq, d, device="cuda", generator=g).bfloat16()
        if pat == "dense":
            idx = None
        else:
            mk = random_sets if pat == "random" else realistic_sets
            idx = torch.cat([mk(T, hkv, kk, bs, "cuda"), mk(T, hkv, kk, bs, "cuda")])

        def grads(fn, dt):
            qq, kk_, vv = (x.detach().to(dt).requires_grad_() for x in (q, k, v))
            o, lse = fn(qq, kk_, vv)
            return (o, lse, *torch.autograd.grad(o, (qq, kk_, vv), do.to(dt)))
        sc = d ** -0.5
        ref = grads(lambda a, b, c: sparse_attention_reference(a, b, c, idx, bs, sc), torch.float32)
        base = grads(lambda a, b, c: sparse_attention_reference(a, b, c, idx, bs, sc, upcast=False), torch.bfloat16)
        # poison: a fresh NaN-filled caching allocator pool would be ideal; check no NaN instead
        out = grads(lambda a, b, c: sparse_attention(a, b, c, idx, block_size=bs, backend="triton"), torch.bfloat16)
        msg = []
        for name, x, bb, r in zip(("o", "lse", "dq", "dk", "dv"), out, base, ref):
            assert not torch.isnan(x).any(), f"NaN in {name}"
            if name == "lse":
                e, et = (x - r).abs().max().item(), (bb - r).abs().max().item()
            else:
                e, et = rel(x, r), rel(bb, r)
            worst = max(worst, e / max(et, 1e-6))
            msg.append(f"{name} {e:.2e}/{et:.2e}")
        log(f"check T={T} Hq={hq} Hkv={hkv} D={d} bs={bs} k={kk} {pat}: ours/torch-bf16 " + " ".join(msg))
    log(f"check worst ratio err(ours)/err(torch bf16) = {worst:.2f}")
    # determinism: the backward must give identical bits twice
    T = 8192
    q, k, v, do = inputs(T)
    idx = realistic_sets(T, HKV, TOPK, BS, "cuda")
    r1 = torch.autograd.grad(ours(idx)(*(x.requires_grad_() for x in (q, k, v))), (q, k, v), do)
    r2 = torch.autograd.grad(ours(idx)(q, k, v), (q, k, v), do)
    log("check deterministic backward:", all(torch.equal(a, b) for a, b in zip(r1, r2)))


def flops_fwd(T):
    return 4.0 * T * HQ * TOPK * BS * D


def time_table(Ts, fwd_only_Ts, sdpa_max, with_flex, patterns):
    rows = []
    sdpa_anchor = {524288: 8775.0}
    for T in Ts + fwd_only_Ts:
        fwd_only = T in fwd_only_Ts
        q, k, v, do = inputs(T)
        r = {"T": T}
        if T <= sdpa_max:
            with torch.no_grad():
                r["sdpa_fwd"] = timeit(lambda: sdpa(q, k, v))
            if not fwd_only:
                r["sdpa_fb"] = timeit(fwd_bwd(sdpa, q, k, v, do))
        elif T in sdpa_anchor:
            r["sdpa_fwd"] = sdpa_anchor[T]
            r["sdpa_anchor"] = True
        with torch.no_grad():
            r["dense_fwd"] = timeit(lambda: ours(None)(q, k, v))
        if not fwd_only and T <= 32768:
            r["dense_fb"] = timeit(fwd_bwd(ours(None), q, k, v, do))
        for pat in patterns:
            idx = random_sets(T, HKV, TOPK, BS, "cuda") if pat == "random" else realistic_sets(T, HKV, TOPK, BS, "cuda")
            with torch.no_grad():
                r[f"{pat}_fwd"] = timeit(lambda: ours(idx)(q, k, v))
                r[f"{pat}_fwd_checked"] = timeit(lambda: ours(idx, check_ids=True)(q, k, v))
            if not fwd_only:
                r[f"{pat}_fb"] = timeit(fwd_bwd(ours(idx), q, k, v, do))
            if with_flex and not fwd_only:
                fx = flex(flex_sets(idx, pat), T)
                with torch.no_grad():
                    r[f"flex_{pat}_fwd"] = timeit(lambda: fx(q, k, v))
                r[f"flex_{pat}_fb"] = timeit(fwd_bwd(fx, q, k, v, do))
            del idx
        rows.append(r)
        log(json.dumps({a: (round(b, 3) if isinstance(b, float) else b) for a, b in r.items()}))
        del q, k, v, do
        torch.cuda.empty_cache()
    return rows


def print_table(rows, patterns):
    log("\n| T | pattern | ours fwd ms | ours fwd+bwd ms | SDPA fwd / fwd+bwd ms | speedup fwd / fwd+bwd vs SDPA "
        "| Flex fwd / fwd+bwd ms | fwd TFLOP/s | fwd+bwd TFLOP/s | fwd ms with the id check |")
    log("|---|---|---|---|---|---|---|---|---|---|")
    f = lambda x: "-" if x is None else f"{x:.2f}"
    for r in rows:
        T = r["T"]
        for pat in patterns:
            fw, fb = r.get(f"{pat}_fwd"), r.get(f"{pat}_fb")
            sf, sb = r.get("sdpa_fwd"), r.get("sdpa_fb")
            sp = f"{sf / fw:.1f}x / " + (f"{sb / fb:.1f}x" if sb and fb else "-") if sf else "-"
            anchor = " (anchor)" if r.get("sdpa_anchor") else ""
            tf = flops_fwd(T) / fw / 1e9 if fw else None
            tfb = 3.5 * flops_fwd(T) / fb / 1e9 if fb else None
            log(f"| {T // 1024}K | {pat} | {f(fw)} | {f(fb)} | {f(sf)}{anchor} / {f(sb)} | {sp} | "
                f"{f(r.get(f'flex_{pat}_fwd'))} / {f(r.get(f'flex_{pat}_fb'))} | {f(tf)} | {f(tfb)} | "
                f"{f(r.get(f'{pat}_fwd_checked'))} |")
        log(f"| {T // 1024}K | dense (ours) | {f(r.get('dense_fwd'))} | {f(r.get('dense_fb'))} | "
            f"{f(r.get('sdpa_fwd'))} / {f(r.get('sdpa_fb'))} | | | | | |")


def profile(T, pat, forward_only=False):
    """Per-kernel device time of one call (torch profiler), against its wall time and the time the
    host takes to issue it: a call whose device time falls short of its wall time waits on the host."""
    q, k, v, do = inputs(T)
    idx = random_sets(T, HKV, TOPK, BS, "cuda") if pat == "random" else realistic_sets(T, HKV, TOPK, BS, "cuda")
    if forward_only:
        def run():
            with torch.no_grad():
                ours(idx)(q, k, v)
    else:
        run = fwd_bwd(ours(idx), q, k, v, do)
    wall = timeit(run)
    torch.cuda.synchronize()
    t = time.perf_counter()
    run()
    issue = (time.perf_counter() - t) * 1e3
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile as prof
    with prof(activities=[ProfilerActivity.CUDA]) as p:
        run()
        torch.cuda.synchronize()
    tot = {}
    for e in p.key_averages():
        if e.device_time_total > 0:
            tot[e.key] = e.device_time_total / 1e3
    what = "fwd" if forward_only else "fwd+bwd"
    log(f"profile T={T} {pat} {what}: wall {wall:.2f} ms, device kernels {sum(tot.values()):.2f} ms, "
        f"host issue {issue:.2f} ms, partial_bytes {TUNING['sparse_attention'].partial_bytes}; ms per kernel (top 12):")
    for name, ms in sorted(tot.items(), key=lambda x: -x[1])[:12]:
        log(f"  {ms:8.2f}  {name[:90]}")
    # where the host's issue time goes: the Python frames and torch calls by their own time
    with prof(activities=[ProfilerActivity.CPU], with_stack=True) as p:
        run()
    torch.cuda.synchronize()
    log("host time of one call by frame (self ms, top 15):")
    for e in sorted(p.key_averages(group_by_stack_n=1), key=lambda e: -e.self_cpu_time_total)[:15]:
        stack = e.stack[0] if e.stack else ""
        log(f"  {e.self_cpu_time_total / 1e3:8.3f}  {e.count:4d}x  {e.key[:50]}  {stack[:70]}")


def _regs(name):
    k = sa_shared.COMPILED.get(name)
    return f"{getattr(k, 'n_regs', '?')} regs / {getattr(k, 'n_spills', '?')} spills"


def tune(T):
    """Launch-shape variants: forward ones timed forward-only at T and 8K, backward ones fwd+bwd at T."""
    idx = random_sets(T, HKV, TOPK, BS, "cuda")
    idx8 = random_sets(8192, HKV, TOPK, BS, "cuda")
    q, k, v, do = inputs(T)
    q8, k8, v8, _ = inputs(8192)
    base = TUNING["sparse_attention"]
    with torch.no_grad():
        log(f"tune SDPA fwd: T={T} {timeit(lambda: sdpa(q, k, v)):.2f} ms, 8K {timeit(lambda: sdpa(q8, k8, v8)):.3f} ms")
    fwd_variants = [{}, {"fwd_stages": 2}, {"fwd_rows": 128, "fwd_warps": 8}, {"fwd_tiles": 32}]
    bwd_variants = [{}, {"bwd_stages": 2}, {"bwd_rows": 32}, {"bwd_tiles": 32}]
    # TUNE_FWD / TUNE_BWD: JSON lists of variants replacing the ones above
    fwd_variants = json.loads(os.environ.get("TUNE_FWD", "null")) or fwd_variants
    bwd_variants = json.loads(os.environ.get("TUNE_BWD", "null")) or bwd_variants
    for kind, variants in (("fwd", fwd_variants), ("bwd", bwd_variants)):
        for var in variants:
            TUNING["sparse_attention"] = dataclasses.replace(base, **var)
            try:
                if kind == "fwd":
                    with torch.no_grad():
                        fw = timeit(lambda: ours(idx)(q, k, v))
                        fw8 = timeit(lambda: ours(idx8)(q8, k8, v8))
                    log(f"tune fwd T={T} {var}: fwd {fw:.2f} ms, 8K fwd {fw8:.3f} ms ({_regs('fwd')})")
                else:
                    fb = timeit(fwd_bwd(ours(idx), q, k, v, do))
                    log(f"tune bwd T={T} {var}: fwd+bwd {fb:.2f} ms ({_regs('bwd')})")
            except Exception as e:  # a variant may not fit in registers or shared memory
                log(f"tune {kind} T={T} {var}: failed {type(e).__name__}: {str(e)[:120]}")
    TUNING["sparse_attention"] = base


def trained_sets(sets_dir, T, layers):
    """Selections a trained model made (bench/selection_coherence.py --save), int32 [1, T, G, K] per
    saved layer; a longer recording is cut to T (the model is causal)."""
    import numpy as np
    path = min((p for p in os.scandir(sets_dir) if p.name.startswith("sets_") and p.name.endswith(".npz")
                and int(p.name[5:-4]) >= T), key=lambda p: int(p.name[5:-4]), default=None)
    if path is None:
        return {}
    sets = np.load(path.path)
    return {f"trained {name}": torch.from_numpy(sets[name][:T].astype(np.int32))[None].cuda()
            for name in sets.files if not layers or int(name[5:]) in layers}


TILE_VARIANTS = [{"tile_rows": 128}, {"tile_rows": 128, "tile_backward": True}]


def _label(var):
    return ",".join(f"{k.replace('tile_', '')}={v}" for k, v in var.items())


def tiles(Ts, patterns, sets_dir, variants, layers, with_flex):
    """The tile-union path (each variant of its tuning) against the gather path (and FlexAttention
    on block-granular sets) on random, realistic and trained selections: the union ratio (distinct
    blocks per tile / K) and fwd, fwd+bwd ms; errors against the reference at 4K."""
    base = TUNING["sparse_attention"]
    # correctness at the default geometry, as `check` does for the gather path
    T = 4096
    q, k, v, do = inputs(T)
    for pat in ("random", "realistic"):
        idx = (random_sets if pat == "random" else realistic_sets)(T, HKV, TOPK, BS, "cuda")

        def grads(fn, dt):
            qq, kk, vv = (x.detach().to(dt).requires_grad_() for x in (q, k, v))
            o, lse = fn(qq, kk, vv)
            return (o, *torch.autograd.grad(o, (qq, kk, vv), do.to(dt)))
        ref = grads(lambda a, b, c: sparse_attention_reference(a, b, c, idx, BS, D ** -0.5), torch.float32)
        torch_bf16 = grads(lambda a, b, c: sparse_attention_reference(a, b, c, idx, BS, D ** -0.5, upcast=False),
                           torch.bfloat16)
        for var in variants:
            tun = dataclasses.replace(base, **var)
            out = grads(lambda a, b, c: sparse_attention(a, b, c, idx, block_size=BS, backend="triton", tuning=tun),
                        torch.bfloat16)
            msg = " ".join(f"{n} {rel(x, r):.2e}/{rel(b, r):.2e}" for n, x, b, r in
                           zip(("o", "dq", "dk", "dv"), out, torch_bf16, ref))
            log(f"tiles check T={T} {pat} {_label(var)}: ours/torch-bf16 {msg}")
    del q, k, v, do
    rows = []
    qts = sorted({sa_tiles.tile_queries(dataclasses.replace(base, **var), HQ // HKV) for var in variants
                  if var.get("tile_rows", base.tile_rows)})
    for T in Ts:
        q, k, v, do = inputs(T)
        sets = {pat: (random_sets if pat == "random" else realistic_sets)(T, HKV, TOPK, BS, "cuda")
                for pat in patterns}
        if sets_dir:
            sets.update(trained_sets(sets_dir, T, layers))
        for name, idx in sets.items():
            clean = clean_block_idx(idx, BS)
            r = {"T": T, "sets": name}
            for qt in qts:
                r[f"union{qt}"] = round(float(sa_tiles.tile_union(clean, qt).count.float().mean()) / TOPK, 3)
            for label, var in [("gather", {"tile_rows": 0})] + [(_label(v), v) for v in variants]:
                TUNING["sparse_attention"] = dataclasses.replace(base, **var)
                try:
                    with torch.no_grad():
                        r[f"{label} fwd"] = timeit(lambda: ours(idx)(q, k, v))
                    r[f"{label} fb"] = timeit(fwd_bwd(ours(idx), q, k, v, do))
                except Exception as e:  # a variant may not fit in registers or shared memory
                    log(f"tiles {label}: failed {type(e).__name__}: {str(e)[:160]}")
                if label != "gather":
                    r[f"{label} regs"] = _regs("tile_fwd")
            TUNING["sparse_attention"] = base
            if with_flex and name in ("random", "realistic"):
                fx = flex(flex_sets(idx, name), T)
                with torch.no_grad():
                    r["flex fwd"] = timeit(lambda: fx(q, k, v))
                r["flex fb"] = timeit(fwd_bwd(fx, q, k, v, do))
            rows.append(r)
            log(json.dumps({a: (round(b, 3) if isinstance(b, float) else b) for a, b in r.items()}))
        del q, k, v, do, sets
        torch.cuda.empty_cache()
    f = lambda x: "-" if x is None else f"{x:.2f}"
    labels = ["gather"] + [_label(v) for v in variants] + ["flex"]
    log("\n| T | sets | " + " | ".join(f"union/K, {qt} queries" for qt in qts) + " | "
        + " | ".join(f"{lb} fwd / fwd+bwd ms" for lb in labels) + " |")
    log("|---|---|" + "---|" * (len(qts) + len(labels)))
    for r in rows:
        log(f"| {r['T'] // 1024}K | {r['sets']} | " + " | ".join(f(r[f'union{qt}']) for qt in qts) + " | "
            + " | ".join(f"{f(r.get(f'{lb} fwd'))} / {f(r.get(f'{lb} fb'))}" for lb in labels) + " |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="check,time")
    ap.add_argument("--T", default="8192,32768,131072")
    ap.add_argument("--fwd-T", default="524288")
    ap.add_argument("--sdpa-max", type=int, default=131072)
    ap.add_argument("--flex", action="store_true")
    ap.add_argument("--patterns", default="random,realistic")
    ap.add_argument("--tune-T", type=int, default=131072)
    ap.add_argument("--profile-T", default="131072")
    ap.add_argument("--profile-fwd", action="store_true", help="profile the forward alone")
    ap.add_argument("--sets", default="", help="tiles: a directory of trained selections (selection_coherence.py)")
    ap.add_argument("--tile-variants", default="", help="tiles: JSON list of Tuning overrides to compare")
    ap.add_argument("--layers", default="", help="tiles: which saved layers' selections to time (default: all)")
    ap.add_argument("--tuning", default="",
                    help="JSON overrides of the kernels' launch shapes (sparse_attention.triton.Tuning)")
    ap.add_argument("--geometry", default="", help="Hq,Hkv,D instead of the MSA default 64,4,128")
    a = ap.parse_args()
    if a.geometry:
        global HQ, HKV, D
        HQ, HKV, D = (int(x) for x in a.geometry.split(","))
    if a.tuning:
        TUNING["sparse_attention"] = dataclasses.replace(sa_triton.DEFAULT_TUNING, **json.loads(a.tuning))
    parts = a.parts.split(",")
    patterns = [p for p in a.patterns.split(",") if p]
    log(f"{torch.cuda.get_device_name()} torch {torch.__version__} {time.strftime('%Y-%m-%d %H:%M')} "
        f"tuning {TUNING['sparse_attention']} argv {' '.join(sys.argv[1:])}")
    t0 = time.time()
    try:
        if "check" in parts:
            check()
            log(f"[check done {time.time() - t0:.0f}s]")
        if "tune" in parts:
            tune(a.tune_T)
            log(f"[tune done {time.time() - t0:.0f}s]")
        if "profile" in parts:
            for T in (int(x) for x in a.profile_T.split(",") if x):
                for pat in patterns:
                    profile(T, pat, forward_only=a.profile_fwd)
            log(f"[profile done {time.time() - t0:.0f}s]")
        if "tiles" in parts:
            tiles([int(x) for x in a.T.split(",") if x], patterns, a.sets,
                  json.loads(a.tile_variants) if a.tile_variants else TILE_VARIANTS,
                  [int(x) for x in a.layers.split(",") if x], a.flex)
            log(f"[tiles done {time.time() - t0:.0f}s]")
        if "time" in parts:
            Ts = [int(x) for x in a.T.split(",") if x]
            fTs = [int(x) for x in a.fwd_T.split(",") if x]
            rows = time_table(Ts, fTs, a.sdpa_max, a.flex, patterns)
            print_table(rows, patterns)
            log(f"[time done {time.time() - t0:.0f}s]")
    finally:
        if OUT:
            with open(os.path.join(OUT, "bench_sparse_attention.log"), "w") as fh:
                fh.write("\n".join(LOG) + "\n")


if __name__ == "__main__":
    main()
