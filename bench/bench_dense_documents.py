"""Dense attention on packed documents: the candidates against causal SDPA, forward + backward, on
document mixes of 1, 3, 10 and 100 documents per row at 8K and 32K (the dense baseline's and the
indexer warmup's attention; msa_model/ops/dense_attention/README.md holds the dispatch rule this
measures).

    PYTHONPATH=. python bench/bench_dense_documents.py [--lengths 8192,32768] [--docs 1,3,10,100]
        [--candidates causal,dispatch,segments,kernel,flex,varlen] [--out $OUT]

Geometry: Hq=64, Hkv=4, D=128, B=1, bf16 (MSA's production layer). Document lengths: the row cut
at n - 1 points drawn uniformly (seeded), or `--lengths-from FILE` (a JSON list of a corpus's
document lengths, e.g. from bench/corpus_documents.py describe: the row is filled with documents
drawn from it, cut at the row's end). Every candidate runs on the same inputs in the same run;
times are medians of back-to-back fwd+bwd calls (CUDA events). Candidates:
  causal    torch's causal kernel (cuDNN, falling back to flash) on the whole row, documents
            ignored: the yardstick (what an unmasked step costs)
  dispatch  document_attention as the layers call it (its plan built once per micro-batch and
            shared by the layers: its build is timed apart, "plan ms")
  segments  the "segments" path forced (each document alone, padded to its bucket's length)
  kernel    the ops' Triton dense kernels with the starts (the path before the dispatch)
  flex      FlexAttention with a document block mask (compiled; the mask's build timed apart)
  varlen    torch.nn.attention.varlen.varlen_attn where this torch has it (k, v repeated to Hq
            heads: no GQA there)
Also per mix: the share of the causal query-key pairs the documents keep ("keys"), each
candidate's largest output difference to the kernel path ("err") and its first call's wall time
("first ms": with the compilation a new shape costs; cuDNN builds a graph per shape, which is
why the segments path draws its shapes from a small set, plan.py). Prints a markdown table;
with --out writes OUT/dense_documents.json.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch

from msa_model.platform.compat import causal_attention_with_lse
from msa_model.ops.dense_attention import build_plan, document_attention
from msa_model.ops.sparse_attention import sparse_attention

HQ, HKV, D = 64, 4, 128


def timeit(fn, budget_ms=600.0, max_iters=40, first: dict | None = None):
    """Median ms of back-to-back calls of fn (CUDA events), after a warm-up call; `first` gets
    the warm-up call's wall ms under "ms" (with any compilation: cuDNN builds a graph per new
    shape, Triton and torch.compile a kernel)."""
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    if first is not None:
        first["ms"] = (time.perf_counter() - t) * 1e3
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    est = (time.perf_counter() - t) * 1e3
    iters = int(max(3, min(max_iters, budget_ms / max(est, 1e-3))))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for a, b in events:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in events)


def document_lengths(T: int, n: int, seed: int, corpus: list[int] | None) -> list[int]:
    """Lengths of the row's documents, summing to T."""
    gen = torch.Generator().manual_seed(seed)
    if corpus:
        out = []
        while sum(out) < T:
            out.append(corpus[int(torch.randint(len(corpus), (1,), generator=gen))])
        out[-1] -= sum(out) - T
        return [x for x in out if x > 0]
    if n == 1:
        return [T]
    cuts = sorted(torch.randperm(T - 1, generator=gen)[:n - 1].add(1).tolist())
    bounds = [0, *cuts, T]
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])]


def starts_of(lengths: list[int]) -> torch.Tensor:
    """int32 [1, T] document starts of consecutive documents of these lengths."""
    out = []
    pos = 0
    for n in lengths:
        out += [pos] * n
        pos += n
    return torch.tensor([out], dtype=torch.int32)


def fwd_bwd(fn, q, k, v, do):
    qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))

    def run():
        qq.grad = kk.grad = vv.grad = None
        fn(qq, kk, vv).backward(do)
    return run


_FLEX = {}


def flex_candidate(doc: torch.Tensor, T: int):
    """(attention fn, mask build ms): FlexAttention with a document-causal block mask."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if "fn" not in _FLEX:
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    d = doc[0]

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (kv_idx >= d[q_idx])

    def build():
        return create_block_mask(mask_mod, 1, None, T, T, device="cuda")

    build_ms = timeit(build, max_iters=5)
    mask = build()

    def run(q, k, v):
        o = _FLEX["fn"](q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=mask, enable_gqa=True)
        return o.transpose(1, 2)
    return run, build_ms


def varlen_candidate(lengths: list[int]):
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    longest = max(lengths)
    H = HQ // HKV

    def run(q, k, v):
        kk, vv = (x[0].repeat_interleave(H, dim=1) for x in (k, v))
        o = varlen_attn(q[0], kk, vv, cu, cu, longest, longest, is_causal=True)
        return o[None]
    return run


def measure(T: int, n_docs: int, candidates: list[str], seed: int, corpus) -> dict:
    lengths = document_lengths(T, n_docs, seed, corpus)
    doc = starts_of(lengths).cuda()
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, T, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, T, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, T, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    do = torch.randn(1, T, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    scale = 1 / math.sqrt(D)
    plan_ms = timeit(lambda: build_plan(doc.cpu(), 0, "cuda"), max_iters=10)
    plan = build_plan(doc.cpu(), 0, "cuda")
    row = {"T": T, "docs": len(lengths), "keys": plan.key_area() / (T * (T + 1) / 2), "plan": plan.path,
           "plan_ms": plan_ms, "buckets": [(b.length, b.n) for b in plan.buckets],
           "padded": plan.padded_area() / (T * (T + 1) / 2)}
    fns = {
        "causal": lambda q, k, v: causal_attention_with_lse(q, k, v, scale)[0],
        "dispatch": lambda q, k, v: document_attention(q, k, v, doc, plan=plan)[0],
        "kernel": lambda q, k, v: sparse_attention(q, k, v, None, doc_start=doc, check_ids=False)[0],
    }
    # one document a row is a segment of the row's length here (the dispatch takes "causal" there)
    seg_plan = build_plan(doc.cpu(), 0, "cuda", segments=True)
    fns["segments"] = lambda q, k, v: document_attention(q, k, v, doc, plan=seg_plan, path="segments")[0]
    if "flex" in candidates:
        fns["flex"], row["flex_mask_ms"] = flex_candidate(doc, T)
    if "varlen" in candidates:
        fn = varlen_candidate(lengths)
        if fn is not None:
            fns["varlen"] = fn
    with torch.no_grad():
        want = fns["kernel"](q, k, v).float()
    for name in candidates:
        if name not in fns:
            continue
        try:
            with torch.no_grad():
                row[f"{name}_err"] = float((fns[name](q, k, v).float() - want).abs().max())
            first = {}
            row[f"{name}_ms"] = timeit(fwd_bwd(fns[name], q, k, v, do), first=first)
            row[f"{name}_first_ms"] = first["ms"]
        except Exception as e:  # a candidate this torch cannot run: named in the table
            row[f"{name}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        torch.cuda.empty_cache()
    print(json.dumps(row), flush=True)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="8192,32768")
    ap.add_argument("--docs", default="1,3,10,100")
    ap.add_argument("--candidates", default="causal,dispatch,segments,kernel,flex,varlen")
    ap.add_argument("--lengths-from", default=None, help="JSON list of a corpus's document lengths")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    corpus = json.loads(Path(a.lengths_from).read_text()) if a.lengths_from else None
    candidates = a.candidates.split(",")
    rows = []
    for T in (int(x) for x in a.lengths.split(",")):
        for n in ((0,) if corpus else (int(x) for x in a.docs.split(","))):
            rows.append(measure(T, n, candidates, a.seed, corpus))
    head = ["T", "docs", "keys"] + [f"{c} ms" for c in candidates] + ["dispatch path", "plan ms"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        cells = [f"{r['T'] // 1024}K", str(r["docs"]), f"{r['keys']:.2f}"]
        for c in candidates:
            ms = r.get(f"{c}_ms")
            cells.append(f"{ms:.2f}" if ms is not None else r.get(f"{c}_error", "-")[:40])
        cells += [r["plan"], f"{r['plan_ms']:.2f}"]
        print("| " + " | ".join(cells) + " |")
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "dense_documents.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
