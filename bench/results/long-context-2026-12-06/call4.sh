# call 4 (one H200: the proxy's 128K does not fit an 80 GB H100): the proxy at 8K with packed
# documents (dense against MSA-PT with the block graph), at 128K causal with full recompute, and
# the layer at 128K against SDPA
exec > $OUT/call4.log 2>&1
source .dev/setup.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
B="python bench/bench_training.py --gpus 0 --preset msa_109b_proxy"
keep() { for f in $(find $1 -name training.json); do cp $f $OUT/$2.json; done; rm -rf $1; }
timeout 130 $B --out /tmp/p8 --lengths 8192 --variants dense,pt_graph_block --recompute none --steps 6 -- data.document_mask=true; keep /tmp/p8 p8
timeout 290 $B --out /tmp/p128 --lengths 131072 --variants pt,dense --recompute full --steps 4 -- data.document_mask=false; keep /tmp/p128 p128
timeout 90 python bench/bench_msa_layer.py --no-tune --no-dense --T 131072 --budgets "" --kl-teacher backward --json $OUT/layer128k.json
grep -h "^| " $OUT/call4.log | sort -u
