# Prepared for issue 37, not yet run (the tenth session got no machine: thirteen starts tried, none came): the
# Gluon backward's GPU tests; the proxy at 8K with packed documents, dense against MSA-PT with the
# block graph, then the same MSA-PT with the Gluon backward; Gluon against Triton with the
# fewer-spills patch beside the packaged kernel; the layer core (fwd+bwd, SDPA beside it) with and
# without Gluon. In order of need: a call cut short keeps what came first.
#   bash bench/results/long-context-2026-12-06/session10/call1.sh   (on the device, carry .whl .dev)
source .dev/setup.sh
exec > $OUT/call1.log 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
S=bench/results/long-context-2026-12-06
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_sparse_attention_triton.py -k gluon; echo "rc $? tests"
B="python3 bench/bench_training.py --gpus 0 --preset msa_109b_proxy --lengths 8192 --recompute none --steps 6"
keep() { for f in $(find $1 -name training.json); do cp $f $OUT/$2-$(basename $(dirname $f)).json; done; rm -rf $1; }
timeout 130 $B --out /tmp/p8 --variants dense,pt_graph_block -- data.document_mask=true; echo "rc $? p8"; keep /tmp/p8 p8
timeout 80 $B --out /tmp/p8g --variants pt_graph_block -- data.document_mask=true model.msa.tuning.sparse_attention.bwd_gluon=true; echo "rc $? p8 gluon"; keep /tmp/p8g p8gluon
timeout 80 python3 $S/gluon_bwd.py --T 8192,32768 --stages 3 --patches $S/session9/fewer-spills.patch; echo "rc $? gluon_bwd"
GEOMS='[["prod",64,4,128,128]]' LENGTHS=8192,32768 VARIANTS='[{}, {"bwd_gluon": true}]' PROFILE=none \
    timeout 70 python3 bench/results/short-context-2026-12-02/short_context_probe.py; echo "rc $? layer core"
grep -h "^| " $OUT/call1.log | sort -u
