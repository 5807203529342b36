# call 2 (the machine of call 1): MSA-PT alone at 32K with packed documents, with a partial budget
# of 10 GiB, then with the default (3 GiB floor, 4 GiB cap)
exec > $OUT/call2.log 2>&1; source .dev/setup.sh
B="python bench/bench_training.py --gpus 0 --preset msa_109b_proxy --lengths 32768 --recompute none --steps 6"
timeout 120 $B --out /tmp/a --variants pt -- data.document_mask=true model.msa.tuning.sparse_attention.partial_bytes=10737418240 model.msa.tuning.sparse_attention.partial_min_bytes=10737418240
timeout 100 $B --out /tmp/b --variants pt -- data.document_mask=true
