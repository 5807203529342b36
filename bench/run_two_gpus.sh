#!/usr/bin/env bash
# Two GPUs for real: the `small` preset (MSA-PT, sparse phase) under TP=2 with sequence
# parallelism, EP=2 and CP=2 against one GPU, and CP=2 throughput at 256K and 512K.
#   bash bench/run_two_gpus.sh OUT_DIR
# Parity: every run starts from the same weights (one optimizer step of a one-GPU run, saved and
# loaded with init_from, which reshards them) and reads the same samples, so the first steps'
# losses must agree within bf16 noise. Prints each run's step lines; bench/HISTORY.md holds them.
set -euo pipefail
out=${1:?usage: bench/run_two_gpus.sh OUT_DIR}
py=${PYTHON:-python3}
mkdir -p "$out"
common=(model=small recipe=pt trainer.indexer_warmup_tokens=0 parallel.micro_batch_size=1 optim.warmup_steps=1
        logging.log_interval=1 logging.wandb_mode=disabled logging.tensorboard=false logging.progress_bar=false
        checkpoint.interval=0 data.cache_dir="$out/data")
one() { CUDA_VISIBLE_DEVICES=0 "$py" train.py "${common[@]}" "$@"; }
two() { "$py" -m torch.distributed.run --standalone --nproc-per-node=2 train.py "${common[@]}" "$@"; }
show() { grep -E "step [0-9]+/|out of memory|Error" "$1" | sed "s|^|$2 |" || true; }

# shared starting weights at 32K
one model.seq_length=32768 parallel.global_batch_size=2 trainer.max_steps=1 optim.warmup_steps=0 run_dir="$out/init" \
    > "$out/init.log" 2>&1
init="$out/init/checkpoints"
parity=(model.seq_length=32768 parallel.global_batch_size=2 trainer.max_steps=3 checkpoint.save_at_end=false
        init_from="$init")
one "${parity[@]}" run_dir="$out/gpu1" > "$out/gpu1.log" 2>&1; show "$out/gpu1.log" "1gpu "
# the padded vocabulary must not change with TP (a multiple of 64 x 2 = 128, as one GPU pads to 128)
two "${parity[@]}" parallel.tp=2 parallel.sequence_parallel=true model.make_vocab_size_divisible_by=64 run_dir="$out/tp2" > "$out/tp2.log" 2>&1
show "$out/tp2.log" "tp2  "
two "${parity[@]}" parallel.ep=2 run_dir="$out/ep2" > "$out/ep2.log" 2>&1; show "$out/ep2.log" "ep2  "
two "${parity[@]}" parallel.cp=2 run_dir="$out/cp2" > "$out/cp2.log" 2>&1; show "$out/cp2.log" "cp2  "

# long context over two GPUs: CP=2, whole-layer recompute
for T in 262144 524288; do
  two model.seq_length=$T parallel.global_batch_size=1 parallel.cp=2 model.recompute=full trainer.max_steps=4 \
      checkpoint.save_at_end=false run_dir="$out/cp2-$T" > "$out/cp2-$T.log" 2>&1 || true
  show "$out/cp2-$T.log" "cp2 T=$T "
done
