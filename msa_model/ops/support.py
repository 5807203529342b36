"""The support of a query chunk: which keys each (query, group) may read.

B = batch, C = queries in a chunk, G = groups, J = keys [0, key_end), K = top-k slots.
"""

from __future__ import annotations

import torch

from .common import num_blocks


def support_mask(block_idx_BTGK: torch.Tensor | None, t0: int, t1: int, key_end: int, block_size: int,
                 groups: int, batch: int, device: torch.device, q_offset: int = 0) -> torch.Tensor:
    """Bool [B, C, G, J] for queries t0..t1-1 and keys 0..key_end-1: causal and in a selected block.

    Query t sits at position q_offset + t (block_idx rows are indexed by t). block_idx None
    means dense: every causal key is in the support.
    """
    pos = torch.arange(max(q_offset + t1, key_end), device=device)
    causal_CJ = pos[None, :key_end] <= pos[q_offset + t0:q_offset + t1, None]
    if block_idx_BTGK is None:
        return causal_CJ[None, :, None, :].expand(batch, t1 - t0, groups, key_end)
    n_blk = num_blocks(key_end, block_size)
    idx_BCGK = block_idx_BTGK[:, t0:t1].long()
    # slots of -1 (and blocks past key_end, which no causal key of the chunk can reach) go to a spare column
    idx_BCGK = torch.where((idx_BCGK < 0) | (idx_BCGK >= n_blk), n_blk, idx_BCGK)
    chosen_BCGN = torch.zeros(*idx_BCGK.shape[:3], n_blk + 1, dtype=torch.bool, device=device)
    chosen_BCGN.scatter_(-1, idx_BCGK, True)
    key_block_J = pos[:key_end] // block_size
    return chosen_BCGN[..., key_block_J] & causal_CJ[None, :, None, :]
