"""What the sparse attention's execution paths share: the geometry check, the partial buffers'
memory budget and the query chunks it sets, the inverse index of a call, the softmax backward's
correction term, and the key/value block a work item loads.

B = batch, T = queries, TK = keys (query t at position q_offset + t), C = queries of a chunk,
G = key/value heads (groups), H = query heads per group, K = top-k slots, N = key blocks,
D = head dim, E = entries (B*C*G*K triples).

Partial buffers (the gather forward's o/lse, its backward's dq) are per entry (K times the size
of q), so queries are processed in chunks that keep them under the tuning's budget; the forward
and the backward walk the same index, and a chunk adds only its kernel launches (the buffers are
allocated once and reused).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import check_block_size
from .inverse_index import DocumentBlocks, InverseIndex, build_inverse_index, decode_bucket
from .tuning import Tuning



# process-wide record for benchmarks: each launch of a gather or tile kernel stores its compiled
# kernel here under the kernel's name ("fwd", "bwd", "tile_fwd", "tile_dq", "tile_dkdv"), which
# bench/bench_sparse_attention.py reads for registers and spills (.n_regs, .n_spills); the
# library never reads it, so what it holds changes no result
COMPILED: dict[str, object] = {}


def geometry(q, k, block_size):
    B, T, Hq, D = q.shape
    G = k.shape[2]
    H = Hq // G
    HP = triton.next_power_of_2(H)
    if D not in (16, 32, 64, 128, 256):
        raise ValueError(f"the Triton sparse_attention supports head dims 16..256 (powers of two), got {D}")
    check_block_size(block_size, triton="sparse_attention")
    return B, T, Hq, G, H, HP, D


def equal_chunks(T: int, per_query_bytes: int, budget: int) -> int:
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
    at long context the layer's peak memory then stays under dense attention's. Below
    `tuning.partial_min_bytes` the budget is not cut: the partials live only within the call, so at
    short context, where a training step's peak is the layers' saved activations, a few GiB of them
    leave the step's peak where it was, while every further chunk costs launches and splits the
    kernels' grids (the 8K production layer's partials, 2.0 GiB, in one chunk instead of five:
    fwd+bwd 1.13x faster)."""
    return build_inverse_index(idx, n_blocks, index_chunk(idx.shape, H, D, itemsize, tuning),
                               None if docs is None else docs.base)


def index_chunk(shape, H, D, itemsize, tuning: Tuning) -> int:
    """Queries per chunk of `sparse_index` for block ids of `shape` [B, T, G, K]."""
    B, T, G, K = shape
    return equal_chunks(T, B * G * K * H * (D * itemsize + 4), partial_budget(tuning, B * T * G * H * D * itemsize))


def forward_partials(shape, H, D, dtype, device, tuning: Tuning) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward's partial buffers (o in q's dtype, fp32 lse) of one chunk of `sparse_index`."""
    B, T, G, K = shape
    entries = B * index_chunk(shape, H, D, torch.finfo(dtype).bits // 8, tuning) * G * K
    return (torch.empty(entries * H, D, dtype=dtype, device=device),
            torch.empty(entries * H, dtype=torch.float32, device=device))


def query_chunks(index: InverseIndex, T: int):
    """(chunk, t0, t1) of each query chunk."""
    C = index.chunk_size
    return [(c, c * C, min(T, (c + 1) * C)) for c in range(index.n_chunks)]


def narrow_offsets(tuning, *tensors: torch.Tensor) -> bool:
    """Whether a gather kernel may compute its row offsets in int32: `tuning.narrow_offsets` and
    every tensor it indexes by entry or query row under 2**31 elements (q and do, the partial
    buffers, the selection [B, T, G, K], whose flat index is an entry's id, the KL teacher's rows).
    The tile's address arithmetic in int64 was a quarter of the backward's stall samples at 8K;
    int32 took fwd+bwd from 8.51 to 7.58 ms there (H100, bench/RESULTS.md)."""
    return tuning.narrow_offsets and max(t.numel() for t in tensors) < 2 ** 31


def block_tables(docs: DocumentBlocks | None, TK: int, block_size: int, dummy: torch.Tensor):
    """(N, block starts, block ends, DOCS) the sparse kernels take: the document block table, or
    the sequence's N blocks (the tables unused)."""
    if docs is None:
        return triton.cdiv(TK, block_size), dummy, dummy, False
    return docs.n_blocks, docs.start, docs.end, True


def bucket_items(index: InverseIndex, per_item: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(first, number) int32 [n_chunks, buckets]: each bucket's work items under `schedule(index,
    per_item)`, numbered from its chunk's first (what the dK/dV reduction walks)."""
    runs = ((index.count + per_item - 1) // per_item).view(index.n_chunks, -1)
    return (torch.cumsum(runs, 1) - runs).to(torch.int32), runs.to(torch.int32)


def softmax_delta(do, o):
    """rowsum(dO * O) fp32 [B, T, Hq]: the softmax backward's correction term."""
    delta = torch.empty(o.shape[:-1], dtype=torch.float32, device=o.device)
    rows = delta.numel()
    RB = 64
    delta_kernel[(triton.cdiv(rows, RB),)](do, o, delta, rows, RB=RB, D=o.shape[-1], num_warps=4)
    return delta


def index_of_every_entry(q, k, idx, docs: DocumentBlocks | None, block_size: int, tuning: Tuning) -> InverseIndex:
    """`sparse_index` of the cleaned ids idx, with q, k giving the geometry."""
    N = block_tables(docs, k.shape[1], block_size, idx)[0]
    return sparse_index(idx, q.shape[2] // k.shape[2], q.shape[-1], q.element_size(), N, tuning, docs)


@triton.jit
def block_keys(b, n, TK, NBLK, BSTART, BEND, BS: tl.constexpr, DOCS: tl.constexpr):
    """Positions j [BS] of block n of row b and the end of its keys (j < end are present)."""
    if DOCS:
        j = tl.load(BSTART + b * NBLK + n) + tl.arange(0, BS)
        end = tl.load(BEND + b * NBLK + n)
    else:
        j = n * BS + tl.arange(0, BS)
        end = TK
    return j, end


@triton.jit
def kv_block(K, V, bucket, TK, NBLK, BSTART, BEND, HKV: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
              DOCS: tl.constexpr):
    """The key/value block of a work item's bucket: its batch b (int64), group g, key positions
    j [BS] and the key and value rows kt, vt [BS, D] (zero where a key is not in the block).
    Keys past the block's end are later than every query that selected it, so the causal mask
    keeps them out of the scores."""
    b, g, n = decode_bucket(bucket, NBLK, HKV)
    b = b.to(tl.int64)
    d = tl.arange(0, D)
    j, end = block_keys(b, n, TK, NBLK, BSTART, BEND, BS, DOCS)
    kv = ((b * TK + j) * HKV + g) * D
    kt = tl.load(K + kv[:, None] + d[None, :], mask=(j < end)[:, None], other=0.0)
    vt = tl.load(V + kv[:, None] + d[None, :], mask=(j < end)[:, None], other=0.0)
    return b, g, j, kt, vt


@triton.jit
def delta_kernel(DO, O, DELTA, rows, RB: tl.constexpr, D: tl.constexpr):
    """DELTA [rows] (fp32) = rowsum(DO * O) over D, for rows of [rows, D] in the input dtype."""
    r = tl.program_id(0).to(tl.int64) * RB + tl.arange(0, RB)
    d = tl.arange(0, D)
    ok = r < rows
    off = r[:, None] * D + d[None, :]
    x = tl.load(DO + off, mask=ok[:, None], other=0.0).to(tl.float32)
    y = tl.load(O + off, mask=ok[:, None], other=0.0).to(tl.float32)
    tl.store(DELTA + r, tl.sum(x * y, 1), mask=ok)
