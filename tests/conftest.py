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


# seconds each file took in `make test` on 2 cores (2026-12-06, `--durations=0`: 2,037 s of tests in
# 1,045 s; the first file beside the SLURM campaign gets the smaller share of the cores; files not
# listed took less than 10 s; the files whose tests changed since, that time scaled by the change of
# a one-process run of the file). A file missing here goes last, so a long one left out makes the
# run's tail. The SLURM campaign (172 s), whose jobs are most of its time, leads
FILE_SECONDS = {
    "test_sparse_attention_triton.py": 202, "test_multi_gpu_driver.py": 85, "test_parallel.py": 78,
    "test_ops_documents.py": 77, "test_readme.py": 73, "test_quality_experiment.py": 65, "test_train_resume.py": 65,
    "test_convert_checkpoints.py": 61, "test_recipes.py": 58, "test_late_teacher.py": 52, "test_failures.py": 52,
    "test_select_blocks_triton.py": 47, "test_ops_q_offset.py": 46, "test_inputs.py": 43, "test_resume_tokens.py": 42,
    "test_parallel_checkpoint.py": 40, "test_indexer_kl_triton.py": 39, "test_preemption.py": 35,
    "test_convert_deepspeed.py": 31, "test_retrieval_probe.py": 30, "test_deterministic.py": 30,
    "test_train_blend.py": 28, "test_convert_m3.py": 27, "test_msa_gradients.py": 26, "test_convert_hf.py": 23,
    "test_msa_diagnostics.py": 21, "test_cpt_tokenizer.py": 21, "test_fp8_probs.py": 21, "test_data_prepare.py": 20,
    "test_checkpoint_guards.py": 20, "test_slurm_launcher.py": 18, "test_kl_temperature.py": 16,
    "test_train_skeleton.py": 15, "test_train_dp.py": 14, "test_convert_errors.py": 13, "test_run_dir_lock.py": 12,
    "test_dense_documents.py": 11,
}


def pytest_collection_modifyitems(config, items):
    """Longest files first, whole files kept in their order: `make test` runs two workers that
    take a file at a time in this order (`--dist loadfile --no-loadscope-reorder`), so the long
    ones run side by side from the start and the short ones fill the end."""
    def rank(item) -> float:
        if item.get_closest_marker("slurm"):
            return -1e9
        return -FILE_SECONDS.get(item.path.name, 0)

    items.sort(key=rank)


def pytest_unconfigure(config):
    """Every process removes its cache directory, also `make test`'s controller, which runs no
    fixture (its workers, importing this file themselves, tokenize into caches of their own)."""
    shutil.rmtree(_SESSION_CACHE, ignore_errors=True)


@pytest.fixture(scope="module")
def megatron_one_gpu():
    """megatron's parallel state for one process on the GPU (the GPU tests' models)."""
    from msa_model.config import ParallelConfig
    from msa_model.training.distributed import init_distributed, shutdown

    init_distributed(ParallelConfig(), "cuda", 1234)
    yield
    shutdown()


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
