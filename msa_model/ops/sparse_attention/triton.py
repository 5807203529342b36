"""Fused Triton path of sparse_attention: launchers and the autograd Function.

B = batch, T = queries, TK = keys (query t at position q_offset + t), C = queries of a chunk,
G = key/value heads (groups), H = query heads per group, K = top-k slots, N = key blocks,
D = head dim, E = entries (B*C*G*K triples).

The sparse kernels walk the inverse block -> queries index (ops/inverse_index.py), which needs
no host synchronisation. Partial buffers (forward o/lse, backward dq) are per entry (K times the
size of q), so queries are processed in chunks that keep them under the tuning's budget; the
forward and the backward walk the same index, and a chunk adds only its kernel launches (the
buffers are allocated once and reused).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from ..inverse_index import (DocumentBlocks, InverseIndex, build_inverse_index, clean_block_idx, document_blocks,
                             query_ends, schedule)
from ..triton_utils import LOG2E, interpreting
from .triton_dense import dense_bwd_dkdv_kernel, dense_bwd_dq_kernel, dense_fwd_kernel
from .triton_sparse import (delta_kernel, sparse_bwd_kernel, sparse_bwd_reduce_kernel, sparse_dq_combine_kernel,
                            sparse_fp8_delta_kernel, sparse_fwd_combine_kernel, sparse_fwd_kernel)
from .triton_tiles import tile_dkdv_kernel, tile_dq_kernel, tile_fwd_kernel, tile_union_kernel


@dataclass(frozen=True)
class Tuning:
    """Launch shapes of the kernels. rows = gathered query heads per tile (query tokens x the
    group's heads); a work item (one program) is `*_tiles` tiles of one bucket, so a key/value
    block is loaded once per item and a popular block (the sink, the local block) spreads over
    programs. `dense_dkdv` is (query tile, key tile, warps, stages) of the dense dK/dV kernel. The
    partial buffers' budget is `partial_q_ratio` x the bytes of q, at least `partial_min_bytes`, at
    most `partial_bytes` (see `sparse_index`). Chosen by bench/bench_sparse_attention.py --parts
    tune (bench/RESULTS.md): single-stage loops beat 2-3 stages in both kernels, 64-row tiles of 4
    warps beat 128 rows of 8 in the forward."""

    fwd_rows: int = 64
    fwd_warps: int = 4
    fwd_stages: int = 1
    fwd_tiles: int = 16
    bwd_rows: int = 64
    bwd_warps: int = 8
    bwd_stages: int = 1
    bwd_tiles: int = 128
    dense_dkdv: tuple = (128, 64, 8, 2)
    # queries a forward combine program merges (a power of two): of the gather path alone, and of
    # the hybrid's gathered tiles, where a program none of whose queries is gathered exits
    # (bench/RESULTS.md, round 10)
    combine_queries: int = 2
    combine_queries_rows: int = 4
    partial_bytes: int = 4 << 30
    partial_q_ratio: float = 2.0
    partial_min_bytes: int = 3 << 30
    # The tile-union path (triton_tiles.py). tile_rows: matrix rows per tile, queries x the group's
    # heads (0: the gather path only). It is taken by calls of at least `tile_min_queries` queries
    # whose groups have at least `tile_min_heads` heads (fewer heads: the gather path was as fast
    # or faster, bench/RESULTS.md round 5; from 8K queries the hybrid is level with it on random
    # selections and faster on shared ones, round 13), and there, in the forward, by each tile
    # whose union holds at most `tile_union_max` x K blocks (the others' queries are gathered). tile_keys:
    # the forward's keys per step; tile_warps: the query-outer kernels' warps; tile_stages,
    # tile_masked_stages: the forward's pipeline stages over the blocks every row reads whole and
    # over the others (bench/RESULTS.md, round 9). The backward is the gather path's unless
    # `tile_backward` (then, for heads up to 128 wide, every tile takes the tile path both ways,
    # with `tile_dkdv_tiles` tiles per dK/dV work item, and `tile_dq_keys` keys a step in
    # `tile_dq_stages` in the dQ kernel).
    tile_rows: int = 128
    tile_min_heads: int = 8
    tile_min_queries: int = 8192
    tile_union_max: float = 1.5
    tile_keys: int = 128
    tile_warps: int = 8
    tile_stages: int = 3
    tile_masked_stages: int = 2
    tile_backward: bool = False
    tile_dq_keys: int = 64
    tile_dq_stages: int = 2
    tile_dkdv_warps: int = 8
    tile_dkdv_tiles: int = 64


DEFAULT_TUNING = Tuning()
# the last compiled sparse kernels (registers and spills for benchmarks: .n_regs, .n_spills)
COMPILED = {}


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


def _chunk(T: int, per_query_bytes: int, budget: int) -> int:
    """Queries per chunk: a chunk's partial buffers stay under `budget` bytes, and the chunks are
    of about equal size (no short last chunk)."""
    most = max(1, min(T, budget // max(1, per_query_bytes)))
    return triton.cdiv(T, triton.cdiv(T, most))


def partial_budget(tuning: Tuning, q_bytes: int) -> int:
    """Bytes one call's partial buffers may take: `partial_q_ratio` x the bytes of q, at least
    `partial_min_bytes`, at most `partial_bytes` (why: `sparse_index`)."""
    return int(min(tuning.partial_bytes, max(tuning.partial_min_bytes, tuning.partial_q_ratio * q_bytes)))


def sparse_index(idx, H, D, itemsize, n_blocks, tuning: Tuning, docs: DocumentBlocks | None = None) -> InverseIndex:
    """The inverse index both passes walk, chunked so that the forward's partials (o in the input
    dtype and an fp32 lse per entry and head) fit the budget; the backward's dq partials are smaller.

    The budget is `tuning.partial_q_ratio` times the bytes of q, at most `tuning.partial_bytes`:
    at long context the layer's peak memory then stays under dense attention's (bench/RESULTS.md,
    round 4). Below `tuning.partial_min_bytes` the budget is not cut: the partials live only
    within the call, so at short context, where a training step's peak is the layers' saved
    activations, a few GiB of them leave the step's peak where it was, while every further chunk
    costs launches and splits the kernels' grids (the 8K production layer's partials, 2.0 GiB, in
    one chunk instead of five: fwd+bwd 1.13x faster, bench/RESULTS.md round 13)."""
    return build_inverse_index(idx, n_blocks, _index_chunk(idx.shape, H, D, itemsize, tuning),
                               None if docs is None else docs.base)


def _index_chunk(shape, H, D, itemsize, tuning: Tuning) -> int:
    """Queries per chunk of `sparse_index` for block ids of `shape` [B, T, G, K]."""
    B, T, G, K = shape
    return _chunk(T, B * G * K * H * (D * itemsize + 4), partial_budget(tuning, B * T * G * H * D * itemsize))


def _forward_partials(shape, H, D, dtype, device, tuning: Tuning) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward's partial buffers (o in q's dtype, fp32 lse) of one chunk of `sparse_index`."""
    B, T, G, K = shape
    entries = B * _index_chunk(shape, H, D, torch.finfo(dtype).bits // 8, tuning) * G * K
    return (torch.empty(entries * H, D, dtype=dtype, device=device),
            torch.empty(entries * H, dtype=torch.float32, device=device))


def _chunks(index: InverseIndex, T: int):
    """(chunk, t0, t1) of each query chunk."""
    C = index.chunk_size
    return [(c, c * C, min(T, (c + 1) * C)) for c in range(index.n_chunks)]


def _blocks(docs: DocumentBlocks | None, TK: int, block_size: int, dummy: torch.Tensor):
    """(N, block starts, block ends, DOCS) the sparse kernels take: the document block table, or
    the sequence's N blocks (the tables unused)."""
    if docs is None:
        return triton.cdiv(TK, block_size), dummy, dummy, False
    return docs.n_blocks, docs.start, docs.end, True


def sparse_forward(q, k, v, idx, block_size, scale, q_offset=0, index=None, tuning: Tuning = DEFAULT_TUNING,
                   docs: DocumentBlocks | None = None, out=None, rows=None, partials=None, fp8=False):
    """o [B, T, Hq, D] (q dtype), lse fp32 [B, T, Hq] and the inverse index (for the backward);
    idx cleaned int32 [B, T, G, K]; k, v [B, TK, G, D]; docs: packed documents' block table;
    out: contiguous (o, lse) to write into; rows: bool [B, T, G], contiguous: only these (b, t, g)
    are written (None: all); partials: `_forward_partials`' buffers to use; fp8: the output from
    probabilities rounded to float8 e4m3 (triton_sparse.py)."""
    B, T, Hq, G, H, HP, D = _geometry(q, k, block_size)
    TK = k.shape[1]
    K = idx.shape[-1]
    N, bstart, bend, DOCS = _blocks(docs, TK, block_size, idx)
    if index is None:
        index = sparse_index(idx, H, D, q.element_size(), N, tuning, docs)
    o, lse = out if out is not None else (torch.empty_like(q),
                                          torch.empty(B, T, Hq, dtype=torch.float32, device=q.device))
    QT = max(tuning.fwd_rows, HP) // HP
    tb, ts, tc = schedule(index, QT * tuning.fwd_tiles)
    # one partial buffer, reused by every chunk (the stream orders a chunk's combine before the
    # next chunk's writes)
    po, plse = partials if partials is not None else (
        torch.empty(index.chunk_entries * H, D, dtype=q.dtype, device=q.device),
        torch.empty(index.chunk_entries * H, dtype=torch.float32, device=q.device))
    if po.shape[0] < index.chunk_entries * H or plse.shape[0] < index.chunk_entries * H:
        raise ValueError(f"the partial buffers hold {po.shape[0]} rows; a chunk of the index needs "
                         f"{index.chunk_entries * H}")
    for c, t0, t1 in _chunks(index, T):
        COMPILED["fwd"] = sparse_fwd_kernel[(tb.shape[1],)](
            q, k, v, po, plse, index.entry, tb[c], ts[c], tc[c], bstart, bend, T, TK, t1 - t0, t0, q_offset, N,
            scale * LOG2E.value, HQ=Hq, HKV=G, SLOTS=K, H=H, HP=HP, QT=QT, BS=block_size, D=D, DOCS=DOCS,
            FP8=fp8, num_warps=tuning.fwd_warps, num_stages=tuning.fwd_stages)
        # at most 64 rows a program (its fp32 accumulator in registers)
        rc = max(1, min(tuning.combine_queries if rows is None else tuning.combine_queries_rows, 64 // HP))
        sparse_fwd_combine_kernel[(B * triton.cdiv(t1 - t0, rc) * G,)](
            po, plse, idx, o, lse, idx if rows is None else rows, T, t1 - t0, t0,
            HQ=Hq, HKV=G, SLOTS=K, KP=triton.next_power_of_2(K), H=H, HP=HP, D=D, RC=rc, ROWS=rows is not None,
            num_warps=4)
    return o, lse, index


def _bucket_items(index: InverseIndex, per_item: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(first, number) int32 [n_chunks, buckets]: each bucket's work items under `schedule(index,
    per_item)`, numbered from its chunk's first (what the dK/dV reduction walks)."""
    runs = ((index.count + per_item - 1) // per_item).view(index.n_chunks, -1)
    return (torch.cumsum(runs, 1) - runs).to(torch.int32), runs.to(torch.int32)


def _delta(do, o):
    """rowsum(dO * O) fp32 [B, T, Hq]: the softmax backward's correction term."""
    delta = torch.empty(o.shape[:-1], dtype=torch.float32, device=o.device)
    rows = delta.numel()
    RB = 64
    delta_kernel[(triton.cdiv(rows, RB),)](do, o, delta, rows, RB=RB, D=o.shape[-1], num_warps=4)
    return delta


def sparse_backward(do, q, k, v, o, lse, idx, block_size, scale, q_offset=0, index=None,
                    tuning: Tuning = DEFAULT_TUNING, docs: DocumentBlocks | None = None, teacher=None, out=None,
                    fp8=False):
    """(dq, dk, dv) of `sparse_forward` (given its inverse index, or building it), in the input dtype.
    fp8: of the forward with fp8 probabilities, straight through (triton_sparse.py): each chunk's
    correction term first gets the exact softmax's share (`sparse_fp8_delta_kernel`).

    teacher: optional pbar [B*T*G*K, block_size]: the indexer KL's teacher rows, the mean of P
    over each group's heads, written by the kernel for every entry (an entry's id over all
    queries is its row).
    out: contiguous (dq, dk, dv) to use instead: dq written (q's dtype), dk and dv fp32
    accumulators [B, TK, G, D] added to (a caller summing several calls' key gradients); they are
    returned as they are."""
    B, T, Hq, G, H, HP, D = _geometry(q, k, block_size)
    TK = k.shape[1]
    K = idx.shape[-1]
    N, bstart, bend, DOCS = _blocks(docs, TK, block_size, idx)
    if index is None:
        index = sparse_index(idx, H, D, q.element_size(), N, tuning, docs)
    delta = _delta(do, o)
    if out is not None:
        dq, dk, dv = out
    else:
        dq = torch.empty_like(q)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    QT = max(tuning.bwd_rows, HP) // HP
    # entries per work item: enough tiles to amortise the dK/dV partial, few enough to spread
    # a popular block (the sink, the local block) over many programs
    per_item = QT * tuning.bwd_tiles
    ib, istart, icount = schedule(index, per_item)
    first, runs = _bucket_items(index, per_item)
    # dq partials in the input dtype: each is one block's share, rounded once like torch's own
    # bf16 matmul output, and it halves the bytes of the pass that dominates the backward
    dqp = torch.empty(index.chunk_entries * H, D, dtype=q.dtype, device=q.device)
    dkp = torch.empty(ib.shape[1], block_size, D, dtype=torch.float32, device=q.device)
    dvp = torch.empty_like(dkp)
    rb = min(32, block_size)
    pbar = delta if teacher is None else teacher
    # the teacher's product has one column per entry of a tile, at least 16 on a GPU
    qtc = triton.next_power_of_2(QT if interpreting() else max(QT, 16))
    corr = torch.empty(index.chunk_entries * H, dtype=torch.float32, device=q.device) if fp8 else None
    for c, t0, t1 in _chunks(index, T):
        if fp8:
            corr.zero_()
            sparse_fp8_delta_kernel[(ib.shape[1],)](
                q, k, v, do, lse, corr, index.entry, ib[c], istart[c], icount[c], bstart, bend, T, TK, t1 - t0, t0,
                q_offset, N, scale * LOG2E.value, HQ=Hq, HKV=G, SLOTS=K, H=H, HP=HP, QT=QT, BS=block_size, D=D,
                DOCS=DOCS, num_warps=tuning.bwd_warps, num_stages=1)
            delta[:, t0:t1] += corr[:B * (t1 - t0) * G * K * H].view(B, t1 - t0, G, K, H).sum(3).view(B, t1 - t0, Hq)
        COMPILED["bwd"] = sparse_bwd_kernel[(ib.shape[1],)](
            q, k, v, do, lse, delta, dqp, dkp, dvp, index.entry, ib[c], istart[c], icount[c], bstart, bend,
            pbar, T, TK, t1 - t0, t0, q_offset, N, scale * LOG2E.value, scale,
            HQ=Hq, HKV=G, SLOTS=K, H=H, HP=HP, QT=QT, BS=block_size, D=D, DOCS=DOCS, TEACHER=teacher is not None,
            QTC=qtc, FP8=fp8, num_warps=tuning.bwd_warps, num_stages=tuning.bwd_stages)
        sparse_bwd_reduce_kernel[(runs.shape[1], block_size // rb)](
            dkp, dvp, dk, dv, first[c], runs[c], bstart, bend, TK, N,
            HKV=G, BS=block_size, RB=rb, D=D, DOCS=DOCS, num_warps=4)
        sparse_dq_combine_kernel[(B * (t1 - t0) * G,)](
            dqp, idx, dq, T, t1 - t0, t0, HQ=Hq, HKV=G, SLOTS=K, H=H, HP=HP, D=D, num_warps=4)
    if out is not None:
        return dq, dk, dv
    return dq, dk.to(k.dtype), dv.to(v.dtype)


@dataclass
class TileUnion:
    """Each query tile's union of selected blocks (the tile path, triton_tiles.py).

    ids: int32 [B, T, G, K] the cleaned block ids, table ids with packed documents (-1 unused).
    blocks: int32 [B, G, NT, U] each tile's distinct ids: first those every query of the tile
    selected (ascending), then the others (ascending), then -1 (U = QT*K).
    count: int32 [B, G, NT] how many; full: int32 [B, G, NT] how many of them every query
    selected; queries: QT, queries per tile.
    """

    ids: torch.Tensor
    blocks: torch.Tensor
    count: torch.Tensor
    full: torch.Tensor
    queries: int


def _table_ids(idx: torch.Tensor, docs: DocumentBlocks | None) -> torch.Tensor:
    """int32 [B, T, G, K] contiguous: the cleaned ids, with packed documents as table ids."""
    ids = idx if docs is None else torch.where(idx >= 0, idx + docs.base[:, :, None, None], -1)
    return ids.to(torch.int32).contiguous()


def tile_union_reference(idx: torch.Tensor, queries: int, docs: DocumentBlocks | None = None) -> TileUnion:
    """The union of each tile of `queries` consecutive queries' blocks, per (b, g), the blocks
    every query selected first (the definition, in torch: one segmented sort of [B, G, NT, QT*K]
    and a compaction by prefix sums; `tile_union_triton` is its kernel)."""
    B, T, G, K = idx.shape
    ids = _table_ids(idx, docs)
    NT = triton.cdiv(T, queries)
    L = queries * K
    padded = torch.nn.functional.pad(ids, (0, 0, 0, 0, 0, NT * queries - T), value=-1)
    u = padded.view(B, NT, queries, G, K).permute(0, 3, 1, 2, 4).reshape(B, G, NT, L)
    u = u.sort(-1).values
    first = u >= 0
    first[..., 1:] &= u[..., 1:] != u[..., :-1]
    # a query names a block at most once, so a block every query selected appears `queries`
    # times in a row of the sorted ids: its first copy equals the one queries - 1 places on
    every = torch.zeros_like(first)
    every[..., :L - queries + 1] = first[..., :L - queries + 1] & (u[..., :L - queries + 1] == u[..., queries - 1:])
    rest = first & ~every
    full = every.sum(-1, keepdim=True, dtype=torch.int32)
    # each distinct id's place: the every-query ones from 0, the others after them, both in
    # ascending order; repeats and -1 go to a spare last column
    place = torch.where(every, every.cumsum(-1) - 1, full + rest.cumsum(-1) - 1)
    place = torch.where(first, place, L)
    blocks = torch.full((B, G, NT, L + 1), -1, dtype=torch.int32, device=idx.device)
    blocks.scatter_(-1, place, u)
    count = first.sum(-1, dtype=torch.int32)
    return TileUnion(ids, blocks[..., :L].contiguous(), count, full[..., 0].contiguous(), queries)


def tile_union_triton(idx: torch.Tensor, queries: int, docs: DocumentBlocks | None = None) -> TileUnion:
    """`tile_union_reference` in one kernel (triton_tiles.py), a program per tile."""
    B, T, G, K = idx.shape
    ids = _table_ids(idx, docs)
    NT = triton.cdiv(T, queries)
    U = queries * K
    blocks = torch.empty(B, G, NT, U, dtype=torch.int32, device=idx.device)
    count = torch.empty(B, G, NT, dtype=torch.int32, device=idx.device)
    full = torch.empty_like(count)
    if B * G * NT:
        tile_union_kernel[(NT, B * G)](ids, blocks, count, full, T, NT, HKV=G, SLOTS=K, QT=queries, U=U,
                                       LP=triton.next_power_of_2(U), num_warps=4)
    return TileUnion(ids, blocks, count, full, queries)


def tile_union(idx: torch.Tensor, queries: int, docs: DocumentBlocks | None = None) -> TileUnion:
    """Each tile's union (`tile_union_reference`), with no host synchronisation: the kernel on GPU
    tensors, the reference elsewhere (the kernel's sort takes the interpreter about 0.1 s a tile,
    so CPU tests run the kernel on a few tiles only)."""
    return (tile_union_triton if idx.is_cuda else tile_union_reference)(idx, queries, docs)


def _tile_queries(tuning: Tuning, H: int) -> int:
    """Queries per tile: `tuning.tile_rows` rows of the group's HP heads each, at least 16 rows on a
    GPU (a matrix product's least inner dimension, which the dK/dV kernel's products over rows need)."""
    HP = triton.next_power_of_2(H)
    return max(1, tuning.tile_rows // HP, 1 if interpreting() else triton.cdiv(16, HP))


def _stages(stages: int, D: int) -> int:
    """Pipeline stages of a tile kernel: each holds a key and a value step ([KB, D] each) in shared
    memory, so heads wider than 128 take one (two of D = 256 would not fit in an H200's 227 KiB
    with the tile's other buffers)."""
    return stages if D <= 128 else 1


def _tile_keys(keys: int, block_size: int, D: int) -> int:
    """Keys a step of a tile kernel: at most a block, and for heads wider than 128 at most 32 (the
    forward's two loops each keep a key and a value step in shared memory beside the tile's
    [rows, D] queries)."""
    return min(keys, block_size, 32 if D > 128 else keys)


def _tile_args(q, k, union: TileUnion, block_size, docs):
    B, T, Hq, G, H, HP, D = _geometry(q, k, block_size)
    TK = k.shape[1]
    K = union.ids.shape[-1]
    N, bstart, bend, DOCS = _blocks(docs, TK, block_size, union.ids)
    NT, U = union.blocks.shape[2:]
    return (B, T, TK, G, N, NT, bstart, bend,
            dict(HQ=Hq, HKV=G, SLOTS=K, KP=triton.next_power_of_2(K), H=H, HP=HP, QT=union.queries, U=U,
                 BS=block_size, D=D, DOCS=DOCS))


def _rows_descriptor(x: torch.Tensor, rows: int) -> TensorDescriptor:
    """A TMA descriptor of contiguous x [B, TK, G, D] viewed as [B*TK, G*D], loading [rows, D]
    (a TMA copy needs a 16-byte aligned start: an unaligned view is copied first)."""
    B, TK, G, D = x.shape
    if x.data_ptr() % 16:
        x = x.clone()
    return TensorDescriptor.from_tensor(x.view(B * TK, G * D), [rows, D])


def tile_forward(q, k, v, union: TileUnion, block_size, scale, q_offset=0, tuning: Tuning = DEFAULT_TUNING,
                 docs: DocumentBlocks | None = None, limit: int | None = None, out=None):
    """o [B, T, Hq, D] and lse fp32 [B, T, Hq] of the tile path, one program per (tile, b, g). Only
    tiles whose union holds at most `limit` blocks (None: all) are written, into `out` (o, lse)
    when given."""
    B, T, TK, G, N, NT, bstart, bend, meta = _tile_args(q, k, union, block_size, docs)
    o, lse = out if out is not None else (torch.empty_like(q),
                                          torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device))
    KB = _tile_keys(tuning.tile_keys, block_size, meta["D"])
    COMPILED["tile_fwd"] = tile_fwd_kernel[(NT, B * G)](
        q, _rows_descriptor(k, KB), _rows_descriptor(v, KB), o, lse, union.ids, union.blocks, union.count,
        union.full, bstart, T, TK, q_offset, N, NT, meta["U"] if limit is None else limit, scale * LOG2E.value,
        **meta, KB=KB, UP=triton.next_power_of_2(meta["U"]),
        STAGES=_stages(tuning.tile_stages, meta["D"]),
        MASKED_STAGES=_stages(tuning.tile_masked_stages, meta["D"]), num_warps=tuning.tile_warps)
    return o, lse


_SIDE: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The device's second stream, of a higher priority than the default one, for the hybrid's
    gather pass beside the tile kernel: its short dependent launches take the SMs as the tile
    kernel's programs leave them."""
    key = torch.cuda.current_device() if device.index is None else device.index
    if key not in _SIDE:
        _SIDE[key] = torch.cuda.Stream(device=key, priority=-1)
    return _SIDE[key]


def hybrid_forward(q, k, v, idx, union: TileUnion, block_size, scale, q_offset=0, tuning: Tuning = DEFAULT_TUNING,
                   docs: DocumentBlocks | None = None, out=None, with_index=False):
    """The forward with each tile on the path that suits its union: tiles whose union holds at
    most `tuning.tile_union_max` x K blocks on the tile path, the others' queries on the gather
    path. Decided per tile on the device (no synchronisation): the gather path runs on the other
    tiles' entries alone (the rest emptied) and writes their rows only, the tile kernel writes
    its tiles. Returns (o, lse, index): with `with_index` the gather path's index of every entry,
    which the backward walks (else None).

    On a GPU the two write disjoint rows, so the gather pass (its inverse index, its launches,
    which find little to do where the tiles take most queries) runs on a second stream beside the
    tile kernel, and the index of every entry is built on the first after it. The outputs and
    partials are allocated on the caller's stream before the two part; what the gather pass
    allocates itself (the emptied ids, the index's keys, sort and entries, the schedule: some 30
    bytes an entry) stays cached for the second stream, which alone reuses it."""
    B, T, G, K = idx.shape
    H, D = q.shape[2] // G, q.shape[-1]
    limit = int(tuning.tile_union_max * K)
    o, lse = out if out is not None else (torch.empty_like(q),
                                          torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device))
    partials = _forward_partials(idx.shape, H, D, q.dtype, q.device, tuning)
    side = _side_stream(q.device) if q.is_cuda else None
    if side is not None:
        main = torch.cuda.current_stream(q.device)
        side.wait_stream(main)
    tile_forward(q, k, v, union, block_size, scale, q_offset, tuning, docs, limit, (o, lse))
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        NT, QT = union.count.shape[2], union.queries
        over = (union.count > limit).permute(0, 2, 1)[:, :, None].expand(B, NT, QT, G).reshape(B, NT * QT, G)
        over = over[:, :T].contiguous()
        sparse_forward(q, k, v, torch.where(over[..., None], idx, -1), block_size, scale, q_offset, tuning=tuning,
                       docs=docs, out=(o, lse), rows=over, partials=partials)
    index = _index_of_every_entry(q, k, idx, docs, block_size, tuning) if with_index else None
    if side is not None:
        main.wait_stream(side)
    return o, lse, index


def tile_backward(do, q, k, v, o, lse, union: TileUnion, block_size, scale, q_offset=0,
                  tuning: Tuning = DEFAULT_TUNING, docs: DocumentBlocks | None = None):
    """(dq, dk, dv) of `tile_forward`: dQ per tile over its union; dK/dV per block over the tiles
    whose union holds it (an inverse index of the unions, chunked over tiles so that the work
    items' fp32 partials stay under the gather path's partial budget), reduced in order."""
    B, T, TK, G, N, NT, bstart, bend, meta = _tile_args(q, k, union, block_size, docs)
    delta = _delta(do, o)
    dq = torch.empty_like(q)
    COMPILED["tile_dq"] = tile_dq_kernel[(NT, B * G)](
        q, k, v, do, lse, delta, dq, union.ids, union.blocks, union.count, bstart, bend, T, TK, q_offset, N, NT,
        scale * LOG2E.value, scale, **meta, KB=_tile_keys(tuning.tile_dq_keys, block_size, meta["D"]),
        num_warps=tuning.tile_warps, num_stages=_stages(tuning.tile_dq_stages, meta["D"]))
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    per_item = tuning.tile_dkdv_tiles
    U, D = meta["U"], meta["D"]
    item_bytes = 2 * block_size * D * 4
    budget = partial_budget(tuning, q.numel() * q.element_size())
    chunk = _chunk(NT, triton.cdiv(B * G * U, per_item) * item_bytes, budget)
    index = build_inverse_index(union.blocks.permute(0, 2, 1, 3).contiguous(), N, chunk)
    ib, istart, icount = schedule(index, per_item)
    first, runs = _bucket_items(index, per_item)
    dkp = torch.empty(ib.shape[1], block_size, D, dtype=torch.float32, device=q.device)
    dvp = torch.empty_like(dkp)
    rb = min(32, block_size)
    for c in range(index.n_chunks):
        COMPILED["tile_dkdv"] = tile_dkdv_kernel[(ib.shape[1],)](
            q, k, v, do, lse, delta, dkp, dvp, union.ids, index.entry, ib[c], istart[c], icount[c], bstart, bend,
            T, TK, q_offset, N, NT, scale * LOG2E.value, scale, **meta,
            num_warps=tuning.tile_dkdv_warps, num_stages=1)
        sparse_bwd_reduce_kernel[(runs.shape[1], block_size // rb)](
            dkp, dvp, dk, dv, first[c], runs[c], bstart, bend, TK, N,
            HKV=G, BS=block_size, RB=rb, D=D, DOCS=meta["DOCS"], num_warps=4)
    return dq, dk.to(k.dtype), dv.to(v.dtype)


def _dense_tiles(D: int) -> tuple[int, int]:
    if interpreting():
        return 32, 16
    return 128, 64


def dense_forward(q, k, v, scale, q_offset=0, doc_start=None):
    """Dense causal attention: o [B, T, Hq, D], lse fp32 [B, T, Hq]; with doc_start (int32
    [B, T], contiguous) each query reads its own document only."""
    B, T, Hq, G, H, _, D = _geometry(q, k, 16)
    o = torch.empty_like(q)
    lse = torch.empty(B, T, Hq, dtype=torch.float32, device=q.device)
    BM, BN = _dense_tiles(D)
    dense_fwd_kernel[(triton.cdiv(T, BM), B * Hq)](
        q, k, v, o, lse, lse if doc_start is None else doc_start, T, k.shape[1], q_offset, scale * LOG2E.value,
        HQ=Hq, HKV=G, H=H, BM=BM, BN=BN, D=D, DOCS=doc_start is not None, num_warps=8, num_stages=3)
    return o, lse


def dense_backward(do, q, k, v, o, lse, scale, q_offset=0, tuning: Tuning = DEFAULT_TUNING, doc_start=None):
    B, T, Hq, G, H, _, D = _geometry(q, k, 16)
    TK = k.shape[1]
    delta = _delta(do, o)
    dq = torch.empty_like(q)
    BM, BN, warps, stages = (16, 32, 4, 1) if interpreting() else tuning.dense_dkdv
    dkp = torch.empty(B, TK, Hq, D, dtype=torch.float32, device=q.device)
    dvp = torch.empty_like(dkp)
    docs = lse if doc_start is None else doc_start
    qend = lse if doc_start is None else query_ends(doc_start, TK, BN)
    dense_bwd_dkdv_kernel[(triton.cdiv(TK, BN), B * Hq)](
        q, k, v, do, lse, delta, dkp, dvp, docs, qend, T, TK, q_offset, scale * LOG2E.value, scale,
        HQ=Hq, HKV=G, H=H, BM=BM, BN=BN, D=D, DOCS=doc_start is not None, num_warps=warps, num_stages=stages)
    dk = dkp.view(B, TK, G, H, D).sum(3).to(k.dtype)
    dv = dvp.view(B, TK, G, H, D).sum(3).to(v.dtype)
    BM, BN = (32, 16) if interpreting() else (128, 32)
    dense_bwd_dq_kernel[(triton.cdiv(T, BM), B * Hq)](
        q, k, v, do, lse, delta, dq, docs, T, TK, q_offset, scale * LOG2E.value, scale,
        HQ=Hq, HKV=G, H=H, BM=BM, BN=BN, D=D, DOCS=doc_start is not None, num_warps=8, num_stages=2)
    return dq, dk, dv


@dataclass
class ForwardState:
    """What the backward needs besides q, k, v, o, lse: the cleaned ids (None: dense), the packed
    documents' start and block table, and the path's index (gather) or tile unions (tile backward)."""

    idx: torch.Tensor | None
    doc_start: torch.Tensor | None
    docs: DocumentBlocks | None = None
    index: InverseIndex | None = None
    union: TileUnion | None = None
    fp8: bool = False


def takes_tiles(tuning: Tuning, T: int, H: int) -> bool:
    """Whether a sparse call of T queries with H heads a group takes the tile (or hybrid) forward."""
    return bool(tuning.tile_rows) and H >= tuning.tile_min_heads and T >= tuning.tile_min_queries


def takes_tile_backward(tuning: Tuning, T: int, H: int, D: int) -> bool:
    """Whether such a call takes the tile backward too (`Tuning.tile_backward`): not for heads
    wider than 128, where its dK/dV kernel, which keeps a block's keys, values and fp32
    accumulators beside a tile's queries and output gradients, passes shared memory (262 of 227
    KiB on an H200 at D = 256), so the gather backward runs (the same result)."""
    return tuning.tile_backward and D <= 128 and takes_tiles(tuning, T, H)


def attention_forward(q, k, v, block_idx, block_size, scale, q_offset, tuning: Tuning, doc_start, out=None,
                      with_index=True, fp8=False):
    """(o, lse, ForwardState) of contiguous q, k, v: the dense kernels for block_idx None, else the
    gather, hybrid or tile path as `tuning` says; out: contiguous (o, lse) the sparse paths
    write into. with_index: the state holds the gather path's index of every entry (what its
    backward and the KL walk) also after the hybrid forward, which builds it beside its gather
    pass (else `gather_index` builds it when it is needed). fp8: fp8 probabilities (sparse only;
    the gather path, whose tiles each cover one block, so a tile's row max is the block's)."""
    if doc_start is not None:
        doc_start = doc_start.to(torch.int32).contiguous()
    idx = None if block_idx is None else clean_block_idx(block_idx, block_size, q_offset, doc_start)
    if fp8 and idx is None:
        raise ValueError("fp8 probabilities are the sparse attention's (block_idx given)")
    state = ForwardState(idx, doc_start, fp8=fp8)
    if idx is None:
        if out is not None:
            raise ValueError("given outputs are the sparse paths' only")
        o, lse = dense_forward(q, k, v, scale, q_offset, doc_start)
        return o, lse, state
    if doc_start is not None:
        state.docs = document_blocks(doc_start, block_size, q_offset)
    T, H, D = q.shape[1], q.shape[2] // k.shape[2], q.shape[-1]
    queries = _tile_queries(tuning, H)
    if fp8:
        o, lse, state.index = sparse_forward(q, k, v, idx, block_size, scale, q_offset, tuning=tuning,
                                             docs=state.docs, out=out, fp8=True)
    elif takes_tile_backward(tuning, T, H, D):
        state.union = tile_union(idx, queries, state.docs)
        o, lse = tile_forward(q, k, v, state.union, block_size, scale, q_offset, tuning, state.docs, out=out)
    elif takes_tiles(tuning, T, H):
        o, lse, state.index = hybrid_forward(q, k, v, idx, tile_union(idx, queries, state.docs), block_size, scale,
                                             q_offset, tuning, state.docs, out, with_index)
    else:
        o, lse, state.index = sparse_forward(q, k, v, idx, block_size, scale, q_offset, tuning=tuning,
                                             docs=state.docs, out=out)
    return o, lse, state


def gather_index(q, k, state: ForwardState, block_size: int, tuning: Tuning) -> InverseIndex:
    """The gather path's inverse index of every entry of a sparse forward, which its backward
    walks: the forward's own (the hybrid's is built beside its tile kernel), or built now (after
    a forward `with_index=False`) and kept in `state` for the backward."""
    if state.index is None:
        state.index = _index_of_every_entry(q, k, state.idx, state.docs, block_size, tuning)
    return state.index


def _index_of_every_entry(q, k, idx, docs: DocumentBlocks | None, block_size: int, tuning: Tuning) -> InverseIndex:
    """`sparse_index` of the cleaned ids idx, with q, k giving the geometry."""
    N = _blocks(docs, k.shape[1], block_size, idx)[0]
    return sparse_index(idx, q.shape[2] // k.shape[2], q.shape[-1], q.element_size(), N, tuning, docs)


def attention_backward(do, q, k, v, o, lse, state: ForwardState, block_size, scale, q_offset, tuning: Tuning,
                       teacher=None, out=None):
    """(dq, dk, dv) of `attention_forward`; `teacher` and `out` as `sparse_backward`'s (gather path only)."""
    do = do.contiguous()
    if (teacher is not None or out is not None) and (state.idx is None or state.union is not None):
        raise ValueError("the KL teacher rows and given outputs are the sparse gather backward's only")
    if state.idx is None:
        return dense_backward(do, q, k, v, o, lse, scale, q_offset, tuning, state.doc_start)
    if state.union is not None:
        return tile_backward(do, q, k, v, o, lse, state.union, block_size, scale, q_offset, tuning, state.docs)
    return sparse_backward(do, q, k, v, o, lse, state.idx, block_size, scale, q_offset, state.index, tuning,
                           state.docs, teacher, out, state.fp8)


class SparseAttentionTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, block_idx, block_size, scale, q_offset, tuning, doc_start, fp8):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        # the hybrid's index of every entry is built by the backward: a forward without one (no
        # grad, or the first pass of a recomputed layer) builds none and none is held in between
        o, lse, ctx.state = attention_forward(q, k, v, block_idx, block_size, scale, q_offset, tuning, doc_start,
                                              with_index=False, fp8=fp8)
        # tensors go through save_for_backward (so activation checkpointing manages them)
        ctx.save_for_backward(q, k, v, o, lse, ctx.state.idx, ctx.state.doc_start)
        ctx.state.idx = ctx.state.doc_start = None
        ctx.args = (block_size, scale, q_offset, tuning)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse, ctx.state.idx, ctx.state.doc_start = ctx.saved_tensors
        dq, dk, dv = attention_backward(do, q, k, v, o, lse, ctx.state, *ctx.args)
        ctx.state = None
        return dq, dk, dv, None, None, None, None, None, None, None


def sparse_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_idx: torch.Tensor | None,
                            block_size: int, scale: float, q_offset: int = 0, tuning: Tuning | None = None,
                            doc_start: torch.Tensor | None = None, fp8_probs: bool = False
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused sparse (or, with block_idx None, dense causal) attention.

    q [B, T, Hq, D], k/v [B, TK, Hkv, D] in bf16 or fp16 (fp32 only under Triton's interpreter);
    block_idx int [B, T, Hkv, K] or None. Query t sits at position q_offset + t and TK = q_offset + T
    (the keys of the causal prefix). Returns o [B, T, Hq, D] (q dtype) and lse fp32 [B, T, Hq]
    (not differentiable). Inputs are made contiguous. `tuning` (default `DEFAULT_TUNING`) sets
    the launch shapes and the partial buffers' budget. doc_start int [B, T] (packed documents:
    each query reads its own document, block ids count from its start) costs one host
    synchronisation in the sparse path, which sizes the documents' block table. fp8_probs: the
    output from probabilities rounded to float8 e4m3 (sparse only; the gather path), gradients
    straight through (triton_sparse.py).
    """
    if k.shape[1] != q_offset + q.shape[1]:
        raise ValueError(f"keys cover {k.shape[1]} tokens; q_offset + T = {q_offset + q.shape[1]}")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"the Triton sparse_attention supports bf16 and fp16, got {q.dtype}")
    # fp32 runs only in Triton's interpreter (exact): compiled on an H200 (triton 3.6) the tf32
    # backward returned garbage dq, so it is refused rather than trusted
    if q.dtype == torch.float32 and not interpreting():
        raise TypeError("the Triton sparse_attention does not take fp32 on GPUs; cast q, k, v to bf16/fp16 "
                        "or use backend='reference'")
    return SparseAttentionTriton.apply(q, k, v, block_idx, block_size, scale, int(q_offset),
                                       DEFAULT_TUNING if tuning is None else tuning, doc_start, bool(fp8_probs))
