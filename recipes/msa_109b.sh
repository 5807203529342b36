#!/usr/bin/env bash
# Submit the three experiments of the MSA report at full scale (109B MSA-MoE, 64 nodes x 8 GPUs):
#
#   recipes/msa_109b.sh dense            Full-attention baseline, 3T tokens
#   recipes/msa_109b.sh pt               MSA-PT: MSA from scratch, 3T tokens, first 40B indexer warmup
#   recipes/msa_109b.sh cpt DENSE_CKPT   MSA-CPT: convert a dense checkpoint (2.6T tokens in), then
#                                        400B tokens, first 40B indexer warmup, lower re-warmed LR
#
# Every setting is in configs/recipe/msa_109b_{dense,pt,cpt}.yaml (`python train.py
# recipe=msa_109b_pt dry_run=true` prints it); this script converts the dense checkpoint for CPT
# and submits with `python -m launch.slurm`. Extra Hydra overrides after the recipe's arguments are
# passed on (e.g. data.blend=[[0.7,/data/web],[0.3,/data/code]] run_dir=...). Set PARTITION / ACCOUNT / TIME (a SLURM
# time; the recipe's is 48:00:00) in the environment; DRY_RUN=1 prints the job script only (for CPT
# it names the conversion it would run, without running it).
set -euo pipefail
PY=${PYTHON:-python}  # the project virtualenv's python (.venv/bin/python) unless activated
cd "$(dirname "$0")/.."

recipe=${1:?usage: recipes/msa_109b.sh dense|pt|cpt [DENSE_CKPT] [overrides...]}
shift
overrides=("recipe=msa_109b_$recipe")
case "$recipe" in
  dense | pt) ;;
  cpt)
    dense_ckpt=${1:?cpt needs the dense checkpoint directory}
    shift
    converted="${dense_ckpt%/}-msa"
    convert=("$PY" -m msa_model.convert dense-to-msa "$dense_ckpt" "$converted")
    if [ -n "${DRY_RUN:-}" ] && [ ! -d "$converted" ]; then
      echo "DRY_RUN: not converting; the submission would first run: ${convert[*]}" >&2
    elif [ ! -d "$converted" ]; then
      "${convert[@]}"
    fi
    overrides+=("init_from=$converted") ;;
  *) echo "unknown recipe $recipe (dense | pt | cpt)" >&2; exit 2 ;;
esac

args=()
[ -n "${TIME:-}" ] && args+=(--time "$TIME")
[ -n "${PARTITION:-}" ] && args+=(--partition "$PARTITION")
[ -n "${ACCOUNT:-}" ] && args+=(--account "$ACCOUNT")
[ -n "${DRY_RUN:-}" ] && args+=(--dry-run)
exec "$PY" -m launch.slurm "${args[@]}" -- "${overrides[@]}" "$@"
