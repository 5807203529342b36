"""Training: distributed set-up, the loop, and its callbacks (metrics, checkpoints, warmup)."""
