#!/usr/bin/env bash
# The `small` preset (12 layers, 16 experts, GQA 16q/4kv, 8K context, 16 x 128-token blocks) with
# each recipe on one GPU: dense baseline, MSA-PT, and MSA-CPT from the converted dense run.
# Prints each run's log lines; bench/HISTORY.md holds what it measured.
#   bash bench/run_small_recipes.sh OUT_DIR [STEPS]
set -euo pipefail
out=${1:?usage: bench/run_small_recipes.sh OUT_DIR [STEPS]}
steps=${2:-30}
py=${PYTHON:-python3}
mkdir -p "$out"
common=(model=small trainer.max_steps="$steps" optim.warmup_steps=5 parallel.micro_batch_size=1
        parallel.global_batch_size=8 logging.wandb_mode=disabled logging.progress_bar=false
        logging.log_interval=5 checkpoint.interval=0 data.cache_dir="$out/data")
# 10 steps of 8 x 8192 tokens of indexer warmup, then top-k
warmup=trainer.indexer_warmup_tokens=655360

run() {
  local name=$1; shift
  echo "== $name"
  timeout 240 "$py" train.py "${common[@]}" run_dir="$out/$name" "$@" 2>&1 | grep -E "step |switching|finished|Error|error" || true
}
run dense recipe=dense
timeout 120 "$py" -m msa_model.convert dense-to-msa "$out/dense/checkpoints" "$out/dense-msa" | tail -2
run pt recipe=pt "$warmup" checkpoint.save_at_end=false
run cpt recipe=cpt init_from="$out/dense-msa" "$warmup" checkpoint.save_at_end=false
