"""Checkpoint conversion between Hugging Face GQA models (MiniMax-M3 with its MSA), DeepSpeed ZeRO
checkpoints of them, our dense baseline and MSA.

`python -m msa_model.convert {hf-to-msa, deepspeed-to-msa, dense-to-msa, msa-to-hf, verify} ...`;
the functions are in `msa_model.convert.commands`, `.deepspeed_io` and `.verify`. A model family
(its config keys, its tensor names both ways, what it cannot express) is one object listed in
`.families.FAMILIES`; `.family` says what one answers and how to add one.
"""

# the training context of a converted model: the source's max_position_embeddings, at most
# MAX_SEQ_LENGTH (--max-seq-length); DEFAULT_SEQ_LENGTH for a source that names none
MAX_SEQ_LENGTH = 32768
DEFAULT_SEQ_LENGTH = 4096
