# call 1, tree e5878bf (the kernels of 68c4971: int32 offsets on): msa_109b_proxy end to end; every GPU test of the ops
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # megatron-core, hydra-core and omegaconf importable
exec > $OUT/call.log 2>&1
set -x
nvidia-smi --query-gpu=name --format=csv,noheader
keep() { cp $OUT/$1/training.json $OUT/$1.json; rm -rf $OUT/$1; }
B="python bench/bench_training.py --preset msa_109b_proxy --recompute none --gpus 0"
timeout 125 $B --out $OUT/p8 --lengths 8192 --variants dense,pt_graph_block --steps 6 -- data.document_mask=true 2>&1 | tail -4
keep p8
timeout 125 $B --out $OUT/p32 --lengths 32768 --variants dense,pt_graph_block --steps 5 -- data.document_mask=true 2>&1 | tail -4
keep p32
timeout 190 python -m pytest -q $(python -c "import xdist" 2>/dev/null && echo "-n 12") -p no:cacheprovider tests/test_sparse_attention_triton.py tests/test_ops_documents.py \
  tests/test_late_teacher.py tests/test_msa_attention_gpu.py tests/test_ops_q_offset.py tests/test_fp8_probs.py \
  tests/test_cuda_graph_gpu.py tests/test_model_gpu.py tests/test_indexer_kl_triton.py tests/test_select_blocks_triton.py \
  tests/test_select_local_blocks.py tests/test_layer_kernels.py tests/test_mlp_glu.py tests/test_dense_documents.py \
  tests/test_grouped_experts.py tests/test_kl_temperature.py > $OUT/gpu_tests.log 2>&1; echo rc $?; tail -8 $OUT/gpu_tests.log
timeout 125 python bench/bench_training.py --preset msa_109b_proxy --recompute full --gpus 0 --out $OUT/p128 --lengths 131072 --variants dense,pt --steps 3 -- data.document_mask=false 2>&1 | tail -4
keep p128
