"""Corpus -> tokenizer -> megatron indexed dataset (.bin/.idx, cached) -> GPTDataset batches."""
