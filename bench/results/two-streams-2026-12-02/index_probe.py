"""Probe: the inverse index of every entry (`sparse_index` at the default tuning and geometry, random
sets), ms per build, at each length; run once per tree.

    PYTHONPATH=.:bench python bench/results/two-streams-2026-12-02/index_probe.py
"""
import json
import os

import torch

import bench_sparse_attention as bsa
from msa_model.ops import inverse_index
from msa_model.ops.sparse_attention import triton as sa_triton

for T in [int(x) for x in os.environ.get("LENGTHS", "8192,32768,131072,262144,524288").split(",")]:
    idx = inverse_index.clean_block_idx(bsa.random_sets(T, bsa.HKV, bsa.TOPK, bsa.BS, "cuda"), bsa.BS)
    N = -(-T // bsa.BS)
    H = bsa.HQ // bsa.HKV

    def build():
        return sa_triton.sparse_index(idx, H, bsa.D, 2, N, sa_triton.DEFAULT_TUNING)
    index = build()
    print(json.dumps({"T": T, "chunks": index.n_chunks, "index ms": round(bsa.timeit(build), 3),
                      "entries": int(index.count.sum())}), flush=True)
    del idx, index
    torch.cuda.empty_cache()
