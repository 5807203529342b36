set -x
# (megatron-core, hydra-core, omegaconf on PYTHONPATH; run from the repository root)
S=/tmp/sets; [ -d $S ] || S=.dev/sets
ls $S
python bench/bench_sparse_attention.py --parts tiles --T 8192,32768 --patterns random,realistic --sets $S --layers 0,5,11 \
  --tile-variants '[{}, {"tile_rows":128,"tile_min_queries":0,"tile_backward":true}]' 2>&1 | grep -v Warn | tail -30
