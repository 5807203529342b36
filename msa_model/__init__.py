"""MSA: MiniMax Sparse Attention MoE pretraining on megatron-core."""

from msa_model import jit_off as _jit_off
from msa_model import quiet as _quiet

# before any entry point imports megatron: notices already dealt with stay out of the output, and
# on CPU megatron's torch.compile decorations stay off (jit_off.py)
_quiet.install()
_jit_off.install()
