"""The inverse (key block -> queries) index that the key-outer kernels walk, its schedule, and the
key blocks of packed documents.

sparse_attention and indexer_kl both read each selected key block once and gather the queries
that selected it. Each `(query, group, slot)` naming a block is an *entry*; entries are grouped by
*bucket* `(query chunk, b, g, n)`, and a *work item* (one program) is a run of at most
`per_program` entries of one bucket. Plain torch, no host synchronisation: tile lists are sized
by an upper bound, and spare programs exit.

Packed documents (`doc_start`): a query's block ids count from its document's first token, so
the same id names different keys in different documents. The key blocks of a row's documents
are then listed in a table (`DocumentBlocks`), one entry per (document, document-relative block)
with the block's first and last key, and buckets name table entries instead of block ids: the
kernels read "the keys start .. end - 1" where without documents they read block n's keys,
start = n * block_size. Documents share no keys, so the table's blocks never overlap.

B = batch, T = queries (query t at position q_offset + t), G = groups, K = top-k slots,
N = key blocks, E = entries (B*T*G*K), S = query chunks, P = programs per chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..common import TABLE_SIZES, host_copy
from .reference import clean_block_idx_reference, schedule_reference


@triton.jit
def clean_kernel(IDX, OUT, DOC, rows, T, QOFF, HKV: tl.constexpr, SLOTS: tl.constexpr, KP: tl.constexpr,
                 BS: tl.constexpr, RB: tl.constexpr, DOCS: tl.constexpr):
    """RB rows (b, t, g) of `clean_block_idx_reference`: each row's ids, those without a causal
    key made -1, sorted (slots past K sort last and are not stored); an id equal to the one
    before it becomes -1."""
    r = tl.program_id(0).to(tl.int64) * RB + tl.arange(0, RB)  # ((b*T + t)*G + g)
    row_ok = r < rows
    slot = tl.arange(0, KP)
    ok = row_ok[:, None] & (slot < SLOTS)[None, :]
    x = tl.load(IDX + r[:, None] * SLOTS + slot[None, :], mask=ok, other=2147483647).to(tl.int32)
    pos = QOFF + ((r // HKV) % T).to(tl.int32)
    if DOCS:
        pos -= tl.load(DOC + r // HKV, mask=row_ok, other=0).to(tl.int32)
    local = tl.where(pos >= 0, pos // BS, -1)  # floor division, as the reference's (a query before its start: none)
    v = tl.where(((x < 0) | (x > local[:, None])) & (slot < SLOTS)[None, :], -1, x)
    s = tl.sort(v, 1)
    prev = tl.gather(s, tl.broadcast_to(tl.maximum(slot - 1, 0)[None, :], (RB, KP)), 1)
    tl.store(OUT + r[:, None] * SLOTS + slot[None, :], tl.where((slot[None, :] > 0) & (s == prev), -1, s), mask=ok)


def clean_block_idx_triton(block_idx_BTGK: torch.Tensor, block_size: int, q_offset: int = 0,
                           doc_start_BT: torch.Tensor | None = None) -> torch.Tensor:
    """`clean_block_idx_reference` in one Triton kernel."""
    B, T, G, K = block_idx_BTGK.shape
    idx = block_idx_BTGK.contiguous()
    out = torch.empty(B, T, G, K, dtype=torch.int32, device=idx.device)
    rows = B * T * G
    RB = 32  # rows a program: the fastest of those tried on an H200
    if rows:
        doc = idx if doc_start_BT is None else doc_start_BT.contiguous()
        clean_kernel[(triton.cdiv(rows, RB),)](idx, out, doc, rows, T, q_offset, HKV=G, SLOTS=K,
                                               KP=triton.next_power_of_2(K), BS=block_size, RB=RB,
                                               DOCS=doc_start_BT is not None, num_warps=4)
    return out


def clean_block_idx(block_idx_BTGK: torch.Tensor, block_size: int, q_offset: int = 0,
                    doc_start_BT: torch.Tensor | None = None) -> torch.Tensor:
    """The cleaned block ids (`clean_block_idx_reference`): the kernel on GPU tensors, the
    reference elsewhere (the kernel's sort is slow in Triton's interpreter: CPU tests run it on
    small shapes only)."""
    return (clean_block_idx_triton if block_idx_BTGK.is_cuda else clean_block_idx_reference)(
        block_idx_BTGK, block_size, q_offset, doc_start_BT)


@dataclass
class InverseIndex:
    """Entries grouped by bucket (query chunk, b, g, n), bucket id ((chunk*B + b)*G + g)*N + n;
    chunk = t // chunk_size (one chunk: chunk_size = T).

    entry: int32 [E] triple ids ((b*T + t)*G + g)*K + slot, sorted by block (b, g, n), then by
    query; so a block's entries of one chunk are a run, and its runs of all chunks are one run.
    start, count: int64 [n_chunks*B*G*N] each bucket's range in `entry`.
    block_start, block_count: int64 [B*G*N] each block's range over all chunks (`whole`).
    """

    entry: torch.Tensor
    start: torch.Tensor
    count: torch.Tensor
    n_blocks: int
    n_chunks: int = 1
    chunk_size: int = 0  # queries per chunk (the last may have fewer)
    chunk_entries: int = 0  # entries of a whole chunk, B*chunk_size*G*K (an upper bound per chunk)
    block_start: torch.Tensor | None = None
    block_count: torch.Tensor | None = None

    def whole(self) -> InverseIndex:
        """The same entries as one chunk of every query (what the KL's kernels walk: they need no
        chunks), without another sort."""
        if self.n_chunks == 1:
            return self
        E = self.entry.numel()
        # entries per query, B*G*K, are chunk_entries / chunk_size
        T = E * self.chunk_size // self.chunk_entries
        return InverseIndex(self.entry, self.block_start, self.block_count, self.n_blocks, 1, T, E,
                            self.block_start, self.block_count)


@dataclass
class DocumentBlocks:
    """The key blocks of packed documents, for the queries of one call.

    Each row's documents (those its queries belong to) list their blocks in order: document d,
    starting at position s, has blocks n = 0 .. (last query of d - s) // block_size, keys
    s + n*block_size .. min(s + (n+1)*block_size, end of d) - 1.

    base: int32 [B, T] table id of block 0 of query t's document (its block n is base + n).
    start, end: int32 [B, N] first and one-past-last key position of each table block; ids past a
    row's last block have start = end = 0 (no keys).
    n_blocks: N, the longest row's block count.
    """

    base: torch.Tensor
    start: torch.Tensor
    end: torch.Tensor
    n_blocks: int


def _running_blocks(doc_start_BT: torch.Tensor, block_size: int, q_offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ends, counts) int64 [B, T]: at each document's last query its block count (0 elsewhere),
    and their running sum along the row (ends[:, -1]: the row's table size)."""
    B, T = doc_start_BT.shape
    s_BT = doc_start_BT.long()
    pos_T = torch.arange(q_offset, q_offset + T, device=doc_start_BT.device)
    last_BT = torch.ones(B, T, dtype=torch.bool, device=doc_start_BT.device)
    last_BT[:, :-1] = s_BT[:, 1:] != s_BT[:, :-1]
    nblk_BT = torch.where(last_BT, (pos_T - s_BT) // block_size + 1, 0)
    return torch.cumsum(nblk_BT, 1), nblk_BT


def table_size(doc_start_BT: torch.Tensor, block_size: int, q_offset: int = 0,
               ends_BT: torch.Tensor | None = None) -> int:
    """N of `document_blocks`: the longest row's block count. From the host copy the trainer
    attaches (msa_model.ops.common.attach_host_copy) when there is one, computed once and cached
    on the tensor (every layer gets the micro-batch's); else read back from the device: one
    synchronisation (of `ends_BT`, the device's running block counts, when the caller has them)."""
    if doc_start_BT.shape[1] == 0:
        return 0
    key = (block_size, q_offset)
    cache = getattr(doc_start_BT, TABLE_SIZES, None)
    if cache is not None and key in cache:
        return cache[key]
    host = host_copy(doc_start_BT)
    if host is None:
        if ends_BT is None:
            ends_BT = _running_blocks(doc_start_BT, block_size, q_offset)[0]
        return int(ends_BT[:, -1].max())
    return reserve_table(doc_start_BT, block_size, int(_running_blocks(host, block_size, q_offset)[0][:, -1].max()),
                         q_offset)


def reserve_table(doc_start_BT: torch.Tensor, block_size: int, n: int, q_offset: int = 0) -> int:
    """Fix the table size the ops use for this tensor at n, whatever starts it holds later, as long
    as they need at most n blocks a row (a row's entries past its own are empty: no keys). For a
    CUDA graph's static starts, whose table shapes stay those of the capture; their query chunks
    and int32 copies keep it (msa_model.ops.common.doc_rows, as_int32). Returns n."""
    cache = getattr(doc_start_BT, TABLE_SIZES, None)
    if cache is None:
        cache = {}
        setattr(doc_start_BT, TABLE_SIZES, cache)
    cache[(block_size, q_offset)] = n
    return n


def document_blocks(doc_start_BT: torch.Tensor, block_size: int, q_offset: int = 0) -> DocumentBlocks:
    """The block table of doc_start int [B, T] (query t at position q_offset + t). Its size comes
    from `table_size`: no synchronisation when doc_start carries its host copy, else one."""
    B, T = doc_start_BT.shape
    dev = doc_start_BT.device
    s_BT = doc_start_BT.long()
    ends_BT, nblk_BT = _running_blocks(doc_start_BT, block_size, q_offset)
    base_BT = ends_BT - nblk_BT
    n = table_size(doc_start_BT, block_size, q_offset, ends_BT)
    m_BN = torch.arange(n, device=dev).expand(B, n).contiguous()
    # the document holding table block m ends at the first query whose running count exceeds m
    t_BN = torch.searchsorted(ends_BT, m_BN, right=True)
    used_BN = t_BN < T
    t_BN = t_BN.clamp(max=max(T - 1, 0))
    start_BN = s_BT.gather(1, t_BN) + (m_BN - base_BT.gather(1, t_BN)) * block_size
    end_BN = torch.minimum(start_BN + block_size, q_offset + t_BN + 1)
    zero = torch.zeros_like(start_BN)
    return DocumentBlocks(base_BT.to(torch.int32), torch.where(used_BN, start_BN, zero).to(torch.int32).contiguous(),
                          torch.where(used_BN, end_BN, zero).to(torch.int32).contiguous(), n)


def query_ends(doc_start_BT: torch.Tensor, TK: int, tile: int) -> torch.Tensor:
    """int32 [B, cdiv(TK, tile)]: for each key tile of `tile` keys, the first query whose document
    starts after the tile's last key; it and later queries cannot see the tile (dense kernels
    that loop over queries per key tile stop there). doc_start int32 [B, T], non-decreasing."""
    last = (torch.arange(triton.cdiv(TK, tile), device=doc_start_BT.device) + 1) * tile - 1
    last = last.clamp(max=TK - 1).to(doc_start_BT.dtype).expand(doc_start_BT.shape[0], -1).contiguous()
    return torch.searchsorted(doc_start_BT, last, right=True).to(torch.int32).contiguous()


def build_inverse_index(idx_BTGK: torch.Tensor, n_blocks: int, chunk_size: int = 0,
                        base_BT: torch.Tensor | None = None) -> InverseIndex:
    """Inverse (block -> queries) index of a cleaned block_idx (see `clean_block_idx`), bucketed
    per chunk of `chunk_size` queries (0: one chunk). One sort serves every chunk (a chunk costs
    its launches alone) and the unchunked view (`InverseIndex.whole`). With packed documents
    `base_BT` (`DocumentBlocks.base`) turns document-relative ids into table ids, and n_blocks is
    the table's size."""
    B, T, G, K = idx_BTGK.shape
    chunk_size = T if chunk_size <= 0 else min(chunk_size, T)
    S = triton.cdiv(T, chunk_size)
    nb = B * G * n_blocks
    dev = idx_BTGK.device
    # an entry's key is its bucket in block-major order, ((b*G + g)*N + n)*S + chunk, so that one
    # stable sort orders entries by block, then chunk, then query (a block's runs of all chunks
    # are one run), and the bounds are one binary search (no key derived after the sort); empty
    # slots take the key after every bucket. The narrowest keys that hold them: the radix sort's
    # passes go with the key's bits (8M keys: 0.27 ms at 16 bits, 0.44 at 32, 0.85 at 64); 16-bit
    # keys count from -32768.
    n_keys = nb * S + 1
    wide = torch.int32 if n_keys < 2**31 else torch.int64
    narrow, low = (torch.int16, -(2**15)) if n_keys <= 2**16 else (wide, 0)
    # the key of block 0 of (b, t's chunk, g), [B, 1 or T, G, 1]; few launches: short calls are
    # bound by issuing them
    first = torch.arange(B * G, device=dev, dtype=wide).view(B, 1, G, 1) * (n_blocks * S) + low
    if base_BT is not None:
        first = first + base_BT[:, :, None, None].to(wide) * S
    if S > 1:
        first = first + (torch.arange(T, device=dev, dtype=wide) // chunk_size)[None, :, None, None]
    key = torch.where(idx_BTGK >= 0, first + (idx_BTGK.to(wide) * S if S > 1 else idx_BTGK), nb * S + low)
    # stable: the flat order is query-major, so each bucket lists its queries in order
    key_sorted, entry = torch.sort(key.flatten().to(narrow), stable=True)
    # ranges by binary search (a histogram would serialise on the atomics of popular blocks)
    bounds = torch.searchsorted(key_sorted, torch.arange(low, low + n_keys, device=dev, dtype=narrow))
    start = bounds[:-1].view(nb, S).t().flatten()
    count = (bounds[1:] - bounds[:-1]).view(nb, S).t().flatten()
    block_start = bounds[:-1:S]
    block_count = bounds[S::S] - block_start
    return InverseIndex(entry.to(torch.int32), start, count, n_blocks, S, chunk_size, B * chunk_size * G * K,
                        block_start, block_count)


def schedule(index: InverseIndex, per_program: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split every bucket into runs of at most `per_program` entries, one per program: int32
    (bucket, start, count), each [n_chunks, P] (`schedule_reference` defines them). CUDA tensors
    take one kernel for what the definition issues as 29 small torch kernels (host time:
    short calls are bound by it), CPU tensors the definition."""
    if index.count.is_cuda:
        return schedule_triton(index, per_program)
    return schedule_reference(index, per_program)


@triton.jit
def schedule_kernel(ENDS, RUNS, START, COUNT, OB, OS, OC, NB, PER_CHUNK, P, PER_PROGRAM, STEPS: tl.constexpr,
                    BLOCK: tl.constexpr):
    """Programs p of chunk s (grid: P / BLOCK, S): run r = (the chunk's first run) + p, its bucket
    by binary search of r in the runs' inclusive ends (searchsorted right), as the definition."""
    s = tl.program_id(1)
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    pm = p < P
    c0 = s * PER_CHUNK
    first = tl.load(ENDS + c0 - 1, mask=c0 > 0, other=0)
    last = tl.load(ENDS + c0 + PER_CHUNK - 1)
    run = first + p
    lo = tl.zeros([BLOCK], tl.int32)
    hi = tl.zeros([BLOCK], tl.int32) + NB
    for _ in tl.static_range(STEPS):
        active = lo < hi
        mid = (lo + hi) // 2
        e = tl.load(ENDS + mid, mask=active, other=0)
        right = active & (e <= run)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(active & (e > run), mid, hi)
    bucket = tl.minimum(lo, NB - 1)
    runs = tl.load(RUNS + bucket)
    within = run - (tl.load(ENDS + bucket) - runs)
    start = tl.load(START + bucket) + within * PER_PROGRAM
    count = tl.minimum(tl.maximum(tl.load(COUNT + bucket) - within * PER_PROGRAM, 0), PER_PROGRAM)
    local = tl.where(run < last, bucket - c0, -1)
    out = s.to(tl.int64) * P + p
    tl.store(OB + out, local.to(tl.int32), mask=pm)
    tl.store(OS + out, start.to(tl.int32), mask=pm)
    tl.store(OC + out, count.to(tl.int32), mask=pm)


def schedule_triton(index: InverseIndex, per_program: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`schedule_reference` with the runs' placement in one kernel (the runs and their cumulative
    sum stay torch's)."""
    S = index.n_chunks
    nb = index.count.numel()
    runs = (index.count + per_program - 1) // per_program
    ends = torch.cumsum(runs, 0)
    P = triton.cdiv(max(index.chunk_entries, 1), per_program) + nb // S
    out = torch.empty(3, S, P, dtype=torch.int32, device=runs.device)
    BLOCK = 256
    # contiguous: `InverseIndex.whole()` views every S-th bound of a chunked index
    start, count = index.start.contiguous(), index.count.contiguous()
    schedule_kernel[(triton.cdiv(P, BLOCK), S)](ends, runs, start, count, out[0], out[1], out[2], nb,
                                                 nb // S, P, per_program, STEPS=max(1, nb.bit_length()) + 1,
                                                 BLOCK=BLOCK)
    return out[0], out[1], out[2]


@triton.jit
def decode_bucket(bucket, N, G: tl.constexpr):
    """(b, g, n) of a chunk's bucket id (b*G + g)*N + n."""
    n = bucket % N
    g = (bucket // N) % G
    b = bucket // (N * G)
    return b, g, n
