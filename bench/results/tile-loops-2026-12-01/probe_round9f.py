"""Round 9 probe f (call 13): tile_union by one sort and a prefix-sum compaction against the
two-sort version it replaced, same outputs, at 32K and 128K on realistic and random sets
(default geometry, 8-query tiles). The old version is read from probe/old_triton_src.py:
`git show 2bc54cf:msa_model/ops/sparse_attention/triton.py > probe/old_triton_src.py`."""
import json, os, sys, types
import torch
sys.path.insert(0, "bench")
from bench_sparse_attention import BS, HKV, TOPK, random_sets, realistic_sets, timeit  # noqa
from msa_model.ops.sparse_attention import triton as new
src = open("probe/old_triton_src.py").read().replace("from ..", "from msa_model.ops.").replace(
    "from .triton_", "from msa_model.ops.sparse_attention.triton_")
old = types.ModuleType("old_triton"); sys.modules["old_triton"] = old; exec(compile(src, "old_triton", "exec"), old.__dict__)
for T in (32768, 131072):
    for pat in ("realistic", "random"):
        idx = new.clean_block_idx((random_sets if pat == "random" else realistic_sets)(T, HKV, TOPK, BS, "cuda"), BS)
        a, b = old.tile_union(idx, 8), new.tile_union(idx, 8)
        r = dict(T=T, pat=pat, same=bool(torch.equal(a.blocks, b.blocks) and torch.equal(a.count, b.count)
                                          and torch.equal(a.full, b.full)),
                 two_sorts_ms=timeit(lambda: old.tile_union(idx, 8)), one_sort_ms=timeit(lambda: new.tile_union(idx, 8)))
        print(json.dumps(r), flush=True)
        with open(os.path.join(os.environ.get("OUT", "."), "probe-round9f.jsonl"), "a") as f:
            f.write(json.dumps(r) + "\n")
