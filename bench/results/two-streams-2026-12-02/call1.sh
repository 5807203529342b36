#!/bin/bash
# Call 1: GPU tests of the two-stream hybrid, then the sparse forward (32K, 128K) and the 8K/32K
# layer core, the day's starting tree (.headtree) and the new one on one machine.
set -u
D=bench/results/two-streams-2026-12-02
P=bench/results/short-context-2026-12-02
echo "== tests"; date
timeout 240 python3 -m pytest -q -p no:cacheprovider -x tests/test_sparse_attention_triton.py tests/test_late_teacher.py \
    -k "hybrid or two_streams or tile or late or default" 2>&1 | tail -4
echo "== sparse attention, new"; date
ARGS="--parts tiles --T 32768,131072 --patterns realistic,random --tile-variants [{}]"
timeout 200 python3 bench/bench_sparse_attention.py $ARGS --flex 2>&1 | grep -v "^tiles check" | tail -8
echo "== sparse attention, head"; date
(cd .headtree && timeout 150 python3 bench/bench_sparse_attention.py $ARGS 2>&1 | grep -v "^tiles check" | tail -7)
echo "== layer core, new / head"; date
export GEOMS='[["prod", 64, 4, 128, 128]]' LENGTHS=8192,32768 PROFILE=none VARIANTS='[{}, {"bwd_tiles": 32}]'
timeout 90 env PYTHONPATH=$PYTHONPATH:$P python3 $P/short_context_probe.py 2>&1 | tail -3
(cd .headtree && timeout 90 env PYTHONPATH=$PYTHONPATH:$P python3 $P/short_context_probe.py 2>&1 | tail -3)
date
