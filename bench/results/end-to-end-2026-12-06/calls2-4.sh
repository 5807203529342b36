# calls 2-4, back to back on the machine of call 1 (one H100): the proxy at 32K eager (call 1's
# block graph ran out of memory there) in three calls, `small` at 8K with the block graph
B="python bench/bench_training.py --recompute none --gpus 0"
$B --preset msa_109b_proxy --out $OUT/p32e --lengths 32768 --variants dense,pt --steps 4 -- data.document_mask=true
$B --preset small --out $OUT/s8 --lengths 8192 --variants dense,pt_graph_block --steps 6 -- data.document_mask=true
$B --preset msa_109b_proxy --out $OUT/p32f --lengths 32768 --variants pt,dense --steps 5 -- data.document_mask=true
$B --preset msa_109b_proxy --out $OUT/p32g --lengths 32768 --variants dense,pt --steps 7 -- data.document_mask=true
