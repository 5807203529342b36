"""Compile the gather kernels for sm_90a without a GPU (production geometry, teacher on), with int64
and int32 offsets, and print ptxas' registers and spill stores:

    PYTHONPATH=. python bench/results/int32-offsets-2026-12-06/sm90_compile.py
"""
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource

from msa_model.ops.sparse_attention import gather

PTRS = {**{n: "*bf16" for n in ("Q", "K", "V", "PO", "DO", "DQP", "PBAR")},
        **{n: "*fp32" for n in ("PLSE", "LSE", "DELTA", "DKP", "DVP")},
        **{n: "*i32" for n in ("ENTRY", "ITEM_BUCKET", "ITEM_START", "ITEM_COUNT", "BSTART", "BEND")}}
FLOATS = ("qk_scale", "sm_scale")
GEOMETRY = dict(HQ=64, HKV=4, SLOTS=16, H=16, HP=16, QT=4, BS=128, D=128, DOCS=False, FP8=False)


def ptxas_report(fn, consts, warps):
    """(registers, spill store bytes) of `fn` compiled for sm_90a with `consts`."""
    names = fn.arg_names
    sig = {n: "constexpr" if n in consts else PTRS.get(n, "fp32" if n in FLOATS else "i32") for n in names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 128), options={"num_warps": warps, "num_stages": 1})
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(kernel.asm["ptx"])
    out = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", f.name, "-o", "/dev/null"],
                         capture_output=True, text=True).stderr
    return re.findall(r"Used (\d+) registers", out), re.findall(r"(\d+) bytes spill stores", out)


for wide in (True, False):
    fwd = ptxas_report(gather.sparse_fwd_kernel, dict(GEOMETRY, WIDE=wide), 4)
    bwd = ptxas_report(gather.sparse_bwd_kernel, dict(GEOMETRY, TEACHER=True, QTC=16, WIDE=wide), 8)
    print(f"WIDE={wide}: fwd {fwd[0]} registers, {fwd[1]} bytes spilled; bwd {bwd[0]} registers, {bwd[1]} bytes spilled")
