"""The gather backward as a loader/MMA Gluon kernel (`msa_model/ops/sparse_attention/
gluon_backward.py`, `Tuning.bwd_gluon`) against the Triton kernel (`sparse_bwd_kernel`), side by
side on one GPU: random selections at the production geometry (Hq 64, Hkv 4, D 128, 128-key
blocks, top-16), the KL teacher's rows written. The Gluon calls run first, into memory filled
with NaN, then the Triton reference; it prints relative errors and the median ms of whole
`sparse_backward` calls:

    python bench/results/long-context-2026-12-06/gluon_bwd.py --T 8192,32768 --stages 2,3 \
        [--patches bench/results/long-context-2026-12-06/session9/fewer-spills.patch]

--patches: each patch of `gluon_backward.py` (git diff form) is timed too, as a kernel of its own
(applied to a copy, which stands in for the module during its calls), so that variants of the
kernel compare in one call.

`session9/call2.log` is the kernel's run before it moved into the package (its variants are
stages:loader warps:loader registers; 4 loader warps and 48 registers were kept); the first
version, whose MMA warps loaded each tile's entry ids, lse and delta themselves (`call1.log`),
is `session9/gluon_bwd_v1.patch`, applied to the packaged kernel of commit c24cd9d as
`session9/call1.sh` does.
"""
import argparse
import dataclasses
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

import torch


def patched_kernel(patch: str):
    """`gluon_backward` with `patch` applied, loaded from a copy as a module of the same package."""
    root = Path(__file__).resolve().parents[3]
    name = "msa_model.ops.sparse_attention.gluon_backward"
    out = Path(tempfile.mkdtemp()) / "gluon_backward.py"
    subprocess.run(["patch", "-s", "-o", str(out), str(root / "msa_model/ops/sparse_attention/gluon_backward.py"),
                    patch], check=True)
    spec = importlib.util.spec_from_file_location(name, out)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def use(kernel):
    """Makes `kernel` the module `sparse_backward` imports as `gluon_backward`."""
    sys.modules["msa_model.ops.sparse_attention.gluon_backward"] = kernel
    sys.modules["msa_model.ops.sparse_attention"].gluon_backward = kernel


def main():
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from bench_sparse_attention import inputs, random_sets, timeit
    from msa_model.ops.sparse_attention.gather import sparse_backward, sparse_forward
    from msa_model.ops.sparse_attention.tuning import DEFAULT_TUNING

    ap = argparse.ArgumentParser()
    ap.add_argument("--T", default="8192,32768")
    ap.add_argument("--stages", default="2,3")
    ap.add_argument("--patches", default="", help="comma-separated patches of gluon_backward.py to time too")
    a = ap.parse_args()
    from msa_model.ops.sparse_attention import gluon_backward as packaged
    kernels = {"": packaged} | {Path(p).stem + ", ": patched_kernel(p) for p in a.patches.split(",") if p}
    for T in map(int, a.T.split(",")):
        q, k, v, do = inputs(T)
        idx = random_sets(T, 4, 16, 128, "cuda")
        scale = 128 ** -0.5
        o, lse, index = sparse_forward(q, k, v, idx, 128, scale)
        E = idx.numel()

        def call(pbar, tuning):
            return sparse_backward(do, q, k, v, o, lse, idx, 128, scale, index=index, teacher=pbar, tuning=tuning)

        results = {}
        for label, kernel in kernels.items():
            use(kernel)
            for stages in map(int, a.stages.split(",")):
                tuning = dataclasses.replace(DEFAULT_TUNING, bwd_gluon=True, bwd_gluon_stages=stages)
                torch.empty(1 << 30, device="cuda").fill_(float("nan"))  # what the caching allocator hands out next
                pbar = torch.zeros(E, 128, dtype=torch.bfloat16, device="cuda")
                got = call(pbar, tuning)
                torch.cuda.synchronize()
                ms = timeit(lambda: call(pbar, tuning))
                results[f"{label}{stages} stages"] = ([x.clone() for x in got] + [pbar.clone()], ms)
        use(packaged)
        pbar_ref = torch.zeros(E, 128, dtype=torch.bfloat16, device="cuda")
        ref = list(call(pbar_ref, DEFAULT_TUNING)) + [pbar_ref]
        ms_ref = timeit(lambda: call(pbar_ref, DEFAULT_TUNING))
        print(f"T={T} triton backward: {ms_ref:.2f} ms", flush=True)
        for label, (got, ms) in results.items():
            errs = [((x.float() - y.float()).norm() / y.float().norm()).item() for x, y in zip(got, ref)]
            print(f"  gluon, {label}: rel err dq {errs[0]:.1e} dk {errs[1]:.1e} dv {errs[2]:.1e} "
                  f"pbar {errs[3]:.1e}; {ms:.2f} ms ({ms_ref / ms:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
