"""Readable PyTorch reference of the main branch: exact softmax attention over the selected blocks.

Memory-bounded: queries are processed in chunks, so no [T, T] tensor ever exists, and the
backward recomputes probabilities chunk by chunk from the saved log-sum-exp (as flash attention
does) instead of keeping them.

B = batch, T = tokens, C = queries in a chunk, G = groups (Hkv), H = heads per group, D = head
dim, J = keys of the chunk's causal range, K = top-k blocks.

Also the definitions of the index pieces the Triton paths build on the device: the cleaned block
ids (`clean_block_idx_reference`), the schedule of the inverse index (`schedule_reference`) and
each query tile's union of blocks (`tile_union_reference`); their kernels compute the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..common import query_chunk
from ..support import support_mask

if TYPE_CHECKING:
    from .inverse_index import DocumentBlocks, InverseIndex


def _chunks(T: int, heads: int, q_offset: int = 0):
    step = query_chunk(q_offset + T, heads)
    for t0 in range(0, T, step):
        yield t0, min(T, t0 + step)


def _scores(q_BCGHD, k_BJGD, mask_BCGJ, scale, cdt):
    """Scaled logits [B, C, G, H, J] (fp32, fp64 for fp64 inputs), -inf off the support; the
    matmul runs in `cdt`."""
    acc = torch.promote_types(cdt, torch.float32)
    s = torch.einsum("bcghd,bjgd->bcghj", q_BCGHD.to(cdt), k_BJGD.to(cdt)).to(acc) * scale
    return s.masked_fill(~mask_BCGJ[:, :, :, None, :], float("-inf"))


def _exp_minus(s, lse):
    """exp(s - lse), where an empty support (lse = -inf, every s = -inf) gives zeros, not NaN."""
    return torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])


E4M3_MAX = 448.0


def e4m3_round(x: torch.Tensor) -> torch.Tensor:
    """x (fp32, 0 <= x <= 448) rounded to the nearest float8 e4m3 value, ties to even (what
    `x.to(torch.float8_e4m3fn)` gives), as fp32 arithmetic: the kernels' `triton_utils.e4m3_round`."""
    x = x.float()
    e = ((x.view(torch.int32) >> 23) & 0xFF) - 127
    step = torch.ldexp(torch.ones_like(x), e.clamp(min=-6) - 3)
    return torch.round(x / step) * step


def fp8_probabilities(s, lse, block_size, t0, t1, key_end, q_offset=0, doc_start=None):
    """The forward's probabilities with fp8_probs: exp(s - m) stored as e4m3 of its value x 448,
    m the max of the query's scores over each key block, then times exp(m - lse) / 448. s [B, C,
    G, H, J] (-inf off the support), lse [B, C, G, H]; blocks as the selection numbers them (from
    the document's start with doc_start). Their sum is not exactly 1: the output uses them, the
    gradients the exact softmax (straight-through)."""
    pos_J = torch.arange(key_end, device=s.device)
    if doc_start is None:
        block = (pos_J // block_size)[None, None, :]
    else:
        block = (pos_J[None, None, :] - doc_start[:, t0:t1, None].long()).clamp(min=0) // block_size
    n_blk = key_end // block_size + 2
    index = block[:, :, None, None, :].expand_as(s)
    m_blk = torch.full((*s.shape[:-1], n_blk), float("-inf"), dtype=s.dtype, device=s.device)
    m_key = m_blk.scatter_reduce(-1, index, s, "amax").gather(-1, index)
    m_key = torch.where(torch.isinf(m_key), torch.zeros_like(m_key), m_key)
    unnorm = torch.exp(s - m_key)
    lse_safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None]
    return e4m3_round(unnorm * E4M3_MAX).to(s.dtype) * (torch.exp(m_key - lse_safe) / E4M3_MAX)


def sparse_attention_forward(q, k, v, block_idx, block_size, scale, upcast=True, q_offset=0, doc_start=None,
                             fp8_probs=False):
    """Returns o [B,T,Hq,D] (q.dtype) and lse [B,T,Hq] (fp32; fp64 for fp64 inputs).

    Query t sits at position q_offset + t; k, v hold at least q_offset + T keys; doc_start
    (int [B, T] or None) restricts each query to its document (see `support_mask`). fp8_probs:
    o from `fp8_probabilities` (lse stays the exact one)."""
    B, T, Hq, D = q.shape
    G = k.shape[2]
    H = Hq // G
    acc = torch.promote_types(q.dtype, torch.float32)
    cdt = acc if upcast else q.dtype
    o = torch.empty_like(q)
    lse = torch.empty(B, T, Hq, dtype=acc, device=q.device)
    q5 = q.view(B, T, G, H, D)
    for t0, t1 in _chunks(T, Hq, q_offset):
        e = q_offset + t1
        mask = support_mask(block_idx, t0, t1, e, block_size, G, B, q.device, q_offset, doc_start)
        s = _scores(q5[:, t0:t1], k[:, :e], mask, scale, cdt)
        lse_c = torch.logsumexp(s, dim=-1)
        if fp8_probs:
            p = fp8_probabilities(s, lse_c, block_size, t0, t1, e, q_offset, doc_start)
        else:
            p = _exp_minus(s, lse_c)
        o_c = torch.einsum("bcghj,bjgd->bcghd", p.to(cdt), v[:, :e].to(cdt))
        o[:, t0:t1] = o_c.reshape(B, t1 - t0, Hq, D).to(q.dtype)
        lse[:, t0:t1] = lse_c.reshape(B, t1 - t0, Hq)
    return o, lse


def sparse_attention_backward(do, q, k, v, o, lse, block_idx, block_size, scale, upcast=True, q_offset=0,
                              doc_start=None, fp8_probs=False):
    """Gradients (dq, dk, dv) of `sparse_attention_forward`, recomputing probabilities per chunk.
    With fp8_probs straight through: dv from the fp8 probabilities the output used, dq and dk
    from the exact softmax (its correction term sum_j p_j dp_j from the exact p as well, not from
    the output)."""
    B, T, Hq, D = q.shape
    G = k.shape[2]
    H = Hq // G
    acc = torch.promote_types(q.dtype, torch.float32)
    cdt = acc if upcast else q.dtype
    dq = torch.empty_like(q)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    q5, do5 = q.view(B, T, G, H, D), do.view(B, T, G, H, D)
    # delta = rowsum(dO * O): the softmax backward's correction term, per query head
    delta = (do.to(acc) * o.to(acc)).sum(-1).view(B, T, G, H)
    lse5 = lse.view(B, T, G, H)
    for t0, t1 in _chunks(T, Hq, q_offset):
        e = q_offset + t1
        mask = support_mask(block_idx, t0, t1, e, block_size, G, B, q.device, q_offset, doc_start)
        s = _scores(q5[:, t0:t1], k[:, :e], mask, scale, cdt)
        p = _exp_minus(s, lse5[:, t0:t1])
        do_c = do5[:, t0:t1].to(cdt)
        dp = torch.einsum("bcghd,bjgd->bcghj", do_c, v[:, :e].to(cdt)).to(acc)
        delta_c = delta[:, t0:t1]
        p_out = p
        if fp8_probs:
            delta_c = (p * dp).sum(-1)
            p_out = fp8_probabilities(s, lse5[:, t0:t1], block_size, t0, t1, e, q_offset, doc_start)
        ds = p * (dp - delta_c[..., None])
        dq_c = torch.einsum("bcghj,bjgd->bcghd", ds.to(cdt), k[:, :e].to(cdt)).to(acc) * scale
        dq[:, t0:t1] = dq_c.reshape(B, t1 - t0, Hq, D).to(q.dtype)
        dk[:, :e] += torch.einsum("bcghj,bcghd->bjgd", ds.to(cdt), q5[:, t0:t1].to(cdt)).to(acc) * scale
        dv[:, :e] += torch.einsum("bcghj,bcghd->bjgd", p_out.to(cdt), do_c).to(acc)
    return dq, dk.to(k.dtype), dv.to(v.dtype)


class SparseAttentionReference(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, block_idx, block_size, scale, upcast, q_offset, doc_start, fp8_probs):
        o, lse = sparse_attention_forward(q, k, v, block_idx, block_size, scale, upcast, q_offset, doc_start,
                                          fp8_probs)
        ctx.save_for_backward(q, k, v, o, lse, block_idx, doc_start)
        ctx.args = (block_size, scale, upcast, q_offset)
        ctx.fp8_probs = fp8_probs
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse, block_idx, doc_start = ctx.saved_tensors
        dq, dk, dv = sparse_attention_backward(do.contiguous(), q, k, v, o, lse, block_idx, *ctx.args,
                                               doc_start=doc_start, fp8_probs=ctx.fp8_probs)
        return dq, dk, dv, None, None, None, None, None, None, None


def sparse_attention_reference(q, k, v, block_idx, block_size, scale, upcast=True, q_offset=0, doc_start=None,
                               fp8_probs=False):
    """Autograd entry of the reference. `upcast=False` does the matmuls in the input dtype, as
    plain PyTorch code in bf16 would (the yardstick for kernel error budgets). Query t sits at
    position q_offset + t of the keys; doc_start int [B, T] keeps each query in its document.
    fp8_probs: the output from probabilities stored as float8 e4m3 (`fp8_probabilities`), the
    gradients straight through them (`sparse_attention_backward`)."""
    return SparseAttentionReference.apply(q, k, v, block_idx, block_size, scale, upcast, q_offset, doc_start,
                                          fp8_probs)


@dataclass
class TileUnion:
    """Each query tile's union of selected blocks (the tile path, tiles.py).

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


def table_ids(idx: torch.Tensor, docs: DocumentBlocks | None) -> torch.Tensor:
    """int32 [B, T, G, K] contiguous: the cleaned ids, with packed documents as table ids."""
    ids = idx if docs is None else torch.where(idx >= 0, idx + docs.base[:, :, None, None], -1)
    return ids.to(torch.int32).contiguous()


def tile_union_reference(idx: torch.Tensor, queries: int, docs: DocumentBlocks | None = None) -> TileUnion:
    """The union of each tile of `queries` consecutive queries' blocks, per (b, g), the blocks
    every query selected first (the definition, in torch: one segmented sort of [B, G, NT, QT*K]
    and a compaction by prefix sums; `tile_union_triton` is its kernel)."""
    B, T, G, K = idx.shape
    ids = table_ids(idx, docs)
    NT = -(-T // queries)
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


def clean_block_idx_reference(block_idx_BTGK: torch.Tensor, block_size: int, q_offset: int = 0,
                              doc_start_BT: torch.Tensor | None = None) -> torch.Tensor:
    """int32 [B, T, G, K] with set semantics made explicit: slots that repeat a block, name a block
    after the query's own (no causal key) or hold -1 become -1; the rest are sorted ascending
    (a row is sorted, then each repeat of the previous slot becomes -1).
    Query t sits at position q_offset + t; with doc_start its blocks count from its document's start.
    The definition; `clean_block_idx_triton` computes the same with one Triton kernel."""
    B, T = block_idx_BTGK.shape[:2]
    idx = block_idx_BTGK.to(torch.int32)
    pos_T = torch.arange(q_offset, q_offset + T, device=idx.device, dtype=torch.int32)
    if doc_start_BT is None:
        local_T = (pos_T // block_size)[None, :, None, None]
    else:
        local_T = ((pos_T[None, :] - doc_start_BT.to(torch.int32)) // block_size)[:, :, None, None]
    idx = torch.where((idx < 0) | (idx > local_T), -1, idx)
    idx, _ = idx.sort(dim=-1)
    dup = torch.zeros_like(idx, dtype=torch.bool)
    dup[..., 1:] = idx[..., 1:] == idx[..., :-1]
    return torch.where(dup, -1, idx).contiguous()


def schedule_reference(index: InverseIndex, per_program: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split every bucket into runs of at most `per_program` entries, one per program.

    Returns int32 (bucket, start, count), each [n_chunks, P]: row c holds chunk c's programs, P an
    upper bound (no host synchronisation), bucket the chunk's own bucket id (b*G + g)*N + n, or -1
    for spare programs. Runs of one bucket are consecutive. The definition (29 torch kernels);
    `schedule_triton` computes the same in one kernel.
    """
    S = index.n_chunks
    nb = index.count.numel()
    per_chunk = nb // S
    runs = (index.count + per_program - 1) // per_program
    ends = torch.cumsum(runs, 0)
    P = -(-max(index.chunk_entries, 1) // per_program) + per_chunk
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
