"""Can Triton 3.6 build the producer/consumer structure the gather backward lacks (HISTORY
2026-12-06, "What holds the gather backward at 8K")? A Gluon kernel for sm_90a in which a 1-warp
loader partition gathers 64 rows of Q by row ids into a 3-stage shared-memory ring with 16-byte
cp.async (an mbarrier per stage, full and empty), while the default partition of 4 warps
computes S^T = K Q^T for each tile by wgmma and releases the stage. It only compiles (no GPU is
needed) and prints what the PTX holds:

    python bench/results/long-context-2026-12-06/gluon_feasibility.py

Found (eighth session): it compiles, with cp.async.cg of 16 bytes, wgmma m64n64k16 and
setmaxnreg for the partitions, 82 KB of shared memory. Three things it took: GluonASTSource (not
ASTSource) for a stand-alone compile, 16-byte divisibility on the pointers (the launcher's own
specialisation) or cp.async falls back to 2-byte copies and fails, and no reduction inside the
partitions (a `gl.sum` there fails verification: no warp count in its context). Under
TRITON_INTERPRET=1 a Gluon launch still asks for a GPU driver: such a kernel can be tested on
the GPU only. Nothing here ran: the barriers' arrival counts and the phases are unchecked."""
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource as ASTSource
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, fence_async_shared


@gluon.jit
def _loader(Q, ROWS, q_ring, full, empty, ntiles, R: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [1, 1], [1, 0])
    r = gl.arange(0, R, layout=gl.SliceLayout(1, layout))
    d = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    for i in range(ntiles):
        s = i % STAGES
        ph = (i // STAGES) & 1
        mbarrier.wait(empty.index(s), ph ^ 1)
        rows = gl.load(ROWS + i * R + r)
        ptrs = Q + rows.to(gl.int64)[:, None] * D + d[None, :]
        async_copy.async_copy_global_to_shared(q_ring.index(s), ptrs)
        async_copy.mbarrier_arrive(full.index(s), increment_count=False)


@gluon.jit
def _mma(K, OUT, k_smem, q_ring, full, empty, ntiles, BS: gl.constexpr, R: gl.constexpr, D: gl.constexpr,
         STAGES: gl.constexpr):
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, R, 16])
    total = gl.zeros([BS, R], gl.float32, layout=acc_layout)
    for i in range(ntiles):
        s = i % STAGES
        ph = (i // STAGES) & 1
        mbarrier.wait(full.index(s), ph)
        acc = gl.zeros([BS, R], gl.float32, layout=acc_layout)
        acc = warpgroup_mma(k_smem, q_ring.index(s).permute((1, 0)), acc, use_acc=False)
        mbarrier.arrive(empty.index(s), count=1)
        total += acc
    rr = gl.arange(0, BS, layout=gl.SliceLayout(1, acc_layout))
    cc = gl.arange(0, R, layout=gl.SliceLayout(0, acc_layout))
    gl.store(OUT + rr[:, None] * R + cc[None, :], total)


@gluon.jit
def probe_kernel(Q, K, ROWS, OUT, ntiles, BS: gl.constexpr, R: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr):
    smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [BS, D], smem_layout)
    q_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, R, D], gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(full.index(s), count=32)
        mbarrier.init(empty.index(s), count=1)
    kl: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    kr = gl.arange(0, BS, layout=gl.SliceLayout(1, kl))
    kd = gl.arange(0, D, layout=gl.SliceLayout(0, kl))
    k_smem.store(gl.load(K + kr[:, None] * D + kd[None, :]))
    fence_async_shared()
    gl.warp_specialize([(_mma, (K, OUT, k_smem, q_ring, full, empty, ntiles, BS, R, D, STAGES)),
                        (_loader, (Q, ROWS, q_ring, full, empty, ntiles, R, D, STAGES))], [1], [48])


sig = {"Q": "*bf16", "K": "*bf16", "ROWS": "*i32", "OUT": "*fp32", "ntiles": "i32",
       "BS": "constexpr", "R": "constexpr", "D": "constexpr", "STAGES": "constexpr"}
names = list(sig)
consts = dict(BS=128, R=64, D=128, STAGES=3)
src = ASTSource(fn=probe_kernel, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()},
                attrs={(i,): [["tt.divisibility", 16]] for i in range(4)})
k = triton.compile(src, target=GPUTarget("cuda", 90, 128), options={"num_warps": 4})
print("compiled: shared", k.metadata.shared, "bytes; ptx lines", len(k.asm["ptx"].splitlines()))
print([l for l in k.asm["ptx"].splitlines() if "cp.async" in l][:3])
print([l for l in k.asm["ptx"].splitlines() if "wgmma" in l][:2])
print([l for l in k.asm["ptx"].splitlines() if "setmaxnreg" in l][:2])
