"""What every Triton kernel of the ops shares: constants, the matrix product and the interpreter flag.

The CPU tests run the kernels in Triton's interpreter (TRITON_INTERPRET=1, read once at import,
before any kernel compiles). Two interpreter limits shape the kernels, and all of them handle
them the same way:

- it cannot take a loaded value (a tensor) as a `range()` bound, so a kernel whose loop bound is
  loaded writes `if INTERPRET: while ...` beside the `for` loop that the compiler software-pipelines
  on a GPU (`for` with a loaded bound compiles fine there);
- it multiplies bf16 tiles as raw 16-bit integers, so `dot` widens its operands to fp32 there
  (products of bf16 or fp16 values are exact in fp32, so nothing is lost).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

# kernels read these constexprs; host code takes their `.value` (e.g. a scale folded with LOG2E)
LOG2E = tl.constexpr(1.4426950408889634)  # kernels take exp2: exp(x) = exp2(x * LOG2E)
LN2 = tl.constexpr(0.6931471805599453)  # and report natural logs: ln(x) = log2(x) * LN2
FP32_TINY = tl.constexpr(1.1754943508222875e-38)  # the smallest normal fp32: keeps log() finite


def interpreting() -> bool:
    """True when Triton's interpreter runs the kernels (CPU tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


INTERPRET = tl.constexpr(interpreting())


@triton.jit
def dot(a, b, PREC: tl.constexpr):
    """tl.dot(a, b) with an fp32 accumulator; PREC ("tf32" or "ieee") is fp32 inputs' precision
    on a GPU. In the interpreter both operands are widened to fp32 first."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def row_documents(doc_ptr, rows, mask, first_row, TILE: tl.constexpr):
    """Packed documents, for query-outer kernels: the document starts of a tile's query rows
    (doc_ptr + rows; 0 where masked) and the first key tile of TILE keys they read. Starts do not
    decrease along a row, so the tile's first row has the least."""
    start = tl.load(doc_ptr + rows, mask=mask, other=0)
    first = tl.load(doc_ptr + first_row) // TILE * TILE
    return start, first


@triton.jit
def mm(a, b):
    """`dot` at the default precision (the inputs are bf16 or fp16 on a GPU). Written out rather
    than calling `dot`: the interpreter pays for every nested jit call."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


# the largest float8 e4m3 (e4m3fn) value: fp8 probabilities are stored as e4m3 of P x 448
E4M3_MAX = tl.constexpr(448.0)


@triton.jit
def e4m3_round(x):
    """x (fp32, 0 <= x <= 448) rounded to the nearest float8 e4m3 value, ties to even: what the
    hardware's conversion gives (and `sparse_attention.reference.e4m3_round`), written as fp32
    arithmetic so that Triton's interpreter, whose conversion truncates subnormals, agrees. The
    spacing at x is 2^(exponent(x) - 3), 2^-9 below 2^-6 (subnormals); fp32 x / spacing < 16 is
    rounded by adding and taking away 1.5 * 2^23."""
    e = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    step = ((tl.maximum(e, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)
    return ((x / step + 12582912.0) - 12582912.0) * step
