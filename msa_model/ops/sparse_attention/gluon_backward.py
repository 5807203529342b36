"""The gather backward (`gather.sparse_bwd_kernel`) as a producer/consumer Gluon kernel for
Hopper, taken where `Tuning.bwd_gluon` asks for it and the geometry is the one it is written for
(`usable`): bf16, D = 128, 128-key blocks, 64 rows a tile (QT queries x HP = 16 head rows), no
fp8 probabilities, an sm_90 GPU. Same work items, inputs and outputs as `sparse_bwd_kernel`: dK/dV
partials per work item, dQ partials per entry, the KL teacher's rows (equal to the Triton
kernel's bit for bit where measured, at 8K and 32K on an H100).

A program (one work item: a key/value block and a run of its entries) has two partitions:
- a loader (4 warps): for tile i it waits until stage i % STAGES of a shared-memory ring is free,
  then gathers the tile's rows of q and dO by 16-byte cp.async, with each row's entry id, lse
  and delta and the tile's entry ids, and their arrival completes the stage's `full` barrier;
- 8 MMA warps (two warpgroups, 64 of the block's keys each): S = Q K^T and dP = dO V^T [rows,
  keys], P and dS to shared memory, dV += P^T dO, dK += dS^T Q, dQ = dS K and the teacher's rows
  P^T A (A averages each entry's heads), then the stage goes back to the loader (`empty`).
No global load waits inside the MMA warps' loop: the gathers run STAGES tiles ahead. dK/dV stay
in registers over the work item.

Gluon does not run under TRITON_INTERPRET: on the CPU the kernel can only be compiled for
sm_90a (tests/test_sparse_attention_triton.py does); the GPU tests compare it with the Triton
kernel. Measured in bench/HISTORY.md ("A gather backward in Gluon").
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                               warpgroup_mma_wait)

from ..triton_utils import LOG2E, interpreting

# loader warps and their registers (the MMA warps take the rest: 240 each)
LOADER_WARPS = 4
LOADER_REGS = 48


def usable(q: torch.Tensor, block_size: int, rows: int, fp8: bool) -> bool:
    """Whether the call is of the geometry the kernel is written for (rows: matrix rows a tile,
    QT x HP), on a GPU it runs on."""
    return (not fp8 and q.is_cuda and not interpreting() and q.dtype == torch.bfloat16
            and q.shape[-1] == 128 and block_size == 128 and rows == 64
            and torch.cuda.get_device_capability(q.device)[0] == 9)


@gluon.jit
def _tile_rows(ENTRY, start, i0, count, T, SLOTS: gl.constexpr, HKV: gl.constexpr, H: gl.constexpr,
               HP: gl.constexpr, R: gl.constexpr, layout: gl.constexpr):
    """A tile's rows (entries start+i0 .. +QT-1, HP head rows each) in a 1-D `layout`: head,
    validity and query t (as in gather.py's `_tile_rows`), int32."""
    r = gl.arange(0, R, layout=layout)
    qi = i0 + r // HP
    hh = r % HP
    ok = (qi < count) & (hh < H)
    trip = gl.load(ENTRY + start + qi, mask=ok, other=0)
    t = (trip // (SLOTS * HKV)) % T
    return hh, ok, t


@gluon.jit
def _loader(Q, DO, LSE, DELTA, ENTRY, q_ring, do_ring, trip_ring, lse_ring, delta_ring, e_ring, full, empty, start,
            count, b, g, T, HQ: gl.constexpr, HKV: gl.constexpr, SLOTS: gl.constexpr, H: gl.constexpr,
            HP: gl.constexpr, QT: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr, LW: gl.constexpr,
            QTC: gl.constexpr):
    """Fills stage i % STAGES for tile i once the MMA warps have released it: the rows of q and
    dO, and everything else the MMA warps read of the tile (each row's entry id, lse and delta;
    the tile's entry ids), so that no global load waits in their loop. Every loader thread's
    copies arrive on the stage's `full` barrier."""
    R: gl.constexpr = QT * HP
    L: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [LW, 1], [1, 0])
    L1: gl.constexpr = gl.BlockedLayout([1], [32], [LW], [0])
    d = gl.arange(0, D, layout=gl.SliceLayout(0, L))
    r1 = gl.arange(0, R, layout=L1)
    c1 = gl.arange(0, QTC, layout=L1)
    ntiles = (count + QT - 1) // QT
    for i in range(ntiles):
        s = i % STAGES
        i0 = i * QT
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
        hh, ok, t = _tile_rows(ENTRY, start, i0, count, T, SLOTS, HKV, H, HP, R, gl.SliceLayout(1, L))
        row = (b * T + t.to(gl.int64)) * HQ + g * H + hh
        off = row[:, None] * D + d[None, :]
        async_copy.async_copy_global_to_shared(q_ring.index(s), Q + off, mask=ok[:, None])
        async_copy.async_copy_global_to_shared(do_ring.index(s), DO + off, mask=ok[:, None])
        row1 = gl.convert_layout(row, L1)
        ok1 = gl.convert_layout(ok, L1)
        async_copy.async_copy_global_to_shared(trip_ring.index(s), ENTRY + start + i0 + r1 // HP,
                                               mask=i0 + r1 // HP < count)
        async_copy.async_copy_global_to_shared(lse_ring.index(s), LSE + row1, mask=ok1)
        async_copy.async_copy_global_to_shared(delta_ring.index(s), DELTA + row1, mask=ok1)
        async_copy.async_copy_global_to_shared(e_ring.index(s), ENTRY + start + i0 + c1,
                                               mask=(c1 < QT) & (i0 + c1 < count))
        async_copy.mbarrier_arrive(full.index(s), increment_count=False)


@gluon.jit
def _mma(DQP, PBAR, DKP, DVP, k_smem, v_smem, q_ring, do_ring, trip_ring, lse_ring, delta_ring, e_ring, p_smem,
         ds_smem, avg_smem, full, empty, count, b, j0, T, C, t0, QOFF, qk_scale, sm_scale,
         HKV: gl.constexpr, SLOTS: gl.constexpr, H: gl.constexpr, HP: gl.constexpr, QT: gl.constexpr,
         BS: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr, TEACHER: gl.constexpr, QTC: gl.constexpr):
    """The 8 MMA warps (two warpgroups) per tile: S = Q K^T and dP = dO V^T [rows, keys] (each
    warpgroup 64 keys), P and dS to shared memory, dV += P^T dO, dK += dS^T Q, dQ = dS K and the
    teacher's rows P^T A; the stage goes back to the loader once read. dK/dV [keys, D] stay in
    registers over the work item."""
    R: gl.constexpr = QT * HP
    L_S: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BS // 2, 16])
    L_KD: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, D, 16])
    L_DQ: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, D // 2, 16])
    L_T: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, QTC, 16])
    ROWS: gl.constexpr = gl.SliceLayout(1, L_S)
    keys = j0 + gl.arange(0, BS, layout=gl.SliceLayout(0, L_S))
    r = gl.arange(0, R, layout=ROWS)
    rq = gl.arange(0, R, layout=gl.SliceLayout(1, L_DQ))
    dq_d = gl.arange(0, D, layout=gl.SliceLayout(0, L_DQ))
    col = gl.arange(0, QTC, layout=gl.SliceLayout(0, L_T))
    kt = gl.arange(0, BS, layout=gl.SliceLayout(1, L_T))
    dk = gl.zeros([BS, D], gl.float32, layout=L_KD)
    dv = gl.zeros([BS, D], gl.float32, layout=L_KD)
    ntiles = (count + QT - 1) // QT
    for i in range(ntiles):
        s = i % STAGES
        i0 = i * QT
        mbarrier.wait(full.index(s), (i // STAGES) & 1)
        qs = q_ring.index(s)
        dos = do_ring.index(s)
        sc = warpgroup_mma(qs, k_smem.permute((1, 0)), gl.zeros([R, BS], gl.float32, layout=L_S), use_acc=False,
                           is_async=True)
        dp = warpgroup_mma(dos, v_smem.permute((1, 0)), gl.zeros([R, BS], gl.float32, layout=L_S), use_acc=False,
                           is_async=True)
        ok = (i0 + r // HP < count) & (r % HP < H)
        t = (trip_ring.index(s).load(ROWS) // (SLOTS * HKV)) % T
        lse2 = lse_ring.index(s).load(ROWS) * LOG2E
        delta = delta_ring.index(s).load(ROWS)
        tripq = trip_ring.index(s).load(gl.SliceLayout(1, L_DQ))
        okq = (i0 + rq // HP < count) & (rq % HP < H)
        if TEACHER:
            e = e_ring.index(s).load(gl.SliceLayout(0, L_T))
        sc = warpgroup_mma_wait(num_outstanding=1, deps=(sc,))
        vis = (keys[None, :] <= QOFF + t[:, None]) & ok[:, None]
        p = gl.where(vis, gl.exp2(sc * qk_scale - lse2[:, None]), 0.0)
        p_smem.store(p.to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()
        dv = warpgroup_mma(p_smem.permute((1, 0)), dos, dv, is_async=True)
        if TEACHER:
            pbar = warpgroup_mma(p_smem.permute((1, 0)), avg_smem, gl.zeros([BS, QTC], gl.float32, layout=L_T),
                                 use_acc=False, is_async=True)
        dp = warpgroup_mma_wait(num_outstanding=2 if TEACHER else 1, deps=(dp,))
        ds_smem.store((p * (dp - delta[:, None])).to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()
        dk = warpgroup_mma(ds_smem.permute((1, 0)), qs, dk, is_async=True)
        dq = warpgroup_mma(ds_smem, k_smem, gl.zeros([R, D], gl.float32, layout=L_DQ), use_acc=False, is_async=True)
        if TEACHER:
            dv, pbar, dk, dq = warpgroup_mma_wait(num_outstanding=0, deps=(dv, pbar, dk, dq))
        else:
            dv, dk, dq = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk, dq))
        # every warp is past its products of this stage (and of p_smem, ds_smem) before it is refilled
        gl.thread_barrier()
        mbarrier.arrive(empty.index(s), count=1)
        if TEACHER:
            col_ok = (col < QT) & (i0 + col < count)
            gl.store(PBAR + e.to(gl.int64)[None, :] * BS + kt[:, None], pbar.to(PBAR.dtype.element_ty),
                     mask=col_ok[None, :])
        tq = (tripq // (SLOTS * HKV)) % T
        part = ((b * C + (tq - t0).to(gl.int64)) * (HKV * SLOTS) + tripq % (HKV * SLOTS)) * H + rq % HP
        gl.store(DQP + part[:, None] * D + dq_d[None, :], (dq * sm_scale).to(DQP.dtype.element_ty),
                 mask=okq[:, None])
    rr = gl.arange(0, BS, layout=gl.SliceLayout(1, L_KD))
    dd = gl.arange(0, D, layout=gl.SliceLayout(0, L_KD))
    out = gl.program_id(0).to(gl.int64) * BS * D + rr[:, None] * D + dd[None, :]
    gl.store(DKP + out, dk * sm_scale)
    gl.store(DVP + out, dv)


@gluon.jit
def gluon_bwd_kernel(Q, K, V, DO, LSE, DELTA, DQP, DKP, DVP, ENTRY, ITEM_BUCKET, ITEM_START, ITEM_COUNT,
                     BSTART, BEND, PBAR, T, TK, C, t0, QOFF, NBLK, qk_scale, sm_scale,
                     HQ: gl.constexpr, HKV: gl.constexpr, SLOTS: gl.constexpr, H: gl.constexpr, HP: gl.constexpr,
                     QT: gl.constexpr, BS: gl.constexpr, D: gl.constexpr, DOCS: gl.constexpr,
                     TEACHER: gl.constexpr, QTC: gl.constexpr, STAGES: gl.constexpr, LW: gl.constexpr,
                     LOADER_REGS: gl.constexpr):
    """One work item a program, as `sparse_bwd_kernel` (8 warps, plus LW loader warps)."""
    R: gl.constexpr = QT * HP
    pid = gl.program_id(0)
    bucket = gl.load(ITEM_BUCKET + pid)
    if bucket >= 0:
        start = gl.load(ITEM_START + pid)
        count = gl.load(ITEM_COUNT + pid)
        n = bucket % NBLK
        g = (bucket // NBLK) % HKV
        b = (bucket // (NBLK * HKV)).to(gl.int64)
        if DOCS:
            j0 = gl.load(BSTART + b * NBLK + n)
            end = gl.load(BEND + b * NBLK + n)
        else:
            j0 = n * BS
            end = TK
        sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        k_smem = gl.allocate_shared_memory(gl.bfloat16, [BS, D], sl)
        v_smem = gl.allocate_shared_memory(gl.bfloat16, [BS, D], sl)
        q_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, R, D], sl)
        do_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, R, D], sl)
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [R, BS], sl)
        ds_smem = gl.allocate_shared_memory(gl.bfloat16, [R, BS], sl)
        vl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        trip_ring = gl.allocate_shared_memory(gl.int32, [STAGES, R], vl)
        lse_ring = gl.allocate_shared_memory(gl.float32, [STAGES, R], vl)
        delta_ring = gl.allocate_shared_memory(gl.float32, [STAGES, R], vl)
        e_ring = gl.allocate_shared_memory(gl.int32, [STAGES, QTC], vl)
        avg_smem = gl.allocate_shared_memory(gl.bfloat16, [R, QTC],
                                             gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=16, rank=2))
        full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(full.index(s), count=32 * LW)  # one cp.async arrival per loader thread
            mbarrier.init(empty.index(s), count=1)
        kl: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
        kr = gl.arange(0, BS, layout=gl.SliceLayout(1, kl))
        kd = gl.arange(0, D, layout=gl.SliceLayout(0, kl))
        kv = ((b * TK + j0 + kr) * HKV + g) * D
        kmask = (j0 + kr < end)[:, None]
        k_smem.store(gl.load(K + kv[:, None] + kd[None, :], mask=kmask, other=0.0))
        v_smem.store(gl.load(V + kv[:, None] + kd[None, :], mask=kmask, other=0.0))
        if TEACHER:
            al: gl.constexpr = gl.BlockedLayout([1, 1], [2, 16], [8, 1], [1, 0])
            ar = gl.arange(0, R, layout=gl.SliceLayout(1, al))
            ac = gl.arange(0, QTC, layout=gl.SliceLayout(0, al))
            avg = gl.where((ar[:, None] // HP == ac[None, :]) & (ar[:, None] % HP < H), 1.0 / H, 0.0)
            avg_smem.store(avg.to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()
        gl.warp_specialize([
            (_mma, (DQP, PBAR, DKP, DVP, k_smem, v_smem, q_ring, do_ring, trip_ring, lse_ring, delta_ring, e_ring,
                    p_smem, ds_smem, avg_smem, full, empty, count, b, j0, T, C, t0, QOFF, qk_scale, sm_scale, HKV,
                    SLOTS, H, HP, QT, BS, D, STAGES, TEACHER, QTC)),
            (_loader, (Q, DO, LSE, DELTA, ENTRY, q_ring, do_ring, trip_ring, lse_ring, delta_ring, e_ring, full,
                       empty, start, count, b, g, T, HQ, HKV, SLOTS, H, HP, QT, D, STAGES, LW, QTC)),
        ], [LW], [LOADER_REGS])
