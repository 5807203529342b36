set -x
# (megatron-core, hydra-core, omegaconf on PYTHONPATH; run from the repository root)
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
R=/tmp/run_small
python train.py model=small recipe=pt run_dir=$R parallel.micro_batch_size=4 parallel.global_batch_size=8 \
  data.source=$SP data.max_bytes=60000000 trainer.indexer_warmup_tokens=1966080 optim.warmup_steps=10 \
  trainer.max_steps=110 checkpoint.interval=110 logging.wandb_mode=disabled logging.tensorboard=false \
  logging.progress_bar=false logging.log_interval=10 2>&1 | grep -v Warn | grep "step \|error\|stopped\|finished" | tail -14
python bench/selection_coherence.py --checkpoint $R --T 8192,32768 --save /tmp/sets --save-layers 0,5,11 2>&1 | grep -v Warn | tail -12
mkdir -p $OUT/sets && cp /tmp/sets/* $OUT/sets/ && ls -la $OUT/sets
