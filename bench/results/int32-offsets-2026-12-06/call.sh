# int32 offsets in the gather kernels, one call: the GPU tests of the ops that run the gather
# kernels; the proxy at 8K end to end, dense and MSA-PT (block graph, packed documents, int32
# offsets: the default) in one call. (Kernel and layer timings with and without:
# ../bwd-latency-2026-12-06/call_ahead_full.sh.) Runs from the repository root with megatron-core,
# hydra-core and omegaconf on PYTHONPATH; $OUT the output directory.
set -x
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 110 python -m pytest -q tests/test_sparse_attention_triton.py tests/test_ops_documents.py \
  tests/test_late_teacher.py tests/test_msa_attention_gpu.py 2>&1 | tail -6
timeout 175 python bench/bench_training.py --out $OUT/p8 --preset msa_109b_proxy --lengths 8192 \
  --variants dense,pt_graph_block --recompute none --steps 5 --gpus 0 -- data.document_mask=true 2>&1 | tail -6
