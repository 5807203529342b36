"""Checkpoint conversion between Hugging Face GQA models, our dense baseline and MSA.

`python -m msa_model.convert {hf-to-msa, dense-to-msa, msa-to-hf, verify} ...`; the functions
are in `msa_model.convert.commands` and `msa_model.convert.verify`.
"""
