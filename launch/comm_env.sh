# Communication and threading settings of every SLURM launch, in one place. The sbatch template
# inlines this file into each rendered submit script; the submitit launcher sources it in the job
# before srun. Every value is a default: a variable already set in the submitting shell (sbatch
# exports it into the job) or passed with `python -m launch.slurm --env KEY=VALUE` wins.

# NCCL (GPU runs)
# - warnings only; INFO prints the topology and rings, useful when a job hangs at start-up
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# - a rank that dies makes the others fail instead of hanging until the time limit
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
# - on a collective timeout, dump the flight recorder of each rank for post-mortem
export TORCH_NCCL_DUMP_ON_TIMEOUT=${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}
# - cluster-specific; set them in your shell when the defaults pick the wrong fabric:
#   NCCL_SOCKET_IFNAME (bootstrap interface, e.g. ib0 or ^lo,docker), NCCL_IB_HCA (InfiniBand
#   adapters, e.g. mlx5), NCCL_IB_DISABLE=1 (Ethernet only), NCCL_NET_GDR_LEVEL.

# gloo (CPU runs, and the rendezvous store): the interface that reaches the other nodes;
# left unset it resolves the host name. Set GLOO_SOCKET_IFNAME in your shell if that fails.

# threads per rank: the task's CPUs split over the ranks it runs (MSA_RANKS_PER_TASK, torchrun's
# processes per node), so ranks sharing a node do not oversubscribe it
_threads=$(( ${SLURM_CPUS_PER_TASK:-1} / ${MSA_RANKS_PER_TASK:-1} ))
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( _threads > 0 ? _threads : 1 ))}
unset _threads
