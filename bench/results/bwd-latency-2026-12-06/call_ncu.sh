# (megatron-core, hydra-core, omegaconf on PYTHONPATH; run from the repository root)
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"
[ -n "$NCU" ] || exit 0
cd bench
timeout 400 $NCU --clock-control none --launch-skip-before-match 1 --launch-count 1 --kernel-name regex:'^sparse_bwd_kernel$' \
  --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis --section Occupancy \
  --metrics smsp__pcsamp_warps_issue_stalled_long_scoreboard,smsp__pcsamp_warps_issue_stalled_wait,smsp__pcsamp_warps_issue_stalled_math_pipe_throttle,smsp__pcsamp_warps_issue_stalled_barrier,smsp__pcsamp_warps_issue_stalled_short_scoreboard,smsp__pcsamp_warps_issue_stalled_mio_throttle,smsp__pcsamp_warps_issue_stalled_lg_throttle,smsp__pcsamp_warps_issue_stalled_dispatch_stall,smsp__pcsamp_warps_issue_stalled_selected,smsp__pcsamp_warps_issue_stalled_not_selected,smsp__pcsamp_warps_issue_stalled_no_instructions \
  python ncu_kernels.py --T 8192 --dense-T 1024 > $OUT/ncu_bwd_8k.txt 2>&1
grep -v "^==PROF==\|Warn" $OUT/ncu_bwd_8k.txt | grep -A200 "sparse_bwd_kernel" | head -150
