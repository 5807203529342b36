"""Round 8 probe d: the forward's combine on a side stream (Tuning.fwd_overlap) at 32K and 128K:
attention forward, the layer's forward and fwd+bwd, peak memory. Writes $OUT/probe-round8d.json.
Ran (call 5) with a switch since removed: `Tuning.fwd_overlap` made `sparse_forward` keep two
partial buffers and launch each chunk's combine on a side CUDA stream (waiting on the chunk's
kernel by `wait_stream`, the buffer's reuse two chunks later on the combine's event), so it
could run beside the next chunk's kernel. It gained nothing (bench/RESULTS.md, round 8) and
is not in the code; this script no longer runs as it stands.
"""
import dataclasses, json, os, sys, time
import torch
sys.path.insert(0, "bench")
from bench_msa_layer import BK, TOPK, make_inputs, timed, peak_gib, sdpa  # noqa
from msa_model.ops import msa_attention, sparse_attention, select_blocks
from msa_model.ops.sparse_attention import triton as sat
T0 = time.time(); OUT = {}
def say(*a): print(f"[{time.time()-T0:5.0f}s]", *a, flush=True)
def clear(xs):
    for x in xs: x.grad = None
def dump():
    json.dump(OUT, open(os.path.join(os.environ.get("OUT", "."), "probe-round8d.json"), "w"), indent=1)
for T in (32768, 131072):
    q, k, v, iq, ik = make_inputs(T); leaves = [q, k, v, iq, ik]; do = torch.randn_like(q)
    with torch.no_grad():
        bi = select_blocks(iq, ik, BK, TOPK, backend="triton")
    r = {}
    for rep in range(2):
        for ov in (False, True):
            tun = dataclasses.replace(sat.DEFAULT_TUNING, fwd_overlap=ov)
            def fb(prec="input"):
                o, kl_ = msa_attention(q, k, v, iq, ik, BK, TOPK, backend="triton", kl_teacher="backward",
                                       index_precision=prec, tuning={"sparse_attention": tun})
                torch.autograd.backward([o, kl_], [do, torch.ones_like(kl_)]); clear(leaves)
            def fwd():
                msa_attention(q, k, v, iq, ik, BK, TOPK, backend="triton", kl_teacher="backward",
                              tuning={"sparse_attention": tun})
            with torch.no_grad():
                r[f"attn_fwd_ov{int(ov)}_{rep}"] = timed(lambda: sparse_attention(q, k, v, bi, BK, backend="triton",
                                                                             check_ids=False, tuning=tun), 5)
            r[f"layer_fwd_ov{int(ov)}_{rep}"] = timed(fwd, 5)
            r[f"layer_fwdbwd_ov{int(ov)}_{rep}"] = timed(fb, 5)
            r[f"layer_fwdbwd_fp8_ov{int(ov)}_{rep}"] = timed(lambda: fb("fp8"), 5)
            if rep == 0:
                r[f"layer_peak_ov{int(ov)}"] = peak_gib(fb)
        say(T, r)
    if T == 131072:
        r["sdpa_fwdbwd"] = timed(lambda: (sdpa(q, k, v).backward(do), clear(leaves)), 3)
        with torch.no_grad():
            r["sdpa_fwd"] = timed(lambda: sdpa(q, k, v), 3)
    OUT[f"t{T}"] = r; say(T, r); dump()
    del q, k, v, iq, ik, leaves, do, bi; torch.cuda.empty_cache()
