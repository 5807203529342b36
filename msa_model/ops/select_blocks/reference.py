"""Readable PyTorch reference of the index branch's block selection: the ground truth for kernels.

B = batch, T = tokens, C = queries in a chunk, G = GQA groups (= Hkv), Di = index head dim,
N = key blocks, K = top-k blocks.
"""

from __future__ import annotations

import torch

from ..common import num_blocks, query_chunk
from .fp8 import key_scales, quantize_index


def select_blocks_reference(iq_BTGI: torch.Tensor, ik_BTI: torch.Tensor, block_size: int, topk: int,
                            force_sink: bool = False, q_offset: int = 0,
                            doc_start_BT: torch.Tensor | None = None, local_blocks: int = 1,
                            precision: str = "input") -> torch.Tensor:
    """Top-k key blocks per (query, group) by block-max index score; int32 [B, T, G, K], -1 = empty.

    The `local_blocks` blocks ending with the local one (the block holding the query, and the
    ones right before it) are always kept, and block 0 too when `force_sink`. Ranking uses the
    raw dot products: softmax and a positive scale keep the order, so no exp is needed. Equal
    scores are ranked by block id, the lowest first. Slots are sorted ascending with -1 padding
    last. Query t sits at position q_offset + t of the keys ik [B, >= q_offset + T, Di].

    With `doc_start_BT` (int [B, T]) each document is its own sequence: query t sees keys
    doc_start[t] .. q_offset + t, and block ids count from its document's first token (block n
    = keys doc_start[t] + n*block_size ..), so the ids are those of the document run alone.

    `precision="fp8"` ranks the scores of iq and ik quantized to float8 e4m3 (`fp8.py`): the
    products of the quantized values, times each key block's scale.
    """
    B, T, G, _ = iq_BTGI.shape
    out_BTGK = torch.full((B, T, G, topk), -1, dtype=torch.int32, device=iq_BTGI.device)
    key_scale_BJ = None
    if precision == "fp8":
        iq_BTGI, ik_BTI, ik_scale_BN = quantize_index(iq_BTGI, ik_BTI, block_size)
        key_scale_BJ = key_scales(ik_scale_BN, ik_BTI.shape[1], block_size)
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
        if key_scale_BJ is not None:
            s_BCGJ = s_BCGJ * key_scale_BJ[:, None, None, :key_end]
        visible_CJ = pos[None, :key_end] <= qpos_C[:, None]
        if doc_start_BT is None:
            s_BCGJ = s_BCGJ.masked_fill(~visible_CJ[None, :, None, :], float("-inf"))
            pad = n_blk * block_size - key_end
            s_BCGJ = torch.nn.functional.pad(s_BCGJ, (0, pad), value=float("-inf"))
            bmax_BCGN = s_BCGJ.view(B, t1 - t0, G, n_blk, block_size).amax(-1)
            local_BC = (qpos_C // block_size)[None]
        else:
            start_BC = doc_start_BT[:, t0:t1].long()
            rel_BCJ = pos[None, None, :key_end] - start_BC[..., None]
            visible_BCJ = visible_CJ[None] & (rel_BCJ >= 0)
            # each key's block counted from the query's document start; invisible keys go to a spare block
            block_BCJ = torch.where(visible_BCJ, rel_BCJ // block_size, n_blk)
            bmax_BCGN = torch.full((B, t1 - t0, G, n_blk + 1), float("-inf"), device=pos.device)
            bmax_BCGN = bmax_BCGN.scatter_reduce(-1, block_BCJ[:, :, None, :].expand_as(s_BCGJ), s_BCGJ, "amax")
            bmax_BCGN = bmax_BCGN[..., :n_blk]
            local_BC = (qpos_C[None] - start_BC) // block_size
        # the local block and the local_blocks - 1 before it are forced
        n_N = torch.arange(n_blk, device=pos.device)[None, None, :]
        local_BCN = (n_N <= local_BC[..., None]) & (n_N > local_BC[..., None] - local_blocks)
        if force_sink:
            # the sink ranks right below the local blocks, so they are kept first
            bmax_BCGN[..., 0] = torch.finfo(bmax_BCGN.dtype).max
        bmax_BCGN = bmax_BCGN.masked_fill(local_BCN[:, :, None, :], float("inf"))
        k = min(topk, n_blk)
        # ties go to the lowest block id: a stable descending sort keeps equal scores in id order
        # (torch.topk leaves their order unspecified)
        val_BCGN, idx_BCGN = bmax_BCGN.sort(dim=-1, descending=True, stable=True)
        val_BCGK, idx_BCGK = val_BCGN[..., :k], idx_BCGN[..., :k]
        # blocks past the causal horizon have every key masked: never select them
        idx_BCGK = idx_BCGK.masked_fill(val_BCGK == float("-inf"), n_blk)
        idx_BCGK = idx_BCGK.sort(dim=-1).values
        out_BTGK[:, t0:t1, :, :k] = idx_BCGK.masked_fill(idx_BCGK == n_blk, -1).to(torch.int32)
    return out_BTGK
