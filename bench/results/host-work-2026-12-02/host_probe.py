"""Host time of one MSA layer core call (msa_attention fwd + bwd) with the device kept busy, then a
CPU profile of five forward calls. Geometry: small preset (Hq=16, Hkv=4, D=Di=64, Bk=128, k=16),
bf16. Round 12 (bench/RESULTS.md): call 2 ran an earlier version (a cProfile of whole steps in
place of the CPU profile: its sleep filled the launch queue, so its listing is not used), call 4
this one, both without the schedule kernel (the op they time is otherwise unchanged by round 12);
run 5 this one with the schedule kernel's first version (its first two lines printed only).

    PYTHONPATH=. python bench/results/host-work-2026-12-02/host_probe.py     (T=... to change the length)
"""
import cProfile, io, os, pstats, sys, time
import torch
from msa_model.ops.msa_attention import msa_attention

T = int(os.environ.get("T", 32768))
Hq, Hkv, D, Di = int(os.environ.get("HQ", 16)), int(os.environ.get("HKV", 4)), int(os.environ.get("D", 64)), 64
dev, dt = "cuda", torch.bfloat16
g = torch.Generator(device=dev).manual_seed(0)
def r(*s): return torch.randn(*s, device=dev, dtype=dt, generator=g).requires_grad_()
q, k, v = r(1, T, Hq, D), r(1, T, Hkv, D), r(1, T, Hkv, D)
iq, ik = r(1, T, Hkv, Di), r(1, T, Di)
do = torch.randn(1, T, Hq, D, device=dev, dtype=dt)

def call():
    o, kl = msa_attention(q, k, v, iq, ik, block_size=128, topk=16, kl_teacher="backward", on_kl=lambda x: None)
    return o, kl

def step():
    o, kl = call()
    (o * do).sum().backward(retain_graph=False) if False else torch.autograd.backward([o, kl], [do, torch.ones_like(kl)])

for _ in range(3):
    step()
torch.cuda.synchronize()
# device time
e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
e0.record(); [step() for _ in range(5)]; e1.record(); torch.cuda.synchronize()
print(f"T={T} device+host fwd+bwd per call (sync at end): {e0.elapsed_time(e1)/5:.2f} ms")
# host time with the device kept busy
fw, bw = [], []
for _ in range(5):
    torch.cuda._sleep(2_000_000_000 // 10)  # ~100 ms of device sleep (cycles)
    t0 = time.perf_counter(); o, kl = call(); t1 = time.perf_counter()
    torch.autograd.backward([o, kl], [do, torch.ones_like(kl)]); t2 = time.perf_counter()
    fw.append((t1 - t0) * 1e3); bw.append((t2 - t1) * 1e3)
    torch.cuda.synchronize()
print(f"host ms: forward {sorted(fw)[2]:.2f}, backward {sorted(bw)[2]:.2f} (medians of 5; device busy)")
from torch.profiler import ProfilerActivity, profile
with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
    for _ in range(5):
        torch.cuda._sleep(100_000_000)
        o, kl = call()
        del o, kl
torch.cuda.synchronize()
ev = prof.key_averages()
print(ev.table(sort_by="self_cpu_time_total", row_limit=45, max_name_column_width=60))
print(prof.key_averages(group_by_stack_n=5).table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60, max_src_column_width=200))
