"""select_blocks with fp8 index scores against the input precision: time, and what the swaps cost.

    PYTHONPATH=. python bench/bench_index_precision.py [--lengths 32768,131072,524288,1048576] [--json F]

Default geometry (Hkv=4, Di=128, block 128, top-16, B=1, bf16 randn inputs). Per length: the whole
select_blocks, its scoring alone (no top-k) and the quantization, for precision="input" and "fp8"
(medians of back-to-back CUDA-event timings); the share of selected blocks both precisions pick;
on sampled rows (lengths up to --quality-max), measured on the exact fp64 scores of the inputs:
- slot regret: how much lower the fp8 selection's free blocks score than the input precision's,
  per free slot, in units of the row's block-score standard deviation;
- captured index mass: the index softmax (scores / sqrt(Di)) over all causal keys, summed over
  the fp8 selection's support, over the same sum for the input precision's.
Random inputs are the hard case: their block scores crowd together, so near-ties are common.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

from msa_model.ops.select_blocks.fp8 import quantize_index
from msa_model.ops.select_blocks.triton import select_blocks_triton
from select_blocks_stages import score_only_triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_msa_layer import timed  # noqa: E402  (back-to-back CUDA-event medians)

G, DI, BK, K = 4, 128, 128, 16


def row_quality(iq, ik, exact, fp8, rows, seed):
    """Mean / max slot regret (row std units) and mean / min captured-mass ratio on sampled rows."""
    T = iq.shape[1]
    gen = torch.Generator().manual_seed(seed)
    ts = torch.randint(4 * BK * K, T, (rows,), generator=gen).tolist()
    regrets, masses = [], []
    for t in ts:
        s = iq[0, t].double() @ ik[0, : t + 1].double().T  # [G, t+1]
        n = t // BK + 1
        bm = torch.nn.functional.pad(s, (0, n * BK - (t + 1)), value=float("-inf")).view(G, n, BK).amax(-1)
        p = torch.softmax(s / math.sqrt(DI), dim=-1)
        mass = torch.nn.functional.pad(p, (0, n * BK - (t + 1))).view(G, n, BK).sum(-1)
        for g in range(G):
            e, f = exact[0, t, g].long(), fp8[0, t, g].long()
            free_e, free_f = e[e != t // BK], f[f != t // BK]
            sd = bm[g].std().item()
            regrets.append((bm[g, free_e].sum() - bm[g, free_f].sum()).item() / (len(free_e) * sd))
            masses.append((mass[g, f].sum() / mass[g, e].sum()).item())
    return dict(rows=len(regrets), slot_regret_mean=sum(regrets) / len(regrets), slot_regret_max=max(regrets),
                mass_ratio_mean=sum(masses) / len(masses), mass_ratio_min=min(masses))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="32768,131072,524288,1048576")
    ap.add_argument("--quality-max", type=int, default=131072, help="longest length with sampled-row quality")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
           "rows": []}
    for T in (int(x) for x in args.lengths.split(",") if x):
        gen = torch.Generator(device="cuda").manual_seed(T)
        iq = torch.randn(1, T, G, DI, device="cuda", dtype=torch.bfloat16, generator=gen)
        ik = torch.randn(1, T, DI, device="cuda", dtype=torch.bfloat16, generator=gen)
        reps = 5 if T <= 131072 else 2
        r = {"T": T}
        for prec in ("input", "fp8"):
            r[f"select_{prec}_ms"] = timed(lambda: select_blocks_triton(iq, ik, BK, K, precision=prec), reps)
            r[f"score_only_{prec}_ms"] = timed(lambda: score_only_triton(iq, ik, BK, precision=prec), reps)
        r["quantize_ms"] = timed(lambda: quantize_index(iq, ik, BK), reps)
        r["speedup"] = r["select_input_ms"] / r["select_fp8_ms"]
        exact = select_blocks_triton(iq, ik, BK, K)
        fp8 = select_blocks_triton(iq, ik, BK, K, precision="fp8")
        a, b = exact.long(), fp8.long()
        shared = ((a[..., :, None] == b[..., None, :]) & (a[..., :, None] >= 0)).any(-1).sum().item()
        r["blocks_shared"] = shared / (a >= 0).sum().item()
        if T <= args.quality_max:
            r.update(row_quality(iq, ik, exact, fp8, args.rows, T))
        print(json.dumps(r), flush=True)
        res["rows"].append(r)
        del iq, ik, exact, fp8
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1)
    print("| T | select input / fp8 (ms) | speed-up | scoring alone input / fp8 (ms) | quantize (ms) | blocks shared "
          "| slot regret mean / max (row std) | captured index mass fp8 / input, mean / min |")
    print("|---|---|---|---|---|---|---|---|")
    for r in res["rows"]:
        q = (f"{r['slot_regret_mean']:.4f} / {r['slot_regret_max']:.3f} | {r['mass_ratio_mean']:.4f} / "
             f"{r['mass_ratio_min']:.4f}") if "rows" in r else "- | -"
        print(f"| {r['T'] // 1024}K | {r['select_input_ms']:.2f} / {r['select_fp8_ms']:.2f} | {r['speedup']:.2f}x | "
              f"{r['score_only_input_ms']:.2f} / {r['score_only_fp8_ms']:.2f} | {r['quantize_ms']:.2f} | "
              f"{r['blocks_shared']:.3f} | {q} |")


if __name__ == "__main__":
    main()
