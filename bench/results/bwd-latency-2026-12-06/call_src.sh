# (megatron-core, hydra-core, omegaconf on PYTHONPATH; run from the repository root)
cd bench
timeout 300 ncu --clock-control none --launch-skip-before-match 1 --launch-count 1 --kernel-name regex:'^sparse_bwd_kernel$' \
  --section SourceCounters --section WarpStateStats -o $OUT/bwd8k -f python ncu_kernels.py --T 8192 --dense-T 1024 > /dev/null 2>&1
ncu -i $OUT/bwd8k.ncu-rep --page source --csv --print-source sass > /tmp/src.csv 2>&1
python3 results/bwd-latency-2026-12-06/parse_ncu_source.py /tmp/src.csv
