"""MSA attention ops. Public API (layout [B, T, H, D]); each op has a `backend` (msa_attention: in
its `MSASettings`): "reference" (readable PyTorch, the ground truth), "triton" (fused kernels) or
"auto". The Triton kernels' launch settings: each op's `tuning.py`, all three in `KernelTuning`."""

from .dense_attention import document_attention
from .indexer_kl import indexer_kl_loss
from .msa_attention import MSAOutput, MSASettings, late_teacher_applies, msa_attention
from .select_blocks import select_blocks
from .sparse_attention import sparse_attention
from .tuning import KernelTuning

__all__ = ["select_blocks", "sparse_attention", "indexer_kl_loss", "msa_attention", "MSASettings", "MSAOutput",
           "KernelTuning", "late_teacher_applies", "document_attention"]
