r"""A/B of the select kernel against the previous one (bench/RESULTS.md round 6), same process.

Make the previous kernel importable first, from the repo root:
    mkdir -p probe && git show c99b787:msa_model/ops/select_blocks/triton.py \
      | sed "s/from \.\.common import/from msa_model.ops.common import/; s/from \.\.triton_utils import/from msa_model.ops.triton_utils import/" \
      > probe/select_old.py
then: PYTHONPATH=. python bench/results/index-precision-2026-12-01/ab_previous_kernel.py
"""
import dataclasses, sys, torch
sys.path.insert(0, "probe"); sys.path.insert(0, "bench")
import select_old
from msa_model.ops.select_blocks.triton import Tuning, select_blocks_triton
from bench_index_precision import timed
for T in (131072, 524288, 1048576):
    g = torch.Generator(device="cuda").manual_seed(2)
    iq = torch.randn(1, T, 4, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    ik = torch.randn(1, T, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    reps = 5 if T < 2**19 else 3
    a = select_old.select_blocks_triton(iq, ik, 128, 16)
    r = {"old": lambda: select_old.select_blocks_triton(iq, ik, 128, 16)}
    for sf in ((1024,) if T < 2**20 else (1024, 0, 2048, 4096)):
        tun = Tuning(skip_from=sf)
        b = select_blocks_triton(iq, ik, 128, 16, tuning=tun)
        assert torch.equal(a.sort(-1).values, b.sort(-1).values), (T, sf)
        r[f"new{sf}"] = lambda tun=tun: select_blocks_triton(iq, ik, 128, 16, tuning=tun)
        r[f"fp8_{sf}"] = lambda tun=tun: select_blocks_triton(iq, ik, 128, 16, tuning=tun, precision="fp8")
    for rnd in range(2):
        print(f"ab T={T}", {k: round(timed(f, reps), 2) for k, f in r.items()}, flush=True)
