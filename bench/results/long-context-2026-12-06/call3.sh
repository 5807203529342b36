# call 3: the gather backward split over each block's keys (`Tuning.bwd_key_split`): GPU tests,
# the sparse attention alone (fwd+bwd, production geometry, random sets) and the layer core
exec > $OUT/call3.log 2>&1
source .dev/setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python -m pytest -q -n 8 tests/test_sparse_attention_triton.py tests/test_ops_documents.py 2>&1 | tail -4
for T in 8192 32768; do
  TUNE_FWD='[{}]' TUNE_BWD='[{}, {"bwd_key_split":2}, {"bwd_key_split":2,"bwd_split_warps":8}, {"bwd_key_split":2,"bwd_tiles":64}, {}]' \
    timeout 150 python bench/bench_sparse_attention.py --parts tune --tune-T $T 2>&1 | grep "tune"
done
GEOMS='[["prod",64,4,128,128],["small",16,4,64,64]]' LENGTHS=8192,32768 VARIANTS='[{}, {"bwd_key_split":2}, {}, {"bwd_key_split":2}]' PROFILE=none \
  timeout 150 python bench/results/short-context-2026-12-02/short_context_probe.py
