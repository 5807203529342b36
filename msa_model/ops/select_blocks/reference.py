"""Readable PyTorch reference of the index branch's block selection: the ground truth for kernels.

B = batch, T = tokens, C = queries in a chunk, G = GQA groups (= Hkv), Di = index head dim,
N = key blocks, K = top-k blocks.
"""

from __future__ import annotations

import torch

from ..common import num_blocks, query_chunk


def select_blocks_reference(iq_BTGI: torch.Tensor, ik_BTI: torch.Tensor, block_size: int, topk: int,
                            force_sink: bool = False, q_offset: int = 0, local_blocks: int = 1) -> torch.Tensor:
    """Top-k key blocks per (query, group) by block-max index score; int32 [B, T, G, K], -1 = empty.

    The `local_blocks` blocks ending with the local one (the block holding the query, and the
    ones right before it) are always kept, and block 0 too when `force_sink`. Ranking uses the
    raw dot products: softmax and a positive scale keep the order, so no exp is needed. Slots are sorted ascending with -1 padding last. Query t sits at
    position q_offset + t of the keys ik [B, >= q_offset + T, Di].
    """
    B, T, G, _ = iq_BTGI.shape
    out_BTGK = torch.full((B, T, G, topk), -1, dtype=torch.int32, device=iq_BTGI.device)
    iq_BTGI = iq_BTGI.float()
    ik_BTI = ik_BTI.float()
    pos = torch.arange(q_offset + T, device=iq_BTGI.device)
    chunk = query_chunk(q_offset + T, G)
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        # keys after the chunk's last query are invisible to every query of the chunk
        key_end = q_offset + t1
        n_blk = num_blocks(key_end, block_size)
        qpos_C = pos[q_offset + t0:key_end]
        s_BCGJ = torch.einsum("bcgi,bji->bcgj", iq_BTGI[:, t0:t1], ik_BTI[:, :key_end])
        visible_CJ = pos[None, :key_end] <= qpos_C[:, None]
        s_BCGJ = s_BCGJ.masked_fill(~visible_CJ[None, :, None, :], float("-inf"))
        pad = n_blk * block_size - key_end
        s_BCGJ = torch.nn.functional.pad(s_BCGJ, (0, pad), value=float("-inf"))
        bmax_BCGN = s_BCGJ.view(B, t1 - t0, G, n_blk, block_size).amax(-1)
        n_N, qblk_C1 = torch.arange(n_blk, device=pos.device), (qpos_C // block_size)[:, None]
        local_CN = (n_N[None, :] <= qblk_C1) & (n_N[None, :] > qblk_C1 - local_blocks)
        if force_sink:
            # the sink ranks right below the local blocks, so they are kept first
            bmax_BCGN[..., 0] = torch.finfo(bmax_BCGN.dtype).max
        bmax_BCGN = bmax_BCGN.masked_fill(local_CN[None, :, None, :], float("inf"))
        k = min(topk, n_blk)
        val_BCGK, idx_BCGK = bmax_BCGN.topk(k, dim=-1)
        # blocks past the causal horizon have every key masked: never select them
        idx_BCGK = idx_BCGK.masked_fill(val_BCGK == float("-inf"), n_blk)
        idx_BCGK = idx_BCGK.sort(dim=-1).values
        out_BTGK[:, t0:t1, :, :k] = idx_BCGK.masked_fill(idx_BCGK == n_blk, -1).to(torch.int32)
    return out_BTGK
