"""MSA: MiniMax Sparse Attention MoE pretraining on megatron-core."""
