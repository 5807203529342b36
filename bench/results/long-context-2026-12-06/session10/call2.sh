# The short form of call1.sh for a call with little device time left: the Gluon backward's GPU
# tests, then the proxy at 8K with packed documents, MSA-PT with the block graph without and with
# the Gluon backward (no dense lane: the ratio between the two is the Gluon kernel's gain in a step).
#   bash bench/results/long-context-2026-12-06/session10/call2.sh   (on the device, carry .whl .dev)
source .dev/setup.sh
exec > $OUT/call2.log 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_sparse_attention_triton.py -k gluon; echo "rc $? tests"
B="python3 bench/bench_training.py --gpus 0 --preset msa_109b_proxy --lengths 8192 --recompute none --steps 6"
keep() { for f in $(find $1 -name training.json); do cp $f $OUT/$2-$(basename $(dirname $f)).json; done; rm -rf $1; }
timeout 70 $B --out /tmp/p8 --variants pt_graph_block -- data.document_mask=true; echo "rc $? p8"; keep /tmp/p8 p8
timeout 70 $B --out /tmp/p8g --variants pt_graph_block -- data.document_mask=true model.msa.tuning.sparse_attention.bwd_gluon=true; echo "rc $? p8 gluon"; keep /tmp/p8g p8gluon
grep -h "^| " $OUT/call2.log | sort -u
