# call 7: `small` at 8K with packed documents (dense against MSA-PT with the block graph) and at
# 32K (dense against eager MSA-PT, with and without the mask), one machine
exec > $OUT/call7.log 2>&1
source .dev/setup.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
B="python bench/bench_training.py --gpus 0 --preset small --recompute none"
keep() { for f in $(find $1 -name training.json); do cp $f $OUT/$2.json; done; rm -rf $1; }
timeout 150 $B --out /tmp/s8 --lengths 8192 --variants dense,pt_graph_block --steps 8 -- data.document_mask=true; keep /tmp/s8 s8
timeout 150 $B --out /tmp/s32 --lengths 32768 --variants dense,pt --steps 8 -- data.document_mask=true; keep /tmp/s32 s32docs
timeout 150 $B --out /tmp/s32c --lengths 32768 --variants dense,pt --steps 8 -- data.document_mask=false; keep /tmp/s32c s32
grep -h "^| " $OUT/call7.log | sort -u
