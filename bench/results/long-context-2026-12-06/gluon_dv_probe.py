"""Does a loader/MMA split pay on the gather backward's access pattern? A subset of the gather
backward's tile (gathered rows of q and dO, S^T = K Q^T, P = exp2(S^T - lse), dV += P dO) as a
warp-specialized Gluon kernel (a 1-warp cp.async loader filling a 3-stage ring, 4 MMA warps)
against the same subset in plain Triton (one program doing both, as `sparse_bwd_kernel` does),
checked against torch and timed on the GPU:

    python bench/results/long-context-2026-12-06/gluon_dv_probe.py

Sizes: 264 programs (two an SM of an H100) of one key block each, 64 tiles of 64 gathered rows a
program, rows drawn at random from a pool of 512K rows (q and dO of an 8K sequence's 64 heads).

Status: written in the eighth session of 2026-12-06 and not yet run (no device time was left).
Compiled here for sm_90a, the Gluon kernel takes 147.6 KB of shared memory and 255 registers
with 728 bytes spilled. The PTX arrives once per stage from one consumer thread and from every
loader thread (`cp.async.mbarrier.arrive.noinc`), matching the barriers' counts.
"""
import sys

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma


@gluon.jit
def _loader(Q, DO, ROWS, q_ring, do_ring, full, empty, ntiles, R: gl.constexpr, D: gl.constexpr,
            STAGES: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [1, 1], [1, 0])
    r = gl.arange(0, R, layout=gl.SliceLayout(1, layout))
    d = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    base = gl.program_id(0) * ntiles * R
    for i in range(ntiles):
        s = i % STAGES
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
        rows = gl.load(ROWS + base + i * R + r).to(gl.int64)
        off = rows[:, None] * D + d[None, :]
        async_copy.async_copy_global_to_shared(q_ring.index(s), Q + off)
        async_copy.async_copy_global_to_shared(do_ring.index(s), DO + off)
        async_copy.mbarrier_arrive(full.index(s), increment_count=False)


@gluon.jit
def _mma(LSE, ROWS, OUT, k_smem, q_ring, do_ring, p_smem, full, empty, ntiles, qk_scale, BS: gl.constexpr,
         R: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr):
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, R, 16])
    dv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    cols = gl.arange(0, R, layout=gl.SliceLayout(0, s_layout))
    base = gl.program_id(0) * ntiles * R
    dv = gl.zeros([BS, D], gl.float32, layout=dv_layout)
    for i in range(ntiles):
        s = i % STAGES
        lse = gl.load(LSE + gl.load(ROWS + base + i * R + cols))
        mbarrier.wait(full.index(s), (i // STAGES) & 1)
        fence_async_shared()
        st = warpgroup_mma(k_smem, q_ring.index(s).permute((1, 0)), gl.zeros([BS, R], gl.float32, layout=s_layout),
                           use_acc=False)
        p = gl.exp2(st * qk_scale - lse[None, :])
        p_smem.store(p.to(gl.bfloat16))
        fence_async_shared()
        dv = warpgroup_mma(p_smem, do_ring.index(s), dv)
        mbarrier.arrive(empty.index(s), count=1)
    rr = gl.arange(0, BS, layout=gl.SliceLayout(1, dv_layout))
    dd = gl.arange(0, D, layout=gl.SliceLayout(0, dv_layout))
    gl.store(OUT + gl.program_id(0).to(gl.int64) * BS * D + rr[:, None] * D + dd[None, :], dv)


@gluon.jit
def gluon_dv_kernel(Q, DO, K, LSE, ROWS, OUT, ntiles, qk_scale, BS: gl.constexpr, R: gl.constexpr,
                    D: gl.constexpr, STAGES: gl.constexpr):
    sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [BS, D], sl)
    q_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, R, D], sl)
    do_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, R, D], sl)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [BS, R], sl)
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(full.index(s), count=32)  # one cp.async arrival per loader thread
        mbarrier.init(empty.index(s), count=1)
    kl: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    kr = gl.arange(0, BS, layout=gl.SliceLayout(1, kl))
    kd = gl.arange(0, D, layout=gl.SliceLayout(0, kl))
    k_smem.store(gl.load(K + gl.program_id(0).to(gl.int64) * BS * D + kr[:, None] * D + kd[None, :]))
    fence_async_shared()
    gl.warp_specialize([(_mma, (LSE, ROWS, OUT, k_smem, q_ring, do_ring, p_smem, full, empty, ntiles, qk_scale,
                                BS, R, D, STAGES)),
                        (_loader, (Q, DO, ROWS, q_ring, do_ring, full, empty, ntiles, R, D, STAGES))], [1], [48])


@triton.jit
def triton_dv_kernel(Q, DO, K, LSE, ROWS, OUT, ntiles, qk_scale, BS: tl.constexpr, R: tl.constexpr,
                     D: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, D)
    kt = tl.load(K + pid * BS * D + tl.arange(0, BS)[:, None] * D + d[None, :])
    dv = tl.zeros([BS, D], tl.float32)
    for i in range(ntiles):
        rows = tl.load(ROWS + (pid * ntiles + i) * R + tl.arange(0, R)).to(tl.int64)
        q = tl.load(Q + rows[:, None] * D + d[None, :])
        do = tl.load(DO + rows[:, None] * D + d[None, :])
        lse = tl.load(LSE + rows)
        p = tl.exp2(tl.dot(kt, tl.trans(q)) * qk_scale - lse[None, :])
        dv += tl.dot(p.to(tl.bfloat16), do)
    tl.store(OUT + pid * BS * D + tl.arange(0, BS)[:, None] * D + d[None, :], dv)


def main():
    torch.manual_seed(0)
    BS, R, D, NT, POOL = 128, 64, 128, 64, 512 * 1024
    progs = 2 * torch.cuda.get_device_properties(0).multi_processor_count
    q = torch.randn(POOL, D, device="cuda", dtype=torch.bfloat16)
    do = torch.randn(POOL, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(progs, BS, D, device="cuda", dtype=torch.bfloat16)
    lse = torch.randn(POOL, device="cuda") + 12.0
    rows = torch.randint(0, POOL, (progs, NT, R), device="cuda", dtype=torch.int32)
    scale = D ** -0.5 * 1.4426950408889634

    def run(kind, **kw):
        out = torch.empty(progs, BS, D, device="cuda")
        fn = gluon_dv_kernel if kind == "gluon" else triton_dv_kernel
        fn[(progs,)](q, do, k, lse, rows, out, NT, scale, BS=BS, R=R, D=D, **kw)
        return out

    # torch on the first 4 programs
    ref = []
    for p_ in range(4):
        rr = rows[p_].reshape(-1).long()
        st = (k[p_].float() @ q[rr].float().T) * scale - lse[rr][None, :]
        ref.append(torch.exp2(st).to(torch.bfloat16).float() @ do[rr].float())
    ref = torch.stack(ref)
    variants = [("triton", dict(num_warps=8, num_stages=1)), ("triton", dict(num_warps=4, num_stages=1)),
                ("triton", dict(num_warps=8, num_stages=2)), ("gluon", dict(STAGES=3, num_warps=4)),
                ("gluon", dict(STAGES=2, num_warps=4))]
    if len(sys.argv) > 1:  # e.g. gluon:3:4 triton:8:1 (kind:stages-or-warps:...) one process a variant
        kind, a, b = sys.argv[1].split(":")
        variants = [(kind, dict(STAGES=int(a), num_warps=int(b)) if kind == "gluon"
                     else dict(num_warps=int(a), num_stages=int(b)))]
    for kind, kw in variants:
        try:
            out = run(kind, **kw)
            torch.cuda.synchronize()
            err = ((out[:4] - ref).norm() / ref.norm()).item()
            ms = triton.testing.do_bench(lambda: run(kind, **kw), warmup=5, rep=50)
            gb = progs * NT * R * D * 2 * 2 / ms / 1e6
            print(f"{kind} {kw}: rel err {err:.2e}, {ms:.3f} ms, gathered {gb:.0f} GB/s", flush=True)
        except Exception as e:
            print(f"{kind} {kw}: failed {type(e).__name__}: {str(e)[:300]}", flush=True)


if __name__ == "__main__":
    main()
