#!/usr/bin/env bash
# The quality study on real tokenized text, end to end on one GPU machine: a byte-level BPE trained
# on the machine's Python site-packages (python -m data.train_tokenizer), the same files prepared as
# an indexed dataset (python -m data.prepare), then dense vs MSA arms read it as a blend with a
# held-out split evaluated during training (scripts/quality_experiment.py).
#
#   bench/quality_bpe.sh WORK OUT BUDGET_S [quality_experiment.py arguments...]
#
# TOK_TAR=FILE.tar.gz starts from a saved tokenizer (a tar of tok/) instead of training one, so a
# study continued on another machine (--import) reads the same token ids: its prepared.json's
# sha256 of sp.bin then equals the first machine's.
set -euo pipefail
work=${1:?work dir}; out=${2:?out dir}; budget=${3:?seconds}; shift 3
start=$SECONDS
corpus=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
mkdir -p "$work" "$out"
if [ -n "${TOK_TAR:-}" ] && [ ! -f "$work/tok/tokenizer.json" ]; then tar xzf "$TOK_TAR" -C "$work"; fi
[ -f "$work/tok/tokenizer.json" ] || python3 -m data.train_tokenizer "$corpus" --glob '**/*.py' \
    --vocab-size "${VOCAB:-16384}" --max-bytes "${TOK_BYTES:-60000000}" --output "$work/tok"
[ -f "$work/data/sp.json" ] || python3 -m data.prepare "$corpus" --glob '**/*.py' --tokenizer "$work/tok" \
    --output-prefix "$work/data/sp" --workers "$(nproc)"
cp "$work/data/sp.json" "$out/prepared.json"
exec python3 scripts/quality_experiment.py --work "$work/q" --out "$out" --budget $((budget - SECONDS + start)) \
    "--data.blend=[[1.0,$work/data/sp]]" "--data.split=[99,1,0]" "$@"
