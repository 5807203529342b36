"""The launch settings of sparse_attention's Triton kernels (`Tuning`), apart from the kernels so
that a configuration can name and check them without loading Triton."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tuning:
    """Launch shapes of the kernels. rows = gathered query heads per tile (query tokens x the
    group's heads); a work item (one program) is `*_tiles` tiles of one bucket, so a key/value
    block is loaded once per item and a popular block (the sink, the local block) spreads over
    programs. `dense_dkdv` is (query tile, key tile, warps, stages) of the dense dK/dV kernel. The
    partial buffers' budget is `partial_q_ratio` x the bytes of q, at least `partial_min_bytes`, at
    most `partial_bytes` (see `sparse_index`). Chosen by bench/bench_sparse_attention.py --parts
    tune on an H200: single-stage loops beat 2-3 stages in both kernels, 64-row tiles of 4
    warps beat 128 rows of 8 in the forward."""

    fwd_rows: int = 64
    fwd_warps: int = 4
    fwd_stages: int = 1
    fwd_tiles: int = 16
    bwd_rows: int = 64
    bwd_warps: int = 8
    bwd_stages: int = 1
    bwd_tiles: int = 128
    # the gather backward as a loader/MMA Gluon kernel (gluon_backward.py) where its geometry
    # allows (bf16, head dim 128, 128-key blocks, 64-row tiles, sm_90), with `bwd_gluon_stages`
    # tiles in its shared-memory ring; off by default until a training run has measured it
    bwd_gluon: bool = False
    bwd_gluon_stages: int = 3
    # the gather kernels' row offsets in int32 where every one fits (`shared.narrow_offsets`)
    narrow_offsets: bool = True
    dense_dkdv: tuple = (128, 64, 8, 2)
    # queries a forward combine program merges (a power of two): of the gather path alone, and of
    # the hybrid's gathered tiles, where a program none of whose queries is gathered exits (the
    # fastest on an H200: fewer programs, each still with its fp32 accumulator in registers)
    combine_queries: int = 2
    combine_queries_rows: int = 4
    partial_bytes: int = 4 << 30
    partial_q_ratio: float = 2.0
    partial_min_bytes: int = 3 << 30
    # The tile-union path (tiles.py). tile_rows: matrix rows per tile, queries x the group's
    # heads (0: the gather path only). It is taken by calls of at least `tile_min_queries` queries
    # whose groups have at least `tile_min_heads` heads (fewer heads: the gather path was as fast
    # or faster, since a tile of 128 rows then holds 32 queries, whose union is larger; from 8K
    # queries the hybrid is level with it on random selections and faster on shared ones), and
    # there, in the forward, by each tile whose union holds at most `tile_union_max` x K blocks (the
    # others' queries are gathered). tile_keys: the forward's keys per step; tile_warps: the
    # query-outer kernels' warps; tile_stages, tile_masked_stages: the forward's pipeline stages
    # over the blocks every row reads whole and over the others (two loops, each pipelined, beat a
    # branch per step in one loop). The backward is the gather path's unless `tile_backward` (then,
    # for heads up to 128 wide, every tile takes the tile path both ways, with `tile_dkdv_tiles`
    # tiles per dK/dV work item, and `tile_dq_keys` keys a step in `tile_dq_stages` in the dQ
    # kernel).
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
