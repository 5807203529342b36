# (megatron-core, hydra-core, omegaconf on PYTHONPATH; run from the repository root)
export TUNE_FWD='[{}]'
export TUNE_BWD='[{}, {"bwd_ws": true}, {"bwd_ws": true, "bwd_stages": 2}, {"bwd_ws": true, "bwd_stages": 3}, {"bwd_stages": 3}, {}]'
python bench/bench_sparse_attention.py --parts tune --tune-T 8192 2>&1 | grep "tune bwd\|rror" | head -20
