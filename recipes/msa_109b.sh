#!/usr/bin/env bash
# The three experiments of the MSA report at full scale: the 109B MSA-MoE on 64 nodes x 8 GPUs.
#
#   recipes/msa_109b.sh dense            Full-attention baseline, 3T tokens
#   recipes/msa_109b.sh pt               MSA-PT: MSA from scratch, 3T tokens, first 40B indexer warmup
#   recipes/msa_109b.sh cpt DENSE_CKPT   MSA-CPT: convert a dense checkpoint (2.6T tokens in), then
#                                        400B tokens, first 40B indexer warmup, lower re-warmed LR
#
# Everything else is the Hydra config: configs/model/msa_109b.yaml, configs/parallel/msa_109b_8k.yaml
# (4M-token steps of 512 x 8K sequences) and configs/recipe/{dense,pt,cpt}.yaml. Extra Hydra
# overrides after the recipe's arguments are passed on (e.g. data.source=/data/corpus run_dir=...).
# Set PARTITION / ACCOUNT / TIME in the environment; DRY_RUN=1 prints the job script only.
set -euo pipefail
PY=${PYTHON:-python}  # the project virtualenv's python (.venv/bin/python) unless activated
cd "$(dirname "$0")/.."

recipe=${1:?usage: recipes/msa_109b.sh dense|pt|cpt [DENSE_CKPT] [overrides...]}
shift
tokens_per_step=$((512 * 8192))
steps() { python3 -c "print(int($1 // $tokens_per_step))"; }

case "$recipe" in
  dense) overrides=(recipe=dense "trainer.max_steps=$(steps 3e12)") ;;
  pt) overrides=(recipe=pt "trainer.max_steps=$(steps 3e12)" trainer.indexer_warmup_tokens=40000000000) ;;
  cpt)
    dense_ckpt=${1:?cpt needs the dense checkpoint directory}
    shift
    converted="${dense_ckpt%/}-msa"
    [ -d "$converted" ] || "$PY" -m msa_model.convert dense-to-msa "$dense_ckpt" "$converted"
    overrides=(recipe=cpt "init_from=$converted" "trainer.max_steps=$(steps 400e9)"
               trainer.indexer_warmup_tokens=40000000000 optim.lr=1.5e-4 optim.min_lr=1.5e-5 optim.warmup_steps=500) ;;
  *) echo "unknown recipe $recipe (dense | pt | cpt)" >&2; exit 2 ;;
esac

args=(--nodes 64 --gpus-per-node 8 --time "${TIME:-48:00:00}" --job-name "msa109b-$recipe")
[ -n "${PARTITION:-}" ] && args+=(--partition "$PARTITION")
[ -n "${ACCOUNT:-}" ] && args+=(--account "$ACCOUNT")
[ -n "${DRY_RUN:-}" ] && args+=(--dry-run)
exec "$PY" -m launch.slurm "${args[@]}" -- model=msa_109b parallel=msa_109b_8k optim.lr=3e-4 optim.min_lr=3e-5 \
  optim.warmup_steps=2000 "${overrides[@]}" "$@"
