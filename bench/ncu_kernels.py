"""Run each fused kernel of the MSA layer once at one length, for Nsight Compute.

Sparse attention forward and backward, the sparse KL forward and the stored-teacher backward
(random block sets, default geometry), then the dense KL forward and backward. Every call is
preceded by a warm-up call, so a profiler skipping the first launches of each kernel sees the
timed ones:

    ncu --clock-control none --launch-skip-before-match 1 --launch-count 1 \\
        --kernel-name regex:'sparse_fwd_kernel' --section SpeedOfLight --section WarpStateStats \\
        python bench/ncu_kernels.py --T 32768
"""

from __future__ import annotations

import argparse

import torch

from bench_sparse_attention import random_sets
from msa_model.ops import indexer_kl_loss, sparse_attention

HQ, HKV, D, DI, BK, TOPK = 64, 4, 128, 128, 128, 16


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=32768)
    ap.add_argument("--dense-T", type=int, default=16384)
    a = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=gen)  # noqa: E731
    T = a.T
    q, k, v, do = mk(1, T, HQ, D), mk(1, T, HKV, D), mk(1, T, HKV, D), mk(1, T, HQ, D)
    iq, ik = mk(1, T, HKV, DI).requires_grad_(), mk(1, T, DI).requires_grad_()
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    idx = random_sets(T, HKV, TOPK, BK, "cuda")
    for _ in range(2):
        o, lse = sparse_attention(q, k, v, idx, BK, backend="triton")
        o.backward(do)
        indexer_kl_loss(q.detach(), k.detach(), iq, ik, idx, lse.detach(), BK, backend="triton").backward()
    Td = a.dense_T
    for _ in range(2):
        _, lse = sparse_attention(q[:, :Td], k[:, :Td], v[:, :Td], None, BK, backend="triton")
        indexer_kl_loss(q[:, :Td].detach(), k[:, :Td].detach(), iq[:, :Td], ik[:, :Td], None, lse.detach(), BK,
                        backend="triton").backward()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
