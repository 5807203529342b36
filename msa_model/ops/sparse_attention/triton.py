"""Fused Triton path of sparse_attention: the inverse block -> queries index, launchers and autograd.

B = batch, T = queries, TK = keys (query t at position q_offset + t), C = queries of a chunk,
G = key/value heads (groups), H = query heads per group, K = top-k slots, N = key blocks,
D = head dim, E = entries (B*C*G*K triples).

The inverse index is plain torch (one stable sort of the entries by (query chunk, batch, group,
block)) and needs no host synchronisation: tile lists are sized by an upper bound, and spare
programs exit. Partial buffers (forward o/lse, backward dq) are per entry (K times the size of
q), so queries are processed in chunks that keep them under `TUNING["partial_bytes"]`; the
forward and the backward walk the same index, and a chunk adds only its kernel launches (the
buffers are allocated once and reused).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton

from .triton_dense import dense_bwd_dkdv_kernel, dense_bwd_dq_kernel, dense_fwd_kernel
from .triton_sparse import (LOG2E, delta_kernel, sparse_bwd_kernel, sparse_bwd_reduce_kernel, sparse_dq_combine_kernel,
                            sparse_fwd_combine_kernel, sparse_fwd_kernel)

# launch shapes of the sparse kernels: rows = gathered query heads per tile (query tokens x the
# group's heads); a work item (one program) is `*_tiles` tiles of one bucket, so a key/value block
# is loaded once per item and a popular block (the sink, the local block) spreads over programs.
# Benchmarks may override them (bench/bench_sparse_attention.py --parts tune; chosen on an H200 at
# 128K: single-stage loops beat 2-3 stages in both kernels). The partial buffers' budget is
# partial_q_ratio x the bytes of q, at least partial_min_bytes, at most partial_bytes (see
# `sparse_index`).
TUNING = dict(fwd_rows=64, fwd_warps=4, fwd_stages=1, fwd_tiles=16,
              bwd_rows=64, bwd_warps=8, bwd_stages=1, bwd_tiles=128,
              dense_dkdv=(128, 64, 8, 2), partial_bytes=4 << 30, partial_q_ratio=2.0,
              partial_min_bytes=512 << 20)
# the last compiled sparse kernels (registers and spills for benchmarks: .n_regs, .n_spills)
COMPILED = {}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def clean_block_idx(block_idx_BTGK: torch.Tensor, block_size: int, q_offset: int = 0) -> torch.Tensor:
    """int32 [B, T, G, K] with set semantics made explicit: slots that repeat a block, name a block
    after the query's own (no causal key) or hold -1 become -1; the rest are sorted ascending.
    Query t sits at position q_offset + t."""
    B, T = block_idx_BTGK.shape[:2]
    idx = block_idx_BTGK.to(torch.int32)
    pos_T = torch.arange(q_offset, q_offset + T, device=idx.device, dtype=torch.int32)
    local_T = (pos_T // block_size)[None, :, None, None]
    idx = torch.where((idx < 0) | (idx > local_T), -1, idx)
    idx, _ = idx.sort(dim=-1)
    dup = torch.zeros_like(idx, dtype=torch.bool)
    dup[..., 1:] = idx[..., 1:] == idx[..., :-1]
    return torch.where(dup, -1, idx).contiguous()


@dataclass
class InverseIndex:
    """Entries grouped by bucket (query chunk, b, g, n), bucket id ((chunk*B + b)*G + g)*N + n;
    chunk = t // chunk_size (one chunk: chunk_size = T).

    entry: int32 [E] triple ids ((b*T + t)*G + g)*K + slot, sorted by bucket, then by query.
    start, count: int64 [n_chunks*B*G*N] each bucket's range in `entry`.
    """

    entry: torch.Tensor
    start: torch.Tensor
    count: torch.Tensor
    n_blocks: int
    n_chunks: int = 1
    chunk_size: int = 0  # queries per chunk (the last may have fewer)
    chunk_entries: int = 0  # entries of a whole chunk, B*chunk_size*G*K (an upper bound per chunk)


def build_inverse_index(idx_BTGK: torch.Tensor, n_blocks: int, chunk_size: int = 0) -> InverseIndex:
    """Inverse (block -> queries) index of a cleaned block_idx (see `clean_block_idx`), bucketed
    per chunk of `chunk_size` queries (0: one chunk). One sort serves every chunk, so a chunk
    costs its launches alone."""
    B, T, G, K = idx_BTGK.shape
    chunk_size = T if chunk_size <= 0 else min(chunk_size, T)
    n_chunks = triton.cdiv(T, chunk_size)
    nb = n_chunks * B * G * n_blocks
    dev = idx_BTGK.device
    chunk_T = torch.arange(T, device=dev) // chunk_size
    bucket = ((chunk_T[None, :, None] * B + torch.arange(B, device=dev)[:, None, None]) * G
              + torch.arange(G, device=dev)[None, None, :])[..., None] * n_blocks
    key = torch.where(idx_BTGK >= 0, bucket + idx_BTGK, nb).flatten()
    # stable: the flat order is query-major, so each bucket lists its queries in order
    key_sorted, entry = torch.sort(key, stable=True)
    # bucket ranges by binary search in the sorted keys (a histogram would serialise on the
    # atomics of popular blocks)
    bounds = torch.searchsorted(key_sorted, torch.arange(nb + 1, device=key.device, dtype=key.dtype))
    start = bounds[:-1]
    count = bounds[1:] - start
    return InverseIndex(entry.to(torch.int32), start, count, n_blocks, n_chunks, chunk_size, B * chunk_size * G * K)


def schedule(index: InverseIndex, per_program: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split every bucket into runs of at most `per_program` entries, one per program.

    Returns int32 (bucket, start, count), each [n_chunks, P]: row c holds chunk c's programs, P an
    upper bound (no host synchronisation), bucket the chunk's own bucket id (b*G + g)*N + n, or -1
    for spare programs. Runs of one bucket are consecutive.
    """
    S = index.n_chunks
    nb = index.count.numel()
    per_chunk = nb // S
    runs = (index.count + per_program - 1) // per_program
    ends = torch.cumsum(runs, 0)
    P = triton.cdiv(max(index.chunk_entries, 1), per_program) + per_chunk
    first = (ends - runs).view(S, per_chunk)[:, :1]  # the chunk's first run, over all chunks
    last = ends.view(S, per_chunk)[:, -1:]
    run = first + torch.arange(P, device=runs.device)[None, :]
    ok = run < last
    bucket = torch.searchsorted(ends, run.flatten(), right=True).view(S, P).clamp(max=nb - 1)
    within = run - (ends[bucket] - runs[bucket])
    start = index.start[bucket] + within * per_program
    count = (index.count[bucket] - within * per_program).clamp(0, per_program)
    local = bucket - torch.arange(S, device=runs.device)[:, None] * per_chunk
    return (torch.where(ok, local, -1).to(torch.int32), start.to(torch.int32), count.to(torch.int32))


def _geometry(q, k, block_size):
    B, T, Hq, D = q.shape
    G = k.shape[2]
    H = Hq // G
    HP = triton.next_power_of_2(H)
    if D not in (16, 32, 64, 128, 256):
        raise ValueError(f"the Triton sparse_attention supports head dims 16..256 (powers of two), got {D}")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"the Triton sparse_attention needs a power-of-two block_size >= 16, got {block_size}")
    return B, T, Hq, G, H, HP, D


def _chunk(T: int, per_query_bytes: int, budget: int | None = None) -> int:
    """Queries per chunk: a chunk's partial buffers stay under `budget` (TUNING["partial_bytes"]
    when None), and the chunks are of about equal size (no short last chunk)."""
    budget = TUNING["partial_bytes"] if budget is None else budget
    most = max(1, min(T, budget // max(1, per_query_bytes)))
    return triton.cdiv(T, triton.cdiv(T, most))


def sparse_index(idx, H, D, itemsize, n_blocks) -> InverseIndex:
    """The inverse index both passes walk, chunked so that the forward's partials (o in the input
    dtype and an fp32 lse per entry and head) fit the budget; the backward's dq partials are smaller.

    The budget is TUNING["partial_q_ratio"] times the bytes of q, at most TUNING["partial_bytes"]:
    the layer's peak memory then stays under dense attention's at every length (H200, 2026-11-29:
    8K 1.05 vs 1.24 GiB, 32K 4.0 vs 4.8, 128K 15.9 vs 18.8), for up to 23% more layer time (8K)
    than a 4 GiB budget. Below TUNING["partial_min_bytes"] the budget is not cut: small layers
    (few heads, short sequences) would otherwise pay each chunk's launches for a few MiB."""
    B, T, G, K = idx.shape
    budget = int(min(TUNING["partial_bytes"],
                     max(TUNING["partial_min_bytes"], TUNING["partial_q_ratio"] * B * T * G * H * D * itemsize)))
    return build_inverse_index(idx, n_blocks, _chunk(T, B * G * K * H * (D * itemsize + 4), budget))


def _chunks(index: InverseIndex, T: int):
    """(chunk, t0, t1) of each query chunk."""
    C = index.chunk_size
    return [(c, c * C, min(T, (c + 1) * C)) for c in range(index.n_chunks)]


def sparse_forward(q, k, v, idx, block_size, scale, q_offset=0, index=None):
    """o [B, T, Hq, D] (q dtype), lse fp32 [B, T, Hq] and the inverse index (for the backward);
    idx cleaned int32 [B, T, G, K]; k, v [B, TK, G, D]."""
    B, T, Hq, G, H, HP, D = _geometry(q, k, block_size)
    TK = k.shape[1]
    K = idx.shape[-1]
    N = triton.cdiv(TK, block_size)
    if index is None:
        index = sparse_index(idx, H, D, q.element_size(), N)
    o = torch.empty_like(q)
    lse = torch.empty(B, T, Hq, dtype=torch.float32, device=q.device)
    QT = max(TUNING["fwd_rows"], HP) // HP
    tb, ts, tc = schedule(index, QT * TUNING["fwd_tiles"])
    # one partial buffer, reused by every chunk (the stream orders a chunk's combine before the
    # next chunk's writes)
    po = torch.empty(index.chunk_entries * H, D, dtype=q.dtype, device=q.device)
    plse = torch.empty(index.chunk_entries * H, dtype=torch.float32, device=q.device)
    for c, t0, t1 in _chunks(index, T):
        COMPILED["fwd"] = sparse_fwd_kernel[(tb.shape[1],)](
            q, k, v, po, plse, index.entry, tb[c], ts[c], tc[c], T, TK, t1 - t0, t0, q_offset, N, scale * LOG2E,
            HQ=Hq, HKV=G, SLOTS=K, H=H, HP=HP, QT=QT, BS=block_size, D=D, FOR_LOOPS=not _interpreting(),
            num_warps=TUNING["fwd_warps"], num_stages=TUNING["fwd_stages"])
        sparse_fwd_combine_kernel[(B * (t1 - t0) * G,)](
            po, plse, idx, o, lse, T, t1 - t0, t0,
            HQ=Hq, HKV=G, SLOTS=K, KP=triton.next_power_of_2(K), H=H, HP=HP, D=D, num_warps=4)
    return o, lse, index


def _delta(do, o):
    """rowsum(dO * O) fp32 [B, T, Hq]: the softmax backward's correction term."""
    delta = torch.empty(o.shape[:-1], dtype=torch.float32, device=o.device)
    rows = delta.numel()
    RB = 64
    delta_kernel[(triton.cdiv(rows, RB),)](do, o, delta, rows, RB=RB, D=o.shape[-1], num_warps=4)
    return delta


def sparse_backward(do, q, k, v, o, lse, idx, block_size, scale, q_offset=0, index=None):
    """(dq, dk, dv) of `sparse_forward` (given its inverse index, or building it), in the input dtype."""
    B, T, Hq, G, H, HP, D = _geometry(q, k, block_size)
    TK = k.shape[1]
    K = idx.shape[-1]
    N = triton.cdiv(TK, block_size)
    if index is None:
        index = sparse_index(idx, H, D, q.element_size(), N)
    delta = _delta(do, o)
    dq = torch.empty_like(q)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    QT = max(TUNING["bwd_rows"], HP) // HP
    # entries per work item: enough tiles to amortise the dK/dV partial, few enough to spread
    # a popular block (the sink, the local block) over many programs
    per_item = QT * TUNING["bwd_tiles"]
    ib, istart, icount = schedule(index, per_item)
    # each bucket's work items, numbered from its chunk's first
    runs = ((index.count + per_item - 1) // per_item).view(index.n_chunks, -1)
    first = (torch.cumsum(runs, 1) - runs).to(torch.int32)
    runs = runs.to(torch.int32)
    # dq partials in the input dtype: each is one block's share, rounded once like torch's own
    # bf16 matmul output, and it halves the bytes of the pass that dominates the backward
    dqp = torch.empty(index.chunk_entries * H, D, dtype=q.dtype, device=q.device)
    dkp = torch.empty(ib.shape[1], block_size, D, dtype=torch.float32, device=q.device)
    dvp = torch.empty_like(dkp)
    rb = min(32, block_size)
    for c, t0, t1 in _chunks(index, T):
        COMPILED["bwd"] = sparse_bwd_kernel[(ib.shape[1],)](
            q, k, v, do, lse, delta, dqp, dkp, dvp, index.entry, ib[c], istart[c], icount[c],
            T, TK, t1 - t0, t0, q_offset, N, scale * LOG2E, scale,
            HQ=Hq, HKV=G, SLOTS=K, H=H, HP=HP, QT=QT, BS=block_size, D=D, FOR_LOOPS=not _interpreting(),
            num_warps=TUNING["bwd_warps"], num_stages=TUNING["bwd_stages"])
        sparse_bwd_reduce_kernel[(runs.shape[1], block_size // rb)](
            dkp, dvp, dk, dv, first[c], runs[c], TK, N,
            HKV=G, BS=block_size, RB=rb, D=D, num_warps=4)
        sparse_dq_combine_kernel[(B * (t1 - t0) * G,)](
            dqp, idx, dq, T, t1 - t0, t0, HQ=Hq, HKV=G, SLOTS=K, H=H, HP=HP, D=D, num_warps=4)
    return dq, dk.to(k.dtype), dv.to(v.dtype)


def _dense_tiles(D: int) -> tuple[int, int]:
    if _interpreting():
        return 32, 16
    return 128, 64


def dense_forward(q, k, v, scale, q_offset=0):
    B, T, Hq, G, H, _, D = _geometry(q, k, 16)
    o = torch.empty_like(q)
    lse = torch.empty(B, T, Hq, dtype=torch.float32, device=q.device)
    BM, BN = _dense_tiles(D)
    dense_fwd_kernel[(triton.cdiv(T, BM), B * Hq)](
        q, k, v, o, lse, T, k.shape[1], q_offset, scale * LOG2E,
        HQ=Hq, HKV=G, H=H, BM=BM, BN=BN, D=D, FOR_LOOPS=not _interpreting(),
        num_warps=8, num_stages=3)
    return o, lse


def dense_backward(do, q, k, v, o, lse, scale, q_offset=0):
    B, T, Hq, G, H, _, D = _geometry(q, k, 16)
    TK = k.shape[1]
    delta = _delta(do, o)
    dq = torch.empty_like(q)
    BM, BN, warps, stages = (16, 32, 4, 1) if _interpreting() else TUNING["dense_dkdv"]
    dkp = torch.empty(B, TK, Hq, D, dtype=torch.float32, device=q.device)
    dvp = torch.empty_like(dkp)
    dense_bwd_dkdv_kernel[(triton.cdiv(TK, BN), B * Hq)](
        q, k, v, do, lse, delta, dkp, dvp, T, TK, q_offset, scale * LOG2E, scale,
        HQ=Hq, HKV=G, H=H, BM=BM, BN=BN, D=D, FOR_LOOPS=not _interpreting(),
        num_warps=warps, num_stages=stages)
    dk = dkp.view(B, TK, G, H, D).sum(3).to(k.dtype)
    dv = dvp.view(B, TK, G, H, D).sum(3).to(v.dtype)
    BM, BN = (32, 16) if _interpreting() else (128, 32)
    dense_bwd_dq_kernel[(triton.cdiv(T, BM), B * Hq)](
        q, k, v, do, lse, delta, dq, T, TK, q_offset, scale * LOG2E, scale,
        HQ=Hq, HKV=G, H=H, BM=BM, BN=BN, D=D, FOR_LOOPS=not _interpreting(),
        num_warps=8, num_stages=2)
    return dq, dk, dv


class SparseAttentionTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, block_idx, block_size, scale, q_offset):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        idx = None if block_idx is None else clean_block_idx(block_idx, block_size, q_offset)
        ctx.index = None
        if idx is None:
            o, lse = dense_forward(q, k, v, scale, q_offset)
        else:
            o, lse, ctx.index = sparse_forward(q, k, v, idx, block_size, scale, q_offset)
        ctx.save_for_backward(q, k, v, o, lse, idx)
        ctx.args = (block_size, scale, q_offset)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse, idx = ctx.saved_tensors
        block_size, scale, q_offset = ctx.args
        do = do.contiguous()
        if idx is None:
            dq, dk, dv = dense_backward(do, q, k, v, o, lse, scale, q_offset)
        else:
            dq, dk, dv = sparse_backward(do, q, k, v, o, lse, idx, block_size, scale, q_offset, ctx.index)
        ctx.index = None
        return dq, dk, dv, None, None, None, None


def sparse_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_idx: torch.Tensor | None,
                            block_size: int, scale: float, q_offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused sparse (or, with block_idx None, dense causal) attention.

    q [B, T, Hq, D], k/v [B, TK, Hkv, D] in bf16 or fp16 (fp32 only under Triton's interpreter);
    block_idx int [B, T, Hkv, K] or None. Query t sits at position q_offset + t and TK = q_offset + T
    (the keys of the causal prefix). Returns o [B, T, Hq, D] (q dtype) and lse fp32 [B, T, Hq]
    (not differentiable). Inputs are made contiguous.
    """
    if k.shape[1] != q_offset + q.shape[1]:
        raise ValueError(f"keys cover {k.shape[1]} tokens; q_offset + T = {q_offset + q.shape[1]}")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"the Triton sparse_attention supports bf16 and fp16, got {q.dtype}")
    # fp32 runs only in Triton's interpreter (exact): compiled on an H200 (triton 3.6) the tf32
    # backward returned garbage dq, so it is refused rather than trusted
    if q.dtype == torch.float32 and not _interpreting():
        raise TypeError("the Triton sparse_attention does not take fp32 on GPUs; cast q, k, v to bf16/fp16 "
                        "or use backend='reference'")
    return SparseAttentionTriton.apply(q, k, v, block_idx, block_size, scale, int(q_offset))
