"""model.msa.cuda_graph on a GPU: the MSA layers' sparse core, or their whole attention block
(model.msa.cuda_graph_scope=attention, with its weights' gradients), replayed as CUDA graphs gives
the eager model's loss, gradients and logged indexer KL, step after step on new inputs and new
weights (and new packings of documents, of two table sizes), with a validation forward between
steps, and leaves validation (no graph) and the indexer warmup eager. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def _model(cuda_graph: bool, teacher_bytes: int | None = None, scope: str = "core", di: int = 64):
    from omegaconf import OmegaConf

    from msa_model.config import ModelConfig, ParallelConfig
    from msa_model.model.attention import set_msa_phase
    from msa_model.model.gpt import build_model

    m = OmegaConf.structured(ModelConfig(num_layers=3, hidden_size=256, ffn_hidden_size=512, num_attention_heads=8,
                                         num_query_groups=2, head_dim=64, seq_length=2048, num_experts=4,
                                         moe_ffn_hidden_size=256, first_dense_layers=1, params_dtype="bf16"))
    m.msa.block_size, m.msa.topk, m.msa.index_head_dim = 64, 4, di
    m.msa.cuda_graph, m.msa.cuda_graph_scope = cuda_graph, scope
    # the late teacher's rows over this budget: the KL's call runs as query chunks
    m.msa.tuning.indexer_kl.teacher_bytes = teacher_bytes
    torch.manual_seed(0)
    model = build_model(m, ParallelConfig(), 257, on_cpu=False).cuda()
    model.train()
    set_msa_phase(model, True)
    return model


def _step(model, tokens, doc_start=None):
    """Loss, every parameter's gradient and the logged KL per layer of one forward and backward."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    from msa_model.model.attention import KL_METRIC

    tracker = get_moe_metrics_tracker()
    tracker.clear()
    model.zero_grad(set_to_none=True)
    positions = torch.arange(tokens.shape[1], device="cuda").expand(tokens.shape[0], -1)
    loss = model(tokens, positions, doc_start, labels=tokens).float().mean()
    loss.backward()
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(loss), grads, tracker.metrics[KL_METRIC].values.clone()


def _doc_starts(step: int, longest: int = 900) -> torch.Tensor:
    """int32 [2, 2048] starts of documents of 1 to `longest` - 1 tokens, another packing each
    step, on the GPU with the host copy the trainer attaches. 900: a few per row, tables of 33 to
    64 blocks of 64 tokens; 40: about a hundred, tables of 65 to 128 (another graph)."""
    from msa_model.ops.common import attach_host_copy

    gen = torch.Generator().manual_seed(100 + step)
    rows = []
    for _ in range(2):
        row = []
        while len(row) < 2048:
            row += [len(row)] * int(torch.randint(1, longest, (1,), generator=gen))
        rows.append(row[:2048])
    host = torch.tensor(rows, dtype=torch.int32)
    return attach_host_copy(host.cuda(), host)


# documents-chunked: the late teacher's call as query chunks (1 MiB of the 4 MiB of rows a call)
# block-*: the whole attention block in the graph; block-index-rope: Di 32 against D 64, the index
# branch's RoPE table an input of its own
@pytest.mark.parametrize("docs,teacher_bytes,scope,di", [
    (False, None, "core", 64), (True, None, "core", 64), (True, 1 << 20, "core", 64),
    (False, None, "attention", 64), (True, None, "attention", 64), (False, None, "attention", 32)],
    ids=["rows", "documents", "documents-chunked", "block-rows", "block-documents", "block-index-rope"])
def test_graphed_core_steps_equal_the_eager_model(megatron_one_gpu, docs, teacher_bytes, scope, di):
    from msa_model.model.attention import msa_layers

    eager, graphed = _model(False, teacher_bytes, di=di), _model(True, teacher_bytes, scope, di)
    graphed.load_state_dict(eager.state_dict())
    gen = torch.Generator(device="cuda").manual_seed(1)
    for step in range(4):
        tokens = torch.randint(0, 257, (2, 2048), device="cuda", generator=gen)
        # step 2: short documents, a larger table (a second graph); step 3 replays the first again
        doc_start = _doc_starts(step, 40 if step == 2 else 900) if docs else None
        want, got = _step(eager, tokens, doc_start), _step(graphed, tokens, doc_start)
        assert abs(got[0] - want[0]) <= 1e-3 * abs(want[0]), (step, got[0], want[0])
        assert want[1].keys() == got[1].keys()
        for name, g in want[1].items():
            err = float((got[1][name] - g).norm() / g.norm().clamp_min(1e-12))
            assert err < 2e-2, (step, name, err)
        # the KL recorded after the graph's backward, not NaN nor the capture's buffer
        assert torch.isfinite(got[2]).all() and torch.allclose(got[2], want[2], rtol=1e-2, atol=1e-4), (got[2], want[2])
        # new weights for the next step, the same in both models
        with torch.no_grad():
            for p_e, p_g in zip(eager.parameters(), graphed.parameters()):
                if p_e.grad is not None:
                    p_e.add_(p_e.grad, alpha=-1e-2)
                    p_g.copy_(p_e)
        # a validation forward (the eager core, its KL from the forward) between training steps
        graphed.eval()
        with torch.no_grad():
            graphed(tokens, torch.arange(2048, device="cuda").expand(2, -1), doc_start, labels=tokens)
        graphed.train()
    # one capture per layer (with documents: per table size met, 64 and 128), reused by later steps
    counts = [len(layer._graphs) for layer in msa_layers(graphed)]
    assert counts == [2 if docs else 1] * len(counts), counts


def test_validation_and_warmup_stay_eager(megatron_one_gpu):
    from msa_model.model.attention import msa_layers, set_msa_phase

    model = _model(True)
    tokens = torch.randint(0, 257, (1, 2048), device="cuda")
    positions = torch.arange(2048, device="cuda")[None]
    with torch.no_grad():
        model.eval()
        model(tokens, positions, None, labels=tokens)
    model.train()
    set_msa_phase(model, False)
    model(tokens, positions, None, labels=tokens).float().mean().backward()
    assert all(not layer._graphs for layer in msa_layers(model))
