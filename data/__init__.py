"""Corpus -> tokenizer -> megatron indexed dataset (.bin/.idx, cached) -> GPTDataset batches."""

import msa_model  # noqa: E402,F401  (its import-time set-up comes before megatron's: msa_model/__init__.py)
