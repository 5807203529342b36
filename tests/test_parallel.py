"""Every parallel layout trains like one process: TP, PP, EP, DP and CP alone and TP combined with
CP and with EP, each layout's ranks processes of their own over gloo on CPU, fp32. So do the memory
and speed options of one process: activation recomputation (bit for bit) and grouped-GEMM experts
(within 1e-5).

Each layout runs two steps of the tiny MSA-MoE model from the same initial weights and data: step
1 in the indexer warmup (dense attention, dense KL), step 2 sparse (top-k blocks). Compared with
the one-process run, per step: the logged lm loss, indexer KL, MoE aux loss and grad norm, the
validation's lm loss and KL after the step, and every parameter's full-shape gradient just before
the optimizer step (every rank's copy). The ranks are forked from processes that have imported
the trainer (tests/train_server.py): start-up, not training, would dominate otherwise.

Tolerance: 1e-5 relative (gradients: max |diff| over the tensor / max |reference|), about 100x
the measured fp32 reduction-order noise (<= 5e-7); a wrong scale of any loss or gradient path
(KL by TP or CP, a double-counted replica) shows as >= 1e-2.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import train_server
from skeleton_helpers import REPO, TINY_TEST, _env, free_port

RTOL = 1e-5
# 4 x 256 tokens: warmup in step 1 only; a validation batch after each step (both phases)
TWO_STEPS = ["trainer.max_steps=2", "trainer.indexer_warmup_tokens=1024", "trainer.eval_interval=1",
             "trainer.eval_iters=1", "trainer.probe_tasks=[passkey]", "trainer.probe_samples=4"]
# the retrieval probe's scores at each evaluation (its rank: a mean of integers, which a reduction
# order could move only by a tie)
PROBE = ("valid/probe/passkey/answer_loss", "valid/probe/passkey/answer_rank", "valid/probe/passkey/exact")

# name -> (processes, overrides). The padded vocabulary (a multiple of 64 x TP here) is the same
# at every layout, or the padded logits would change the softmax.
LAYOUTS = {
    "tp2": (2, ["parallel.tp=2", "parallel.sequence_parallel=true", "model.make_vocab_size_divisible_by=64"]),
    "pp2": (2, ["parallel.pp=2"]),
    "ep2": (2, ["parallel.ep=2"]),
    "dp2": (2, []),
    "cp2": (2, ["parallel.cp=2"]),
    "tp2_cp2": (4, ["parallel.tp=2", "parallel.cp=2", "parallel.sequence_parallel=true",
                    "model.make_vocab_size_divisible_by=64"]),
    # expert tensor parallelism: the dispatcher gathers each TP rank's tokens, a different count a rank
    "tp2_ep2": (4, ["parallel.tp=2", "parallel.ep=2", "parallel.sequence_parallel=true",
                    "model.make_vocab_size_divisible_by=64"]),
    # one process, other execution of the same math
    "recompute_full": (1, ["model.recompute=full"]),
    "recompute_selective": (1, ["model.recompute=selective"]),
    "grouped_gemm": (1, ["model.moe_grouped_gemm=true"]),
    "grouped_gemm_ep2": (2, ["model.moe_grouped_gemm=true", "parallel.ep=2"]),
}
# recomputation reruns the same operations on the same inputs: nothing may differ at all
TOLERANCE = {"recompute_full": 0.0, "recompute_selective": 0.0}
# layouts whose first micro-batch per rank holds the same samples as the one-process run's
SAME_MICRO_BATCHES = ("tp2", "pp2", "cp2", "tp2_cp2")


def _argv(out, *args: str, cache) -> list[str]:
    """tests/parallel_main.py's overrides: the tiny model, two steps, the layout's `args`."""
    vocab = [] if any(a.startswith("model.make_vocab_size_divisible_by") for a in args) else [
        "model.make_vocab_size_divisible_by=128"]
    return [*TINY_TEST, *TWO_STEPS, *vocab, f"data.cache_dir={cache}", f"run_dir={out}/run", *args]


def _documents(root) -> list[str]:
    """A corpus of short files (most 256-token samples hold several documents), masked; a tenth
    of them for validation, which one sample's tokens need."""
    corpus = root / "corpus"
    corpus.mkdir()
    gen = torch.Generator().manual_seed(0)
    for i in range(80):
        letters = torch.randint(0, 26, (int(torch.randint(20, 300, (1,), generator=gen)),), generator=gen)
        (corpus / f"doc{i:02d}.txt").write_text("".join(chr(97 + int(c)) for c in letters))
    return ["data.document_mask=true", f"data.source={corpus}", "data.glob=*.txt", "data.split=[90,10,0]"]


DOCUMENT_LAYOUTS = ("cp2", "tp2")


def _launch(out, nproc: int, args: list[str], save_init=None) -> list[subprocess.CompletedProcess]:
    """tests/parallel_main.py at `nproc` ranks, one process each: forked from processes that have
    imported the trainer (tests/train_server.py; rank r from the r-th, so no two ranks share a hash
    seed, as under torchrun), or under torchrun where forking is off."""
    argv = [str(REPO / "tests" / "parallel_main.py"), str(out), *args,
            *([f"--save-init={save_init}"] if save_init else [])]
    if train_server.enabled():
        envs = [_env()] if nproc == 1 else [
            {**_env(), "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)} for port in [free_port()] for r in range(nproc)]
        return train_server.run_together([(argv, env) for env in envs], REPO, timeout=300)
    cmd = [sys.executable, *argv] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        f"--master-port={free_port()}", *argv]
    return [subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
    """Every run of this file, in turn: the one-process reference first (it saves the initial
    weights every layout starts from: the initialisation draws differ with the pipeline layout),
    then each layout; the same for the corpus of packed documents. name -> (its output directory,
    its number of ranks, its processes)."""
    root = tmp_path_factory.mktemp("parallel")
    init, doc_init = root / "init", root / "documents-init"
    jobs = {"reference": (1, _argv(root / "reference", cache=data_cache), init)}
    for layout, (nproc, overrides) in LAYOUTS.items():
        jobs[layout] = (nproc, _argv(root / layout, *overrides, f"init_from={init}", cache=data_cache), None)
    docs, doc_cache = _documents(root), root / "documents-cache"
    jobs["documents"] = (1, _argv(root / "documents", *docs, cache=doc_cache), doc_init)
    for layout in DOCUMENT_LAYOUTS:
        jobs[f"documents-{layout}"] = (2, _argv(root / f"documents-{layout}", *LAYOUTS[layout][1], *docs,
                                                f"init_from={doc_init}", cache=doc_cache), None)
    return {name: (root / name, nproc, _launch(root / name, nproc, args, save))
            for name, (nproc, args, save) in jobs.items()}


def _results(runs, name: str) -> list[list[dict]]:
    """A run's per rank, per step {"metrics", "grads"}; its output if it failed."""
    out, nproc, procs = runs[name]
    failed = [p for p in procs if p.returncode != 0]
    if failed:
        raise AssertionError(f"{name} failed: " + "\n".join(f"exit {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
                                                           for p in failed))
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(nproc)]


@pytest.fixture(scope="module")
def reference(runs):
    return _results(runs, "reference")[0]


def assert_same_diagnostics(ref_steps: list[dict], ranks: list[list[dict]], layout: str) -> None:
    """Every step's `msa/*` diagnostics of rank 0 equal the single process's."""
    diag = [k for k in ref_steps[0]["metrics"] if k.startswith("msa/")]
    assert len(diag) > 20
    for i, ref in enumerate(ref_steps):
        for key in diag:
            a, b = ref["metrics"][key], ranks[0][i]["metrics"][key]
            assert abs(a - b) <= 1e-4 * max(abs(a), 1e-2), (layout, i, key, a, b)


def max_differences(ref_steps: list[dict], ranks: list[list[dict]]) -> dict[str, float]:
    """Largest relative difference of each logged metric and of any gradient, over steps and ranks."""
    scalars = ("lm_loss", "kl_loss", "moe_aux_loss", "grad_norm", "grad_norm_msa_index", "valid/lm_loss",
               "valid/kl_loss", *PROBE)
    worst = dict.fromkeys((*scalars, "grads"), 0.0)
    for i, ref in enumerate(ref_steps):
        for key in scalars:
            a, b = ref["metrics"][key], ranks[0][i]["metrics"][key]
            worst[key] = max(worst[key], abs(a - b) / max(abs(a), 1e-30) if a or b else 0.0)
        seen = set()
        for steps in ranks:
            assert steps[i]["metrics"]["phase"] == ref["metrics"]["phase"]
            for name, grad in steps[i]["grads"].items():
                want = ref["grads"][name]
                assert grad.shape == want.shape, (name, grad.shape, want.shape)
                diff = ((grad - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
                worst["grads"] = max(worst["grads"], diff)
                seen.add(name)
        # every parameter of the model is somewhere in the layout (all stages, all experts)
        assert seen == set(ref["grads"]), sorted(set(ref["grads"]) ^ seen)[:8]
    return worst


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_one_process(runs, reference, layout):
    ref_steps = reference
    ranks = _results(runs, layout)
    assert len(ranks) == LAYOUTS[layout][0]
    assert [s["metrics"]["phase"] for s in ref_steps] == ["warmup", "sparse"]
    worst = max_differences(ref_steps, ranks)
    print(f"{layout}: max relative difference " + " ".join(f"{k}={v:.1e}" for k, v in worst.items()))
    for key, value in worst.items():
        assert value <= TOLERANCE.get(layout, RTOL), (layout, key, value)

    if layout in SAME_MICRO_BATCHES:
        # the diagnostics see the same micro-batch split over ranks: sums and counts reduce to the same values
        assert_same_diagnostics(ref_steps, ranks, layout)


@pytest.mark.slow
@pytest.mark.parametrize("layout", DOCUMENT_LAYOUTS)
def test_context_parallel_with_packed_documents(runs, layout):
    """data.document_mask=true on a corpus of short files (most 256-token samples hold several
    documents): the document starts reach every layer (the warmup's dense attention reads fewer
    keys than the causal 128.5 per query), and CP=2, where each rank holds its slices of the
    starts, and TP=2 with sequence parallelism (LAYOUTS), where each rank's hidden states hold half the
    sequence but its attention all of it, train like one process."""
    ref = _results(runs, "documents")[0]
    ranks = _results(runs, f"documents-{layout}")
    assert ref[0]["metrics"]["phase"] == "warmup" and ref[0]["metrics"]["keys_per_query"] < 100
    worst = max_differences(ref, ranks)
    print(f"{layout} with documents: max relative difference " + " ".join(f"{k}={v:.1e}" for k, v in worst.items()))
    for key, value in worst.items():
        assert value <= RTOL, (key, value)
    if layout in SAME_MICRO_BATCHES:
        # the diagnostics number each document's blocks from every key's start, on every layout
        assert_same_diagnostics(ref, ranks, layout)
