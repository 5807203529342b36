"""MSA: MiniMax Sparse Attention MoE pretraining on megatron-core."""

from msa_model import quiet as _quiet

# before any entry point imports megatron: notices already dealt with stay out of the output
_quiet.install()
