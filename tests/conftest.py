"""Test-session set-up shared by every test module."""

import os

import torch

# without a GPU, Triton kernels run in Triton's interpreter on CPU tensors; this must be set
# before anything imports triton
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
