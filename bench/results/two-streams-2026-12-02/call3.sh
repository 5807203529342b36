#!/bin/bash
# Call 3: GPU tests, the index build per tree, the stream probe, the sparse attention and the layer
# core per tree (.headtree = the day's starting tree), one machine.
set -u
D=bench/results/two-streams-2026-12-02
P=bench/results/short-context-2026-12-02
echo "== tests"; date
timeout 200 python3 -m pytest -q -p no:cacheprovider -x tests/test_sparse_attention_triton.py tests/test_ops_documents.py \
    -k "hybrid or two_streams or tile or inverse or schedule or document or default" 2>&1 | tail -3
echo "== index, new / head"; date
PYTHONPATH=$PYTHONPATH:bench timeout 60 python3 $D/index_probe.py 2>&1 | grep "^{"
(cd .headtree && PYTHONPATH=$PYTHONPATH:bench timeout 60 python3 index_probe.py 2>&1 | grep "^{")
echo "== stream probe"; date
PYTHONPATH=$PYTHONPATH:bench timeout 150 python3 $D/stream_probe.py 2>&1 | grep "^{"
echo "== sparse attention, new / head"; date
ARGS="--parts tiles --T 32768,131072 --patterns realistic,random --tile-variants [{}]"
timeout 150 python3 bench/bench_sparse_attention.py $ARGS 2>&1 | grep -v "^tiles check" | tail -6
(cd .headtree && timeout 150 python3 bench/bench_sparse_attention.py $ARGS 2>&1 | grep -v "^tiles check" | tail -6)
echo "== layer core, new / head"; date
export GEOMS='[["prod", 64, 4, 128, 128]]' LENGTHS=8192,32768 PROFILE=none VARIANTS='[{}]'
timeout 70 env PYTHONPATH=$PYTHONPATH:$P python3 $P/short_context_probe.py 2>&1 | grep "^{"
(cd .headtree && timeout 70 env PYTHONPATH=$PYTHONPATH:$P python3 $P/short_context_probe.py 2>&1 | grep "^{")
date
