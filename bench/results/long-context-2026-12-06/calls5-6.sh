# calls 5 and 6, back to back on the H200 of call 4: the proxy at 32K causal (7 steps), then with
# packed documents (8 steps), dense and eager MSA-PT in each
B="python bench/bench_training.py --gpus 0 --preset msa_109b_proxy --lengths 32768 --variants dense,pt --recompute none"
$B --out /tmp/p32 --steps 7 -- data.document_mask=false   # call 5
$B --out /tmp/p32 --steps 8 -- data.document_mask=true    # call 6
