"""Probe: the MSA layer core at short context (8K-16K) against SDPA, per launch-shape variant.

fwd+bwd of `msa_attention` (teacher from the backward, random inputs) with the attention's
Tuning replaced per variant, ms per call over back-to-back calls; then a kernel table of one
geometry's default and last variant.

    PYTHONPATH=. python bench/results/short-context-2026-12-02/short_context_probe.py

Environment: GEOMS (JSON [[name, Hq, Hkv, D, Di], ...]), LENGTHS ("8192,16384"), VARIANTS (JSON
list of Tuning overrides), PROFILE ("name:T" whose kernels are listed, "none"). Call 4 ran the
defaults; call 5 GEOMS of prod and prod-tp2, LENGTHS=8192, PROFILE=none and the variants listed
at the end of probe-variants-call5.txt.
"""
import dataclasses
import json
import os

import torch

from msa_model.ops.msa_attention import MSASettings, msa_attention
from msa_model.ops.tuning import KernelTuning
from msa_model.ops.sparse_attention import triton as sa_triton
from probe_common import inputs, sdpa_step, timed

N = 15  # timed calls
GEOMS = json.loads(os.environ.get("GEOMS", '[["prod", 64, 4, 128, 128], ["prod-tp2", 32, 2, 128, 128], '
                                           '["small", 16, 4, 64, 64]]'))
LENGTHS = [int(x) for x in os.environ.get("LENGTHS", "8192,16384").split(",")]
G = 1 << 30
VARIANTS = json.loads(os.environ.get("VARIANTS", json.dumps([
    {}, {"partial_min_bytes": G}, {"partial_min_bytes": 2 * G}, {"partial_min_bytes": 4 * G},
    {"partial_min_bytes": 4 * G, "bwd_tiles": 32}, {"partial_min_bytes": 4 * G, "fwd_tiles": 8}])))
PROFILE = os.environ.get("PROFILE", "prod:8192")


for name, Hq, Hkv, D, Di in GEOMS:
    for T in LENGTHS:
        ins, do = inputs(T, Hq, Hkv, D, Di)
        row = {"geom": name, "T": T, "sdpa": round(timed(sdpa_step(*ins[:3], do), N), 3)}
        for i, var in enumerate(VARIANTS):
            tun = KernelTuning(sparse_attention=dataclasses.replace(sa_triton.DEFAULT_TUNING, **var))

            def step():
                o, kl, _, _ = msa_attention(*ins, MSASettings(block_size=128, topk=16, kl_teacher="backward", tuning=tun))
                return torch.autograd.grad((o, kl), ins, (do, torch.ones_like(kl)))

            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            row[f"v{i}"] = round(timed(step, N), 3)
            row[f"v{i} peak MiB"] = round((torch.cuda.max_memory_allocated() - base) / 2**20)
            if PROFILE == f"{name}:{T}" and i in (0, len(VARIANTS) - 1):
                from torch.profiler import ProfilerActivity, profile
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(5):
                        step()
                    torch.cuda.synchronize()
                print(f"kernels of {name} T={T} variant {var} (5 calls)")
                print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=22,
                                                max_name_column_width=60), flush=True)
        print(json.dumps(row), flush=True)
print("variants:", json.dumps(VARIANTS))
