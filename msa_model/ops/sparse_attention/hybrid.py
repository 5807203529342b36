"""The hybrid forward of sparse attention: each query tile on the path that suits its union of
blocks, the tile path (tiles.py) for tiles whose queries share most of their blocks, the gather
path (gather.py) for the others, decided per tile on the device. Its backward is the gather path's.

B = batch, T = queries, G = key/value heads (groups), K = top-k slots, NT = query tiles,
QT = queries per tile.
"""

from __future__ import annotations

import contextlib

import torch

from .gather import sparse_forward
from .inverse_index import DocumentBlocks
from .reference import TileUnion
from .shared import forward_partials, index_of_every_entry
from .tiles import tile_forward
from .tuning import DEFAULT_TUNING, Tuning


# process-wide state: one second stream per device index, created by the first hybrid forward on
# that device and kept for the process's life (a stream per call would cost a creation each, and
# the stream's cached allocations are reused by the next call); nothing else writes it
SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The device's second stream, of a higher priority than the default one, for the hybrid's
    gather pass beside the tile kernel: its short dependent launches take the SMs as the tile
    kernel's programs leave them."""
    key = torch.cuda.current_device() if device.index is None else device.index
    if key not in SIDE_STREAMS:
        SIDE_STREAMS[key] = torch.cuda.Stream(device=key, priority=-1)
    return SIDE_STREAMS[key]


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
    partials = forward_partials(idx.shape, H, D, q.dtype, q.device, tuning)
    side = side_stream(q.device) if q.is_cuda else None
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
    index = index_of_every_entry(q, k, idx, docs, block_size, tuning) if with_index else None
    if side is not None:
        main.wait_stream(side)
    return o, lse, index
