"""Model-level gradient checks of the index branch, run in a subprocess by tests/test_msa_gradients.py:

1. stop-gradient: in both phases, a backward of the KL alone changes exactly the index
   parameters, one of the LM loss alone none of them (the MoE aux loss is switched off so that the
   KL is the only auxiliary loss);
2. model.msa.kl_coeff = 0.25 scales the index gradients by exactly 0.25, changes no other
   gradient and leaves the logged KL (recorded without the coefficient) as it was;
3. kl_teacher=backward (the teacher from the attention's backward) logs the KL and gives the
   gradients that kl_teacher=forward does;
4. GroupNormOptimizer: the index norm and the total norm it reports equal the norms of the
   gradients, and separate clipping brings each group to its own limit.

    python tests/msa_grads_main.py key=value ...   (the tiny test overrides)
Prints "ok" at the end; any failure raises.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import msa_model  # noqa: E402,F401  (before megatron: msa_model/platform/megatron_imports.py)
from parallel_main import _compose  # noqa: E402


def _close(a: float, b: float, rel: float = 1e-5) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-12)


def main(overrides: list[str]) -> None:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from omegaconf import OmegaConf

    from msa_model.model.attention import KL_METRIC, MSASelfAttention, set_msa_phase
    from msa_model.model.gpt import build_model
    from msa_model.training.distributed import init_distributed, shutdown
    from msa_model.training.grad_norm import INDEX_GROUP
    from msa_model.training.data_setup import checkpoint_run_tokenizer
    from msa_model.training.run import _build_model, _build_optimizer

    cfg = _compose([*overrides, "model.moe_aux_loss_coeff=0.0"])
    OmegaConf.resolve(cfg)
    env = init_distributed(cfg.parallel, "cpu", cfg.trainer.seed)
    try:
        gen = torch.Generator().manual_seed(0)
        B, S = 2, cfg.model.seq_length
        tokens = torch.randint(0, 256, (B, S), generator=gen)
        labels = torch.randint(0, 256, (B, S), generator=gen)
        pos = torch.arange(S)[None].expand(B, S)

        def fresh(kl_coeff: float):
            torch.manual_seed(1)
            model_parallel_cuda_manual_seed(1)
            c = cfg.model.copy()
            c.msa.kl_coeff = kl_coeff
            model = build_model(c, cfg.parallel, 257, on_cpu=True)
            model.train()
            return model

        def grads(model, lm_weight: float, kl_scale: float, sparse: bool, rows=slice(None), cols=slice(None)):
            model.zero_grad(set_to_none=True)
            set_msa_phase(model, sparse)
            tracker = get_moe_metrics_tracker()
            tracker.clear()
            MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(kl_scale))
            logits = model(tokens[rows, cols], pos[rows, cols], None, labels=labels[rows, cols])
            (logits.mean() * lm_weight).backward()
            kl = tracker.metrics[KL_METRIC].values.clone()
            tracker.clear()
            return {n: p.grad for n, p in model.named_parameters()}, kl

        def reached(g):
            return {n for n, t in g.items() if t is not None and t.abs().max() > 0}

        model = fresh(1.0)
        index = {n for n, _ in model.named_parameters() if ".index_" in n}
        assert len(index) == 4 * cfg.model.num_layers, sorted(index)  # q/k projections and norms
        for sparse in (False, True):
            g_kl, kl_1 = grads(model, 0.0, 1.0, sparse)
            assert reached(g_kl) == index, ("KL-only backward", sparse, sorted(reached(g_kl) ^ index))
            g_lm, _ = grads(model, 1.0, 0.0, sparse)
            lm = reached(g_lm)
            assert not lm & index and any("linear_qkv" in n for n in lm), ("LM-only backward", sparse, sorted(lm & index))

            quarter = fresh(0.25)
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), quarter.parameters()))
            g_q, kl_q = grads(quarter, 1.0, 1.0, sparse)
            g_1, _ = grads(model, 1.0, 1.0, sparse)
            for n in g_1:
                want = g_1[n] * 0.25 if n in index else g_1[n]
                torch.testing.assert_close(g_q[n], want, rtol=1e-5, atol=1e-8, msg=lambda m, n=n: f"{n}: {m}")
            # the logged KL carries no coefficient
            torch.testing.assert_close(kl_q, kl_1, rtol=1e-6, atol=0)

        # the KL's teacher from the attention's backward (the Triton kernels; the interpreter on CPU):
        # the same logged KL and the same gradients as with the teacher from the KL's forward, also
        # when the layer's core (selective) or the whole layer (full) is recomputed in backward
        got = {}
        for teacher, recompute in (("forward", "none"), ("backward", "none"), ("backward", "selective"),
                                   ("backward", "full")):
            torch.manual_seed(1)
            model_parallel_cuda_manual_seed(1)
            c = cfg.model.copy()
            c.msa.backend, c.msa.kl_teacher, c.recompute = "triton", teacher, recompute
            # one row of 64 tokens, 2 of its 4 blocks read (the local one and one chosen): the
            # interpreter runs every kernel, at a cost that grows with the rows
            c.msa.topk = 2
            m = build_model(c, cfg.parallel, 257, on_cpu=True)
            m.train()
            index_passes = []
            first = next(a for a in m.modules() if isinstance(a, MSASelfAttention))
            first.index_q_proj.register_forward_hook(lambda *_: index_passes.append(1))
            got[teacher, recompute] = grads(m, 1.0, 1.0, True, slice(0, 1), slice(0, 64))
            # the index branch runs twice a step: its forward and one rebuild in backward (its own
            # checkpoint, or, under full recompute, the layer's rerun, which it does not checkpoint again)
            assert len(index_passes) == 2, (recompute, len(index_passes))
            late = [a._late_kl for a in m.modules() if isinstance(a, MSASelfAttention)]
            assert late == [teacher == "backward"] * cfg.model.num_layers, (teacher, late)
        g_f, kl_f = got["forward", "none"]
        for key in (("backward", "none"), ("backward", "selective"), ("backward", "full")):
            g_b, kl_b = got[key]
            assert torch.isfinite(kl_b).all() and (kl_b > 0).all(), (key, kl_b)
            torch.testing.assert_close(kl_b, kl_f, rtol=1e-5, atol=1e-7, msg=lambda m, key=key: f"{key}: {m}")
            for n in g_f:
                torch.testing.assert_close(g_b[n], g_f[n], rtol=1e-4, atol=1e-7,
                                           msg=lambda m, n=n, key=key: f"{key} {n}: {m}")

        # the optimizer's norms, jointly and separately clipped
        for index_clip in (None, 1e-3):
            c = cfg.copy()
            c.optim.index_clip_grad = index_clip
            c.optim.clip_grad = 1e-2
            chunks = _build_model(c, env, checkpoint_run_tokenizer(c))
            optimizer, _ = _build_optimizer(c, chunks)
            chunks[0].zero_grad_buffer()
            optimizer.zero_grad()
            set_msa_phase(chunks, False)
            MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
            chunks[0](tokens, pos, None, labels=labels).mean().backward()
            chunks[0].finish_grad_sync()
            get_moe_metrics_tracker().clear()
            named = dict(chunks[0].module.named_parameters())
            sq = {True: 0.0, False: 0.0}
            for n, p in named.items():
                sq[".index_" in n] += float(p.main_grad.double().pow(2).sum())
            rest, idx = math.sqrt(sq[False]), math.sqrt(sq[True])
            ok, total, _ = optimizer.step()
            assert ok and _close(total, math.sqrt(rest ** 2 + idx ** 2)), (total, rest, idx)
            assert _close(optimizer.grad_norms_by_group[INDEX_GROUP], idx), (optimizer.grad_norms_by_group, idx)
            inner = optimizer.chained_optimizers
            after_idx = math.sqrt(sum(float(g.double().pow(2).sum()) for o in inner
                                      for g in o.get_grads_for_grad_norm(INDEX_GROUP)))
            after_rest = math.sqrt(sum(float(g.double().pow(2).sum()) for o in inner for g in o.get_grads_for_grad_norm()))
            assert rest > 1e-2 and idx > 1e-3, (rest, idx)
            if index_clip is None:
                coeff = 1e-2 / (total + 1e-6)
                assert _close(after_idx, idx * coeff, 1e-4) and _close(after_rest, rest * coeff, 1e-4)
            else:
                assert _close(after_idx, 1e-3, 1e-4) and _close(after_rest, 1e-2, 1e-4), (after_idx, after_rest)
        print("ok")
    finally:
        shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
