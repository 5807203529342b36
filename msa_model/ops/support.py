"""The support of a query chunk: which keys each (query, group) may read.

B = batch, C = queries in a chunk, G = groups, J = keys [0, key_end), K = top-k slots,
N = key blocks.
"""

from __future__ import annotations

import torch

from .common import num_blocks


def support_mask(block_idx_BTGK: torch.Tensor | None, t0: int, t1: int, key_end: int, block_size: int,
                 groups: int, batch: int, device: torch.device, q_offset: int = 0,
                 doc_start_BT: torch.Tensor | None = None) -> torch.Tensor:
    """Bool [B, C, G, J] for queries t0..t1-1 and keys 0..key_end-1: causal and in a selected block.

    Query t sits at position q_offset + t (block_idx rows are indexed by t). block_idx None
    means dense: every causal key is in the support.

    With `doc_start_BT` (int [B, T], the first position of each query's document) every document is
    its own sequence: query t reads only keys from doc_start[t] on, and its block n is the keys
    doc_start[t] + n*block_size .. doc_start[t] + (n+1)*block_size - 1.
    """
    pos = torch.arange(max(q_offset + t1, key_end), device=device)
    causal_CJ = pos[None, :key_end] <= pos[q_offset + t0:q_offset + t1, None]
    if doc_start_BT is None:
        visible_BCJ = causal_CJ[None].expand(batch, t1 - t0, key_end)
        # block of each key, the same for every query
        key_block_BCJ = (pos[:key_end] // block_size)[None, None, :]
    else:
        rel_BCJ = pos[None, None, :key_end] - doc_start_BT[:, t0:t1, None].long()
        visible_BCJ = causal_CJ[None] & (rel_BCJ >= 0)
        key_block_BCJ = rel_BCJ.clamp(min=0) // block_size
    if block_idx_BTGK is None:
        return visible_BCJ[:, :, None, :].expand(batch, t1 - t0, groups, key_end)
    n_blk = num_blocks(key_end, block_size)
    idx_BCGK = block_idx_BTGK[:, t0:t1].long()
    # slots of -1 (and blocks past key_end, which no causal key of the chunk can reach) go to a spare column
    idx_BCGK = torch.where((idx_BCGK < 0) | (idx_BCGK >= n_blk), n_blk, idx_BCGK)
    chosen_BCGN = torch.zeros(*idx_BCGK.shape[:3], n_blk + 1, dtype=torch.bool, device=device)
    chosen_BCGN.scatter_(-1, idx_BCGK, True)
    if doc_start_BT is None:
        chosen_BCGJ = chosen_BCGN[..., key_block_BCJ[0, 0]]
    else:
        gather_BCGJ = key_block_BCJ[:, :, None, :].expand(batch, t1 - t0, groups, key_end)
        chosen_BCGJ = chosen_BCGN.gather(-1, gather_BCGJ)
    return chosen_BCGJ & visible_BCJ[:, :, None, :]
