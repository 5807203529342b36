"""MSA: MiniMax Sparse Attention MoE pretraining on megatron-core."""

from msa_model.platform import megatron_imports as _megatron_imports
from msa_model.platform import quiet as _quiet

# before any entry point imports megatron: notices already dealt with stay out of the output, and
# what megatron imports for features not used here stays out (platform/megatron_imports.py)
_quiet.install()
_megatron_imports.install()
