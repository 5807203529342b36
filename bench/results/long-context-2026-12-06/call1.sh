# call 1 (one H200): the proxy at 32K with packed documents over 8 steps, the layer at 128K
# against SDPA (bf16 index scores), the proxy at 128K causal (full recompute): the long-context
# rows of issue 37 on today's kernels (int32 offsets, the hybrid forward)
exec > $OUT/call1.log 2>&1
source .dev/setup.sh
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv; git log -1 --format=%h 2>/dev/null
B="python bench/bench_training.py --gpus 0"
keep() { for f in $(find $1 -name training.json); do cp $f $OUT/$2.json; done; rm -rf $1; }
timeout 190 $B --preset msa_109b_proxy --out /tmp/p32 --lengths 32768 --variants dense,pt --recompute none --steps 8 -- data.document_mask=true; keep /tmp/p32 p32
timeout 130 python bench/bench_msa_layer.py --no-tune --no-dense --T 131072 --budgets "" --kl-teacher backward --json $OUT/layer128k.json
timeout 260 $B --preset msa_109b_proxy --out /tmp/p128 --lengths 131072 --variants pt,dense --recompute full --steps 4 -- data.document_mask=false; keep /tmp/p128 p128
