# call 1 (one H100): the first Gluon gather backward against the Triton kernel at 8K and 32K, then
# the subset probe (gluon_dv_probe.py); .dev/setup.sh installs the wheels of .whl/ (see .whl/README)
# and sets PYTHONPATH. The first version is a script of its own, made by gluon_bwd_v1.patch from
# the packaged kernel as commit c24cd9d has it:
S=bench/results/long-context-2026-12-06/session9
git show c24cd9d:msa_model/ops/sparse_attention/gluon_backward.py > $S/gluon_backward_c24cd9d.py
patch -s -o $S/gluon_bwd_v1.py $S/gluon_backward_c24cd9d.py $S/gluon_bwd_v1.patch
source .dev/setup.sh
exec > $OUT/call1.log 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
G=bench/results/long-context-2026-12-06/session9/gluon_bwd_v1.py
for v in 2:4:48 3:4:48 2:1:48; do timeout 100 python3 $G --T 8192 --variants $v; echo "rc $? gluon_bwd $v"; done
timeout 100 python3 $G --T 32768 --variants 2:4:48,3:4:48; echo "rc $? gluon_bwd 32K"
P=bench/results/long-context-2026-12-06/gluon_dv_probe.py
for v in triton:8:1 gluon:2:4 gluon:3:4; do timeout 60 python3 $P $v; echo "rc $? ($v)"; done
