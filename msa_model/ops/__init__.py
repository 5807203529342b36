"""MSA attention ops. Public API (layout [B, T, H, D]); each op has a `backend` argument:
"reference" (readable PyTorch, the ground truth), "triton" (fused kernels) or "auto"."""

from .dense_attention import document_attention
from .indexer_kl import indexer_kl_loss
from .msa_attention import late_teacher_applies, msa_attention
from .select_blocks import select_blocks
from .sparse_attention import sparse_attention

__all__ = ["select_blocks", "sparse_attention", "indexer_kl_loss", "msa_attention", "late_teacher_applies",
           "document_attention"]
