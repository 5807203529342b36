"""Round 10, call 1 (imported by probe_round10.py): the tile forward with its key/value steps
loaded through TMA tensor descriptors (host-side TensorDescriptor over k, v viewed [B*TK, G*D]);
no packed documents. Committed in this form (with documents) as `tile_fwd_kernel`."""
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor
from msa_model.ops.triton_utils import LN2, LOG2E, mm
from msa_model.ops.sparse_attention.triton_tiles import _tile_rows, _selected


@triton.jit
def _blk(q, hit, t, m, l, acc, KD, VD, b, g, n, TK, QOFF, qk_scale, BS: tl.constexpr, KB: tl.constexpr,
         D: tl.constexpr, MASK: tl.constexpr):
    for part in tl.static_range(BS // KB):
        j = n * BS + part * KB + tl.arange(0, KB)
        row0 = (b * TK + n * BS + part * KB).to(tl.int32)
        kt = KD.load([row0, g * D])
        vt = VD.load([row0, g * D])
        s = mm(q, tl.trans(kt)) * qk_scale
        if MASK:
            s = tl.where(hit[:, None] & (j[None, :] <= QOFF + t[:, None]), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + mm(p.to(vt.dtype), vt)
        m = m_new
    return m, l, acc


@triton.jit
def tma_tile_fwd_kernel(Q, KD, VD, O, LSE, IDS, UNION, UCOUNT, UFULL, T, TK, QOFF, NT, LIMIT, qk_scale,
                        HQ: tl.constexpr, HKV: tl.constexpr, SLOTS: tl.constexpr, KP: tl.constexpr,
                        H: tl.constexpr, HP: tl.constexpr, QT: tl.constexpr, U: tl.constexpr, BS: tl.constexpr,
                        KB: tl.constexpr, D: tl.constexpr, UP: tl.constexpr, STAGES: tl.constexpr,
                        MASKED_STAGES: tl.constexpr):
    tile = tl.program_id(0)
    bg = tl.program_id(1)
    count = tl.load(UCOUNT + bg.to(tl.int64) * NT + tile)
    if count > LIMIT:
        return
    b = (bg // HKV).to(tl.int64)
    g = bg % HKV
    t, row_ok, row, q, ids = _tile_rows(Q, IDS, b, g, tile, T, HQ, HKV, SLOTS, KP, H, HP, QT, D)
    ub = (bg.to(tl.int64) * NT + tile) * U
    nfull = tl.load(UFULL + bg.to(tl.int64) * NT + tile)
    u = tl.arange(0, UP)
    nn = tl.load(UNION + ub + u, mask=u < nfull, other=0)
    whole = tl.sum(((u < nfull) & (nn * BS + BS - 1 <= QOFF + tile * QT)).to(tl.int32), 0)
    m = tl.full([QT * HP], float("-inf"), tl.float32)
    l = tl.zeros([QT * HP], tl.float32)
    acc = tl.zeros([QT * HP, D], tl.float32)
    for u in tl.range(0, whole, num_stages=STAGES):
        n = tl.load(UNION + ub + u)
        m, l, acc = _blk(q, row_ok, t, m, l, acc, KD, VD, b, g, n, TK, QOFF, qk_scale, BS, KB, D, False)
    for u in tl.range(whole, count, num_stages=MASKED_STAGES):
        n = tl.load(UNION + ub + u)
        m, l, acc = _blk(q, _selected(ids, n), t, m, l, acc, KD, VD, b, g, n, TK, QOFF, qk_scale, BS, KB, D, True)
    empty = l == 0.0
    l_safe = tl.where(empty, 1.0, l)
    d = tl.arange(0, D)
    tl.store(O + row[:, None] * D + d[None, :], (acc / l_safe[:, None]).to(O.dtype.element_ty), mask=row_ok[:, None])
    tl.store(LSE + row, tl.where(empty, float("-inf"), (m + tl.log2(l_safe)) * LN2), mask=row_ok)


def tma_tile_forward(q, k, v, union, block_size, scale, limit=None, keys=128, stages=3, masked_stages=2, warps=8,
                     out=None):
    B, T, Hq, D = q.shape
    TK, G = k.shape[1], k.shape[2]
    H = Hq // G
    HP = triton.next_power_of_2(H)
    K = union.ids.shape[-1]
    NT, U = union.blocks.shape[2:]
    KB = min(keys, block_size)
    kd = TensorDescriptor.from_tensor(k.view(B * TK, G * D), [KB, D])
    vd = TensorDescriptor.from_tensor(v.view(B * TK, G * D), [KB, D])
    o, lse = out if out is not None else (torch.empty_like(q), torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device))
    tma_tile_fwd_kernel[(NT, B * G)](
        q, kd, vd, o, lse, union.ids, union.blocks, union.count, union.full, T, TK, 0, NT,
        U if limit is None else limit, scale * LOG2E.value, HQ=Hq, HKV=G, SLOTS=K, KP=triton.next_power_of_2(K), H=H,
        HP=HP, QT=union.queries, U=U, BS=block_size, KB=KB, D=D, UP=triton.next_power_of_2(U), STAGES=stages,
        MASKED_STAGES=masked_stages, num_warps=warps)
    return o, lse
