"""fp8 index scores: the select kernel's products on the fp8 tensor cores.

`precision="fp8"` quantizes iq and ik to float8 e4m3 before scoring; every other step of the
selection is unchanged. Each (b, t, g) row of iq is scaled by its own amax, a positive factor
per row that leaves the row's ranking as it is, so it is never multiplied back. ik is scaled per
key block (the keys n*Bk .. (n+1)*Bk - 1 of the sequence, counted from position 0): the scores
of block n's keys are multiplied by its scale, so the blocks of a row compare as the products
of the dequantized values. The scores the selection ranks are therefore

    s[t, g, j] = (iq8[t, g] . ik8[j]) * ik_scale[block(j)]

exactly what `select_blocks_reference` computes with `precision="fp8"`, and what the kernel
computes up to the summation order. Only the ranking changes against the input precision: e4m3
keeps 3 mantissa bits, so blocks whose scores differ by a few percent can swap
(bench/bench_index_precision.py measures how often and how much the swapped blocks weigh).
"""

from __future__ import annotations

import torch


# what select_blocks' score products may run in: the index q/k's own dtype, or float8 e4m3
INDEX_PRECISIONS = ("input", "fp8")
E4M3_MAX = 448.0
_TINY = torch.finfo(torch.float32).tiny


def check_precision(precision: str, device: torch.device) -> None:
    """`precision` is one of INDEX_PRECISIONS; fp8 products on a GPU need fp8 tensor cores (sm89+)."""
    if precision not in INDEX_PRECISIONS:
        raise ValueError(f"precision must be one of {INDEX_PRECISIONS}, got {precision!r}")
    if precision == "fp8" and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError(f"precision='fp8' needs fp8 tensor cores (compute capability 8.9 or newer); "
                         f"{torch.cuda.get_device_name(device)} has "
                         f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))}")


def quantize_index(iq_BTGI: torch.Tensor, ik_BTI: torch.Tensor, block_size: int):
    """(iq8 [B, T, G, Di], ik8 [B, TK, Di] float8_e4m3fn, ik_scale fp32 [B, N]) with N the key
    blocks of TK keys; see the module docstring."""
    amax_q = iq_BTGI.abs().amax(-1, keepdim=True).float().clamp_min(_TINY)
    iq8 = (iq_BTGI * (E4M3_MAX / amax_q)).to(torch.float8_e4m3fn)
    B, TK, Di = ik_BTI.shape
    N = -(-TK // block_size)
    ik_pad = torch.nn.functional.pad(ik_BTI, (0, 0, 0, N * block_size - TK)).view(B, N, block_size * Di)
    amax_k = ik_pad.abs().amax(-1).float().clamp_min(_TINY)
    ik8 = (ik_pad * (E4M3_MAX / amax_k)[..., None]).view(B, N * block_size, Di)[:, :TK].to(torch.float8_e4m3fn)
    return iq8, ik8.contiguous(), (amax_k / E4M3_MAX).contiguous()


def key_scales(ik_scale_BN: torch.Tensor, TK: int, block_size: int) -> torch.Tensor:
    """fp32 [B, TK]: each key's block scale."""
    return ik_scale_BN.repeat_interleave(block_size, dim=1)[:, :TK]
