"""Round 10 probe c (call 3): variants of the block-id cleaning kernel at 128K (default geometry,
random and realistic sets): the kernel by pairs of slots (then in the tree, kept here as
`pair_kernel`) at other rows a program and warps, and one by tl.sort (`sort_kernel`, committed
as `clean_kernel` with 32 rows a program and 4 warps)."""
import json, os, sys
import torch, triton, triton.language as tl
sys.path.insert(0, "bench")
from bench_sparse_attention import BS, HKV, TOPK, random_sets, realistic_sets, timeit  # noqa
from msa_model.ops import inverse_index as ii


@triton.jit
def sort_kernel(IDX, OUT, rows, T, QOFF, HKV: tl.constexpr, SLOTS: tl.constexpr, KP: tl.constexpr,
                BS: tl.constexpr, RB: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * RB + tl.arange(0, RB)
    row_ok = r < rows
    slot = tl.arange(0, KP)
    ok = row_ok[:, None] & (slot < SLOTS)[None, :]
    x = tl.load(IDX + r[:, None] * SLOTS + slot[None, :], mask=ok, other=2147483647).to(tl.int32)
    pos = QOFF + ((r // HKV) % T).to(tl.int32)
    v = tl.where((x < 0) | ((x > (pos // BS)[:, None]) & (x != 2147483647)), -1, x)
    s = tl.sort(v, 1)
    prev = tl.gather(s, tl.maximum(slot - 1, 0)[None, :].broadcast_to(RB, KP), 1)
    dup = (slot[None, :] > 0) & (s == prev)
    tl.store(OUT + r[:, None] * SLOTS + slot[None, :], tl.where(dup, -1, s), mask=ok)


@triton.jit
def pair_kernel(IDX, OUT, DOC, rows, T, QOFF, HKV: tl.constexpr, SLOTS: tl.constexpr, KP: tl.constexpr,
                BS: tl.constexpr, RB: tl.constexpr, DOCS: tl.constexpr):
    """A slot's place in its sorted row is the number of smaller ids plus the number of equal ids
    in earlier slots, by pairs of the row's K slots; an id an earlier slot holds becomes -1."""
    r = tl.program_id(0).to(tl.int64) * RB + tl.arange(0, RB)
    row_ok = r < rows
    slot = tl.arange(0, KP)
    slot_ok = slot < SLOTS
    ok = row_ok[:, None] & slot_ok[None, :]
    x = tl.load(IDX + r[:, None] * SLOTS + slot[None, :], mask=ok, other=-1).to(tl.int32)
    pos = QOFF + ((r // HKV) % T).to(tl.int32)
    if DOCS:
        pos -= tl.load(DOC + r // HKV, mask=row_ok, other=0).to(tl.int32)
    v = tl.where((x < 0) | (x > (pos // BS)[:, None]), -1, x)
    vi = v[:, :, None]
    vj = v[:, None, :]
    earlier = (slot[None, :] < slot[:, None])[None, :, :] & slot_ok[None, None, :]
    same_before = (vj == vi) & earlier
    place = tl.sum((((vj < vi) & slot_ok[None, None, :]) | same_before).to(tl.int32), 2)
    repeat = tl.sum(same_before.to(tl.int32), 2) > 0
    tl.store(OUT + r[:, None] * SLOTS + place, tl.where(repeat, -1, v), mask=ok)


def run_sort(idx, RB, warps):
    B, T, G, K = idx.shape
    out = torch.empty(B, T, G, K, dtype=torch.int32, device=idx.device)
    rows = B * T * G
    sort_kernel[(triton.cdiv(rows, RB),)](idx, out, rows, T, 0, HKV=G, SLOTS=K, KP=triton.next_power_of_2(K), BS=BS,
                                          RB=RB, num_warps=warps)
    return out


def run_pair(idx, RB, warps):
    B, T, G, K = idx.shape
    out = torch.empty(B, T, G, K, dtype=torch.int32, device=idx.device)
    rows = B * T * G
    pair_kernel[(triton.cdiv(rows, RB),)](idx, out, idx, rows, T, 0, HKV=G, SLOTS=K, KP=16, BS=BS, RB=RB,
                                              DOCS=False, num_warps=warps)
    return out


T = 131072
for pat in ("random", "realistic"):
    idx = (random_sets if pat == "random" else realistic_sets)(T, HKV, TOPK, BS, "cuda")
    idx[:, ::7, :, 3] = idx[:, ::7, :, 2]  # some repeats
    want = ii.clean_block_idx_reference(idx, BS)
    r = dict(pat=pat, default=timeit(lambda: ii.clean_block_idx(idx, BS)))
    for RB, w in ((8, 4), (16, 4), (32, 4), (64, 4), (32, 8), (64, 8), (128, 8)):
        r[f"pair_{RB}_{w}"] = timeit(lambda: run_pair(idx, RB, w))
        assert torch.equal(run_pair(idx, RB, w), want)
    for RB, w in ((32, 4), (64, 4), (128, 4), (256, 4), (128, 8), (256, 8)):
        r[f"sort_{RB}_{w}"] = timeit(lambda: run_sort(idx, RB, w))
        r[f"sort_same_{RB}_{w}"] = bool(torch.equal(run_sort(idx, RB, w), want))
    print(json.dumps(r), flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "probe-round10c.jsonl"), "a") as f:
        f.write(json.dumps(r) + "\n")
