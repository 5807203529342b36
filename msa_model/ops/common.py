"""Shared helpers of the MSA ops: backend choice and input checks.

Legend used across the ops: B = batch, T = tokens, Hq = query heads, Hkv = key/value heads (GQA
groups), G = Hq // Hkv heads per group, D = head dim, Di = index head dim, K = top-k blocks,
N = key blocks of `block_size` tokens.
"""

from __future__ import annotations

import importlib
import math

import torch

BACKENDS = ("auto", "reference", "triton")

# the production geometry of docs/msa.md ("Defaults"), which MiniMax's kernels hard-code: the ops'
# defaults, and what checkpoint conversion uses when the source model has no MSA of its own
# (Di is then the source's head dim, 128 in production)
PRODUCTION_BLOCK_SIZE = 128  # Bk
PRODUCTION_TOPK = 16  # k
# the key blocks the Triton kernels take: a block is a tile dimension of their products (at least
# 16, a power of two), and at most 128 keys keep a block's fp32 accumulators in registers
TRITON_BLOCK_SIZES = (16, 32, 64, 128)


def resolve_backend(backend: str, *tensors: torch.Tensor) -> str:
    """"auto" picks the fused Triton kernels when every input is on CUDA, the reference otherwise."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if all(t.is_cuda for t in tensors if t is not None) else "reference"
    return backend


def load_triton(op: str):
    """Import `msa_model.ops.<op>.triton` lazily so CPU-only use never imports Triton kernels."""
    try:
        return importlib.import_module(f"msa_model.ops.{op}.triton")
    except ImportError as e:
        raise RuntimeError(f"the Triton backend of {op} is unavailable: {e}") from e


def num_blocks(T: int, block_size: int) -> int:
    return (T + block_size - 1) // block_size


def keys_per_query(block_size: int, topk: int) -> int:
    """The most keys a query of the sparse phase reads: its topk blocks of block_size keys."""
    return topk * block_size


def block_size_problem(block_size: int, triton: bool = False) -> str | None:
    """What is wrong with `block_size` (None: nothing), as the end of a sentence naming it: the
    reference takes any positive int, the Triton kernels one of TRITON_BLOCK_SIZES."""
    if not isinstance(block_size, int) or block_size <= 0:
        return "must be a positive int"
    if triton and block_size not in TRITON_BLOCK_SIZES:
        return "must be a power of two in [16, 128]"
    return None


def check_block_size(block_size: int, topk: int | None = None, triton: str | None = None) -> None:
    """Raise ValueError for a block_size (and topk) the ops cannot take; `triton`: the name of the op
    whose Triton kernels will run, which take only TRITON_BLOCK_SIZES (`block_size_problem`)."""
    problem = block_size_problem(block_size, triton=triton is not None)
    if problem is not None:
        who = "block_size" if triton is None or problem.endswith("int") else f"the Triton {triton}'s block_size"
        raise ValueError(f"{who} {problem}, got {block_size!r}")
    if topk is not None and (not isinstance(topk, int) or topk <= 0):
        raise ValueError(f"topk must be a positive int, got {topk!r}")


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None, q_offset: int = 0) -> tuple[int, ...]:
    """Validate q [B,Tq,Hq,D], k/v [B,Tk,Hkv,D]; returns (B, Tq, Hq, Hkv, D).

    Usually Tk == Tq. With queries that are a slice of the sequence (positions q_offset ..
    q_offset + Tq - 1) the keys cover at least the causal prefix: Tk >= q_offset + Tq."""
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be [B, T, H, D]; got q {tuple(q.shape)}, k {tuple(k.shape)}")
    check_q_offset(q_offset, q.shape[1], k.shape[1])
    B, T, Hq, D = q.shape
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k {tuple(k.shape)} does not match q {tuple(q.shape)} in batch or head dim")
    Hkv = k.shape[2]
    if Hq % Hkv != 0:
        raise ValueError(f"query heads ({Hq}) must be divisible by key/value heads ({Hkv})")
    if v is not None and v.shape != k.shape:
        raise ValueError(f"v {tuple(v.shape)} must have the shape of k {tuple(k.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t is not None and t.dtype != q.dtype:
            raise TypeError(f"{name} dtype {t.dtype} differs from q dtype {q.dtype}")
    if not q.is_floating_point():
        raise TypeError(f"q must be a floating tensor, got {q.dtype}")
    return B, T, Hq, Hkv, D


def check_q_offset(q_offset: int, Tq: int, Tk: int) -> None:
    """Queries are the positions q_offset .. q_offset + Tq - 1 of a key sequence of length Tk."""
    if not isinstance(q_offset, int) or q_offset < 0:
        raise ValueError(f"q_offset must be a non-negative int, got {q_offset!r}")
    if Tk < q_offset + Tq:
        raise ValueError(f"keys cover {Tk} tokens but the queries reach position q_offset + Tq = "
                         f"{q_offset} + {Tq}; pass keys of the whole causal prefix")


def trim_keys(Tq: int, q_offset: int, *keys: torch.Tensor | None) -> tuple:
    """Keys after the last query are invisible to every query: cut [B, Tk, ...] to q_offset + Tq,
    so that with q_offset = 0 the inputs are the usual same-length ones."""
    end = q_offset + Tq
    return tuple(t if t is None or t.shape[1] == end else t[:, :end].contiguous() for t in keys)


def check_index(iq: torch.Tensor, ik: torch.Tensor, B: int | None = None, T: int | None = None,
                Hkv: int | None = None, q_offset: int = 0) -> tuple[int, int, int, int]:
    """Validate iq [B,Tq,Hkv,Di], ik [B,Tk,Di] (Tk as in `check_qkv`); returns (B, Tq, Hkv, Di)."""
    if iq.dim() != 4 or ik.dim() != 3:
        raise ValueError(f"iq must be [B, T, Hkv, Di] and ik [B, T, Di]; got {tuple(iq.shape)}, {tuple(ik.shape)}")
    b, t, hkv, di = iq.shape
    if ik.shape[0] != b or ik.shape[2] != di:
        raise ValueError(f"ik {tuple(ik.shape)} does not match iq {tuple(iq.shape)} (expected {(b, t, di)})")
    check_q_offset(q_offset, t, ik.shape[1])
    if ik.dtype != iq.dtype:
        raise TypeError(f"ik dtype {ik.dtype} differs from iq dtype {iq.dtype}")
    if (B is not None and b != B) or (T is not None and t != T):
        raise ValueError(f"index tensors cover batch {b} x tokens {t}, attention inputs {B} x {T}")
    if Hkv is not None and hkv != Hkv:
        raise ValueError(f"iq has {hkv} index heads; it needs one per key/value head ({Hkv})")
    return b, t, hkv, di


def check_block_idx(block_idx: torch.Tensor, B: int, T: int, Hkv: int, block_size: int, q_offset: int = 0,
                    ids: bool = True) -> None:
    """block_idx [B, T, Hkv, K] of T queries at positions q_offset.. (ids < blocks of q_offset + T keys).

    The id range check reads the values back (a host synchronisation, which stalls a training
    step's queue); `ids=False` skips it for selections known to be in range (select_blocks')."""
    if block_idx.dim() != 4 or tuple(block_idx.shape[:3]) != (B, T, Hkv):
        raise ValueError(f"block_idx must be [B, T, Hkv, K] = [{B}, {T}, {Hkv}, K], got {tuple(block_idx.shape)}")
    if block_idx.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"block_idx must be int32 or int64, got {block_idx.dtype}")
    if not ids:
        return
    n = num_blocks(q_offset + T, block_size)
    lo, hi = torch.aminmax(block_idx) if block_idx.numel() else (torch.tensor(-1), torch.tensor(-1))
    # one host sync for both bounds
    lo, hi = torch.stack([lo, hi]).tolist()
    if lo < -1 or hi >= n:
        raise ValueError(f"block_idx holds ids outside [-1, {n - 1}] for {q_offset} + {T} keys, block_size={block_size}")


# the attribute of a device doc_start tensor that holds its host copy (the trainer attaches the
# micro-batch's, which every layer gets): what the ops would otherwise read back from the device
_HOST = "_msa_doc_start_host"
# the attribute of a doc_start tensor that holds its document block table sizes per (block size,
# query offset) (msa_model.ops.sparse_attention.inverse_index.table_size): computed from the host
# copy, or fixed by `reserve_table` (a CUDA graph's static starts, which have no host copy)
TABLE_SIZES = "_msa_doc_start_table_sizes"


def attach_host_copy(doc_start: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
    """Give a device doc_start the host tensor it was copied from, so that what the ops derive
    from the starts on the host (the dense path's plan, the size of the sparse paths' document
    block table) needs no read back from the device (a synchronisation). Returns doc_start."""
    setattr(doc_start, _HOST, host)
    return doc_start


def host_copy(doc_start: torch.Tensor) -> torch.Tensor | None:
    """The host copy `attach_host_copy` gave doc_start, or None."""
    return getattr(doc_start, _HOST, None)


def as_int32(doc_start: torch.Tensor | None) -> torch.Tensor | None:
    """doc_start as the kernels read it (int32, contiguous), keeping its host copy and table sizes."""
    if doc_start is None:
        return None
    out = doc_start.to(torch.int32).contiguous()
    if out is doc_start:
        return out
    host, sizes = host_copy(doc_start), getattr(doc_start, TABLE_SIZES, None)
    if sizes is not None:
        setattr(out, TABLE_SIZES, dict(sizes))
    return out if host is None else attach_host_copy(out, host)


def doc_rows(doc_start: torch.Tensor | None, a: int, b: int) -> torch.Tensor | None:
    """doc_start[:, a:b] with its host copy's rows; the tensor itself for all of them (so what is
    cached on it serves every layer). Without a host copy the rows keep the table sizes reserved
    for the tensor (at their query offset): a row's queries a..b-1 have at most the blocks of its
    queries 0..T-1, so a graph's query chunks keep the shapes of its capture."""
    if doc_start is None or (a == 0 and b == doc_start.shape[1]):
        return doc_start
    rows = doc_start[:, a:b]
    host = host_copy(doc_start)
    if host is not None:
        return attach_host_copy(rows, host[:, a:b])
    sizes = getattr(doc_start, TABLE_SIZES, None)
    if sizes:
        setattr(rows, TABLE_SIZES, {(block_size, q_offset + a): n for (block_size, q_offset), n in sizes.items()})
    return rows


def check_doc_start(doc_start: torch.Tensor | None, B: int, T: int, q_offset: int = 0, values: bool = True,
                    device: torch.device | None = None) -> None:
    """doc_start int [B, T]: the position of the first token of each query's document (query t at
    position q_offset + t). Rows hold consecutive documents: each start is at most the query's
    position, and a row's start changes only to the query's own position (a new document).

    Checking the values reads them back to the host (a synchronisation); `values=False` checks
    the shape and dtype only, for starts built by the data pipeline."""
    if doc_start is None:
        return
    if doc_start.dim() != 2 or tuple(doc_start.shape) != (B, T):
        raise ValueError(f"doc_start must be [B, T] = [{B}, {T}], got {tuple(doc_start.shape)}")
    if doc_start.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"doc_start must be int32 or int64, got {doc_start.dtype}")
    if device is not None and doc_start.device != device:
        raise ValueError(f"doc_start is on {doc_start.device}, the queries on {device}")
    if not values or T == 0:
        return
    pos = torch.arange(q_offset, q_offset + T, device=doc_start.device)
    s = doc_start.long()
    bad_range = (s < 0) | (s > pos)
    # a start either continues the previous query's document or opens one at the query itself
    bad_step = (s[:, 1:] != s[:, :-1]) & (s[:, 1:] != pos[1:])
    # one host sync for both checks
    n_range, n_step = torch.stack([bad_range.sum(), bad_step.sum()]).tolist()
    if n_range:
        raise ValueError(f"doc_start: {n_range} entries outside [0, position of the query] (queries at "
                         f"positions {q_offset}..{q_offset + T - 1})")
    if n_step:
        raise ValueError(f"doc_start: {n_step} queries start a document that is not their own position; "
                         "a row must hold consecutive documents (see data.datasets.document_starts)")


def default_scale(d: int, scale: float | None) -> float:
    return 1.0 / math.sqrt(d) if scale is None else float(scale)


def check_temperature(temperature: float) -> float:
    """The KL's temperature (`indexer_kl_loss`): a finite positive number."""
    t = float(temperature)
    if not math.isfinite(t) or t <= 0:
        raise ValueError(f"the KL temperature must be a finite positive number, got {temperature!r}")
    return t


def query_chunk(T: int, per_query: int, budget: int = 1 << 24) -> int:
    """Queries per chunk so that a chunk's [chunk, ..., T] working tensors hold about `budget` elements."""
    return max(1, min(T, budget // max(1, per_query * T)))
