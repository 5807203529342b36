set -x
# (megatron-core, hydra-core, omegaconf on PYTHONPATH; run from the repository root)
nvidia-smi --query-gpu=name --format=csv,noheader
python bench/results/bwd-latency-2026-12-06/bit_identity_check.py prefetch 2>&1 | grep -v Warn
export TUNE_FWD='[{}, {"fwd_prefetch": 1}, {"fwd_prefetch": 2}, {}]'
export TUNE_BWD='[{}, {"bwd_prefetch": 1}, {"bwd_prefetch": 2}, {}]'
python bench/bench_sparse_attention.py --parts tune --tune-T 8192 2>&1 | grep "tune"
python bench/bench_sparse_attention.py --parts tune --tune-T 32768 2>&1 | grep "tune"
cd bench/results/short-context-2026-12-02
GEOMS='[["prod",64,4,128,128],["small",16,4,64,64]]' LENGTHS=8192,32768 PROFILE=none \
  VARIANTS='[{}, {"fwd_prefetch": 1, "bwd_prefetch": 1}, {"bwd_prefetch": 1}, {}]' python short_context_probe.py 2>&1 | grep -v Warn
