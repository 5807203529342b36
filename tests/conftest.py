"""Test-session set-up shared by every test module."""

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]

# without a GPU, Triton kernels run in Triton's interpreter on CPU tensors; this must be set
# before anything imports triton
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import msa_model  # noqa: E402,F401  (before any test imports megatron: msa_model/platform/megatron_imports.py)

# `make test`'s workers share the machine's cores: each keeps to its share for the tensors of its
# own process (torch's default, every core, has the two workers' threads wait on each other for
# no gain at the tests' sizes). The processes tests start set their own (OMP_NUM_THREADS)
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

# one tokenized corpus for the whole session, outside the repository: every train.py the tests
# start (they inherit this environment) uses it unless it names another data.cache_dir
_SESSION_CACHE = tempfile.mkdtemp(prefix="msa-test-data-")
os.environ["MSA_DATA_CACHE_DIR"] = _SESSION_CACHE


# the files that take longest (each runs many train.py / torchrun processes), longest first
LONG_FILES = ("test_parallel.py", "test_checkpoint_guards.py", "test_recipes.py", "test_convert_checkpoints.py",
              "test_train_resume.py", "test_quality_experiment.py", "test_deterministic.py", "test_readme.py",
              "test_indexer_kl_triton.py", "test_convert_m3.py",
              "test_sparse_attention_triton.py", "test_parallel_checkpoint.py", "test_train_skeleton.py",
              "test_convert_deepspeed.py", "test_preemption.py", "test_msa_diagnostics.py", "test_train_dp.py",
              "test_golden_loss.py", "test_ops_reference.py", "test_ops_q_offset.py", "test_fp8_probs.py",
              "test_dense_documents.py", "test_kl_temperature.py", "test_run_dir_lock.py")


def pytest_collection_modifyitems(config, items):
    """Longest files first, whole files kept in their order: `make test` runs two workers that
    take a file at a time in this order (`--dist loadfile --no-loadscope-reorder`), so the long
    ones run side by side from the start rather than one of them last on its own. The SLURM
    campaign leads: minutes, most of them its jobs' own processes."""
    def rank(item) -> int:
        if item.get_closest_marker("slurm"):
            return -1
        name = item.path.name
        return LONG_FILES.index(name) if name in LONG_FILES else len(LONG_FILES)

    items.sort(key=rank)


def pytest_unconfigure(config):
    """Every process removes its cache directory, also `make test`'s controller, which runs no
    fixture (its workers, importing this file themselves, tokenize into caches of their own)."""
    shutil.rmtree(_SESSION_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def data_cache():
    """One tokenized copy of the default corpus shared by every test run of train.py."""
    return Path(_SESSION_CACHE)


def _repository_outputs() -> dict[str, float]:
    """Path -> mtime of what runs leave in the repository (two levels deep)."""
    out = {}
    for top in ("runs", ".cache", "outputs", "multirun", "wandb"):
        root = REPO / top
        if root.exists():
            for path in [root, *root.iterdir(), *(q for p in root.iterdir() if p.is_dir() for q in p.iterdir())]:
                out[str(path.relative_to(REPO))] = path.stat().st_mtime
    return out


@pytest.fixture(scope="session", autouse=True)
def tests_write_only_under_temporary_directories():
    """The tests leave the repository's runs/ and .cache/ as they found them."""
    before = _repository_outputs()
    yield
    after = _repository_outputs()
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    shutil.rmtree(_SESSION_CACHE, ignore_errors=True)
    assert not changed, f"tests wrote into the repository: {changed[:10]}"
