# (megatron-core, hydra-core, omegaconf on PYTHONPATH; run from the repository root; ahead-i32.patch applied)
python bench/results/bwd-latency-2026-12-06/bit_identity_check.py ahead-i32 2>&1 | grep -v Warn
export TUNE_FWD='[{}]'
export TUNE_BWD='[{}, {"bwd_ahead": true}, {"bwd_i32": true}, {"bwd_ahead": true, "bwd_i32": true}, {}]'
python bench/bench_sparse_attention.py --parts tune --tune-T 8192 2>&1 | grep "tune bwd\|rror" | head
python bench/bench_sparse_attention.py --parts tune --tune-T 32768 2>&1 | grep "tune bwd\|rror" | head
