"""Test-session set-up shared by every test module."""

import os

import pytest
import torch

# without a GPU, Triton kernels run in Triton's interpreter on CPU tensors; this must be set
# before anything imports triton
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory):
    """One tokenized copy of the default corpus shared by every test run of train.py."""
    return tmp_path_factory.mktemp("data-cache")
