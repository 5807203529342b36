#!/bin/bash
# Call 4: GPU tests of the changed ops, the index build and the `small` layer core per tree, the stream
# probe, msa_109b_proxy MSA-PT at 32K per tree (.headtree = the day's starting tree), one machine.
set -u
D=bench/results/two-streams-2026-12-02
P=bench/results/short-context-2026-12-02
echo "== tests"; date
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_sparse_attention_triton.py tests/test_late_teacher.py \
    tests/test_ops_documents.py -k "two_streams or hybrid or inverse or schedule or late or document" 2>&1 | tail -2
echo "== index, new / head"; date
PYTHONPATH=$PYTHONPATH:bench timeout 60 python3 $D/index_probe.py 2>&1 | grep "^{"
(cd .headtree && PYTHONPATH=$PYTHONPATH:bench timeout 60 python3 index_probe.py 2>&1 | grep "^{")
echo "== small layer core 8K, new / head"; date
export GEOMS='[["small", 16, 4, 64, 64], ["prod", 64, 4, 128, 128]]' LENGTHS=8192 PROFILE=none VARIANTS='[{}]'
timeout 60 env PYTHONPATH=$PYTHONPATH:$P python3 $P/short_context_probe.py 2>&1 | grep "^{"
(cd .headtree && timeout 60 env PYTHONPATH=$PYTHONPATH:$P python3 $P/short_context_probe.py 2>&1 | grep "^{")
echo "== stream probe"; date
LENGTHS=32768 PYTHONPATH=$PYTHONPATH:bench timeout 100 python3 $D/stream_probe.py 2>&1 | grep "^{"
echo "== proxy 32K MSA-PT, new / head"; date
A="--preset msa_109b_proxy --lengths 32768 --variants pt --recompute none --steps 6 --gpus 0"
timeout 150 python3 bench/bench_training.py --out $OUT/new $A 2>&1 | grep "^| 32K"
(cd .headtree && timeout 150 python3 bench/bench_training.py --out $OUT/head $A 2>&1 | grep "^| 32K")
date
