"""The inverse (key block -> queries) index that the key-outer kernels walk, and its schedule.

sparse_attention and indexer_kl both read each selected key block once and gather the queries
that selected it. Each `(query, group, slot)` naming a block is an *entry*; entries are sorted by
*bucket* `(query chunk, b, g, n)`, and a *work item* (one program) is a run of at most
`per_program` entries of one bucket. Plain torch, no host synchronisation: tile lists are sized
by an upper bound, and spare programs exit.

B = batch, T = queries (query t at position q_offset + t), G = groups, K = top-k slots,
N = key blocks, E = entries (B*T*G*K), S = query chunks, P = programs per chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


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


@triton.jit
def decode_bucket(bucket, N, G: tl.constexpr):
    """(b, g, n) of a chunk's bucket id (b*G + g)*N + n."""
    n = bucket % N
    g = (bucket // N) % G
    b = bucket // (N * G)
    return b, g, n
