# Call 2 ran the kernel before it moved into the package, from a script whose --variants were
# stages:loader warps:loader registers (4 and 48 were kept: gluon_backward.LOADER_WARPS, LOADER_REGS);
# with the packaged kernel the same comparison is `gluon_bwd.py --stages 2,3` below.
source .dev/setup.sh
exec > $OUT/call2.log 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
G=bench/results/long-context-2026-12-06/gluon_bwd.py
timeout 80 python3 $G --T 8192,32768 --stages 2,3; echo "rc $? gluon_bwd"
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
M=smsp__pcsamp_warps_issue_stalled_long_scoreboard,smsp__pcsamp_warps_issue_stalled_wait,smsp__pcsamp_warps_issue_stalled_barrier,smsp__pcsamp_warps_issue_stalled_short_scoreboard,smsp__pcsamp_warps_issue_stalled_mio_throttle,smsp__pcsamp_warps_issue_stalled_lg_throttle,smsp__pcsamp_warps_issue_stalled_selected,smsp__pcsamp_warps_issue_stalled_math_pipe_throttle,smsp__pcsamp_warps_issue_stalled_membar,smsp__pcsamp_warps_issue_stalled_sleeping,smsp__pcsamp_warps_issue_stalled_no_instructions,smsp__pcsamp_warps_issue_stalled_dispatch_stall,smsp__pcsamp_warps_issue_stalled_misc
timeout 60 $NCU --clock-control none --launch-skip 1 --launch-count 1 --kernel-name gluon_bwd_kernel --section SpeedOfLight --metrics $M python3 $G --T 8192 --stages 2 > $OUT/ncu_gluon.txt 2>&1; echo "rc $? ncu"
grep -v "^==PROF==\|^  gluon\|^T=" $OUT/ncu_gluon.txt | grep -A60 "gluon_bwd_kernel" | grep -v "^\s*$\|----" | head -50
