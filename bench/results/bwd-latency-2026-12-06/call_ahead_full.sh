set -x
# (megatron-core, hydra-core, omegaconf on PYTHONPATH; run from the repository root; ahead-i32.patch applied)
nvidia-smi --query-gpu=name --format=csv,noheader
bash bench/results/bwd-latency-2026-12-06/call_ahead.sh
cd bench/results/short-context-2026-12-02
GEOMS='[["prod",64,4,128,128],["small",16,4,64,64]]' LENGTHS=8192,32768 PROFILE=none \
  VARIANTS='[{}, {"bwd_ahead": true, "bwd_i32": true}, {"bwd_i32": true}, {}]' python short_context_probe.py 2>&1 | grep -v Warn
