# call 4 (one H200: 128K does not fit an 80 GB H100): the proxy at 128K causal with full
# recompute, the layer at 128K against SDPA, the proxy at 32K causal over 8 steps
exec > $OUT/call4.log 2>&1
source .dev/setup.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
B="python bench/bench_training.py --gpus 0 --preset msa_109b_proxy"
keep() { for f in $(find $1 -name training.json); do cp $f $OUT/$2.json; done; rm -rf $1; }
timeout 300 $B --out /tmp/p128 --lengths 131072 --variants pt,dense --recompute full --steps 4 -- data.document_mask=false; keep /tmp/p128 p128
timeout 100 python bench/bench_msa_layer.py --no-tune --no-dense --T 131072 --budgets "" --kl-teacher backward --json $OUT/layer128k.json
timeout 160 $B --out /tmp/p32 --lengths 32768 --variants dense,pt --recompute none --steps 8 -- data.document_mask=false; keep /tmp/p32 p32
grep -h "^| " $OUT/call4.log | sort -u
