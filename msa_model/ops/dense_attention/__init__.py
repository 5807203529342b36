"""document_attention: dense causal attention of packed documents (each query reads its own
document's keys), with the log-sum-exp the indexer KL's dense teacher needs, by the fastest path
for the batch's documents (plan.py, README.md).

B = batch, C = queries (positions q_offset ..), Hq = query heads, G = key/value heads (GQA
groups), D = head dim, R = packed rows.
"""

from __future__ import annotations

import torch

from msa_model.platform.compat import causal_attention_with_lse

from ..common import check_doc_start, check_qkv, default_scale, trim_keys
from ..sparse_attention import sparse_attention
from ..sparse_attention.reference import sparse_attention_reference
from .plan import DocumentPlan, attach_host_copy, bucket_uses_cudnn, build_plan, document_plan

PATHS = ("causal", "segments", "kernel")
# head dims of torch's fused causal kernels (cuDNN, flash)
FUSED_HEAD_DIMS = (64, 96, 128, 256)


def fused_causal_takes(q: torch.Tensor, backend: str = "auto") -> bool:
    """Whether torch's fused causal kernels (cuDNN, or flash) run the "causal" and "segments"
    paths for q [B, C, Hq, D]: on CUDA in fp16/bf16 with a head dim they take, unless the ops are
    told to run the reference."""
    return (q.is_cuda and backend != "reference" and q.dtype in (torch.float16, torch.bfloat16)
            and q.shape[-1] in FUSED_HEAD_DIMS)


def _causal(q, k, v, scale, cudnn: bool = True):
    """Causal GQA attention of [n, L] rows from position 0: (o [n, L, Hq, D], lse fp32 [n, L, Hq]);
    torch's fused kernels on CUDA (cuDNN unless `cudnn` is False: flash), the reference elsewhere
    (CPU tests of the paths)."""
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        return causal_attention_with_lse(q, k, v, scale, cudnn=cudnn)
    return sparse_attention_reference(q, k, v, None, 16, scale)


class _Move(torch.autograd.Function):
    """out [n_out, ...]: zeros, with out[dst] = x[src]; backward dx[src] = dout[dst]. Rows are
    unique each way (a permutation with padding), so both ways are plain copies."""

    @staticmethod
    def forward(ctx, x, src, dst, n_out):
        ctx.save_for_backward(src, dst)
        ctx.n_in = x.shape[0]
        return x.new_zeros((n_out, *x.shape[1:])).index_copy_(0, dst, x.index_select(0, src))

    @staticmethod
    def backward(ctx, dout):
        src, dst = ctx.saved_tensors
        dx = dout.new_zeros((ctx.n_in, *dout.shape[1:])).index_copy_(0, src, dout.index_select(0, dst))
        return dx, None, None, None


def _segments(q, k, v, plan: DocumentPlan, scale):
    """The "segments" path: each document cut out, padded to its bucket's length, one causal call
    per bucket (cuDNN or flash: `bucket_uses_cudnn`); outputs put back in place, padding dropped."""
    B, C, Hq, D = q.shape
    G = k.shape[2]
    rows = B * C
    qp, kp, vp = (_Move.apply(x.reshape(rows, *x.shape[2:]), plan.src, plan.dst, plan.packed) for x in (q, k, v))
    outs, lses = [], []
    backward = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    for bucket in plan.buckets:
        part = slice(bucket.offset, bucket.offset + bucket.count * bucket.length)
        shape = (bucket.count, bucket.length)
        cudnn = bucket_uses_cudnn(bucket, Hq, G, D, q.dtype, backward)
        o_b, lse_b = _causal(qp[part].view(*shape, Hq, D), kp[part].view(*shape, G, D), vp[part].view(*shape, G, D),
                             scale, cudnn)
        outs.append(o_b.reshape(-1, Hq, D))
        lses.append(lse_b.reshape(-1, Hq))
    o_p = outs[0] if len(outs) == 1 else torch.cat(outs)
    lse_p = (lses[0] if len(lses) == 1 else torch.cat(lses)).detach()
    o = _Move.apply(o_p, plan.dst, plan.src, rows).view(B, C, Hq, D)
    lse = lse_p.new_zeros(rows, Hq).index_copy_(0, plan.src, lse_p.index_select(0, plan.dst))
    return o, lse.view(B, C, Hq)


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_start: torch.Tensor,
                       scale: float | None = None, q_offset: int = 0, backend: str = "auto",
                       plan: DocumentPlan | None = None, path: str | None = None,
                       tuning=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense causal attention in which query t reads the keys doc_start[t] .. q_offset + t.

    q [B, C, Hq, D], k/v [B, >= q_offset + C, G, D], doc_start int [B, C] (as sparse_attention's).
    Returns o [B, C, Hq, D] (q's dtype) and lse fp32 [B, C, Hq] (natural log; what the indexer
    KL's dense teacher reads); differentiable in q, k, v. The same result as
    `sparse_attention(q, k, v, None, doc_start=doc_start)` up to rounding, by the path that
    `plan` names (`document_plan`: built from the starts on the host, once per micro-batch; None:
    built here, reading the starts back from the device):
      causal    every row one document, q_offset 0: torch's causal kernel on the rows as they are
      segments  q_offset 0, packed rows: each document alone, padded to a bucket length, one
                causal call per bucket (README.md)
      kernel    the ops' dense path with the starts (Triton, or the reference on CPU tensors)
    The first two need torch's fused kernels (`fused_causal_takes`); elsewhere the plan says
    "kernel". `path` forces one (tests; on CPU the reference stands in for the fused kernels).
    `tuning`: the Triton kernels' (sparse_attention.tuning.Tuning) on the "kernel" path.
    """
    B, C, _, _, D = check_qkv(q, k, v, q_offset)
    check_doc_start(doc_start, B, C, q_offset, values=False, device=q.device)
    if path is not None and path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    scale = default_scale(D, scale)
    k, v = trim_keys(C, q_offset, k, v)
    if path is None:
        if plan is None:
            plan = build_plan(doc_start.cpu(), q_offset, q.device, fused_causal_takes(q, backend))
        path = plan.path
    elif path != "kernel" and (plan is None or plan.path != path):
        plan = build_plan(doc_start.cpu(), q_offset, q.device, segments=path == "segments")
        if plan.path != path:
            raise ValueError(f"path {path!r} does not take these inputs (q_offset={q_offset}: the plan is "
                             f"{plan.path!r})")
    if path == "causal":
        return _causal(q, k, v, scale)
    if path == "segments":
        return _segments(q, k, v, plan, scale)
    return sparse_attention(q, k, v, None, scale=scale, backend=backend, q_offset=q_offset, check_ids=False,
                            doc_start=doc_start, tuning=tuning)


__all__ = ["PATHS", "DocumentPlan", "attach_host_copy", "build_plan", "document_attention", "document_plan",
           "fused_causal_takes"]
