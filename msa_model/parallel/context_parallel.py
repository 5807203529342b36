"""Context parallelism (CP) for MSA: the sequence split over `cp` ranks.

Layout (megatron's load balancing for causal attention): the sequence is cut into 2*cp equal
chunks and rank r holds chunks r and 2*cp-1-r, so every rank has the same amount of causal work.
A rank's activations are the concatenation of its two chunks, [S/cp, ...].

An MSA layer on a CP rank keeps its own queries (q, iq) and all-gathers what selection and
attention read over the whole causal prefix: k, v ([S, B, Hkv, D]) and the shared index key
([S, B, Di]). With few KV heads these are small next to the queries (docs/parallelism.md has the
byte counts). The gather's backward reduce-scatters the key gradients to their owners. Each local
chunk then runs the ops with `q_offset` = its first position, so selection, outputs and the KL are
those of the unsplit sequence.

S = tokens of the whole sequence, L = S / (2 * cp) tokens per chunk, B = batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def chunk_ids(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two chunks (of 2*cp) that rank `cp_rank` holds, in the order they are stored."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def local_query_chunks(local_len: int, cp_rank: int, cp_size: int) -> list[tuple[int, int, int]]:
    """[(start, end, q_offset)] of this rank's chunks: rows start:end of its local tensors are the
    sequence positions q_offset .. q_offset + end - start - 1. One chunk (0, S, 0) without CP."""
    if cp_size == 1:
        return [(0, local_len, 0)]
    L = local_len // 2
    return [(i * L, (i + 1) * L, c * L) for i, c in enumerate(chunk_ids(cp_rank, cp_size))]


def slice_for_cp(t: torch.Tensor, dim: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """This rank's two chunks of `t` along `dim` (whose length must divide by 2 * cp), concatenated."""
    if cp_size == 1:
        return t
    n = t.shape[dim]
    if n % (2 * cp_size):
        raise ValueError(f"sequence length {n} is not a multiple of 2 * cp = {2 * cp_size}")
    chunks = t.chunk(2 * cp_size, dim=dim)
    return torch.cat([chunks[c] for c in chunk_ids(cp_rank, cp_size)], dim=dim)


def slice_batch_for_cp(batch: dict, cp_rank: int, cp_size: int) -> dict:
    """A micro-batch of [B, S] tensors (tokens, labels, loss_mask, position_ids) cut to this
    rank's [B, S / cp] columns; other entries pass through."""
    if cp_size == 1:
        return batch
    return {k: slice_for_cp(v, 1, cp_rank, cp_size) if torch.is_tensor(v) and v.dim() == 2 else v
            for k, v in batch.items()}


def _natural_order(cp_size: int) -> list[int]:
    """Gathered rows are rank-major (rank r: chunks r, 2cp-1-r); chunk c sits at slot order[c]."""
    slot = {}
    for r in range(cp_size):
        for i, c in enumerate(chunk_ids(r, cp_size)):
            slot[c] = 2 * r + i
    return [slot[c] for c in range(2 * cp_size)]


class _GatherSequence(torch.autograd.Function):
    """[S/cp, ...] local rows -> [S, ...] in sequence order; backward: reduce-scatter (sum)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        cp = dist.get_world_size(group)
        x = x.contiguous()
        out = torch.empty((cp * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x, group=group)
        slots = out.chunk(2 * cp, dim=0)
        return torch.cat([slots[s] for s in _natural_order(cp)], dim=0)

    @staticmethod
    def backward(ctx, grad):
        group = ctx.group
        cp = dist.get_world_size(group)
        chunks = grad.chunk(2 * cp, dim=0)
        # back to the rank-major layout, then sum every rank's contribution into the owner
        by_slot = [None] * (2 * cp)
        for c, s in enumerate(_natural_order(cp)):
            by_slot[s] = chunks[c]
        rank_major = torch.cat(by_slot, dim=0).contiguous()
        out = torch.empty((rank_major.shape[0] // cp, *rank_major.shape[1:]), dtype=grad.dtype, device=grad.device)
        dist.reduce_scatter_tensor(out, rank_major, group=group)
        return out, None


def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """All-gather a CP rank's [S/cp, ...] rows (dim 0 = sequence) into the whole sequence
    [S, ...] in position order. Differentiable: each rank receives the sum of all ranks'
    gradients for its own rows. Identity without CP."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _GatherSequence.apply(x, group)
