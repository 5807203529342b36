"""model.msa.cuda_graph's bookkeeping around a replay, on CPU: torch.cuda.make_graphed_callables
stands in as a capture that runs the core once and replays that give its outputs without running
the core again (what a CUDA graph does: kernels, no Python). The graphs' numbers on a GPU are
tests/test_cuda_graph_gpu.py's."""

from __future__ import annotations

import torch

from msa_model.model.attention import MSAOptions, MSASelfAttention, msa_settings


def _fake_make_graphed_callables(body, samples, pool=None):
    """Runs `body` once on the samples (the capture); a replay returns o from its q (so q's
    gradient, and its hooks, come with the backward) and the capture's KL and keys."""
    POOLS.append(pool)
    _, kl, keys = body(*samples)
    return lambda q, *rest: (q * 2.0, kl, keys)


POOLS = []  # the memory pool each capture was given


def _layer(monkeypatch):
    """An MSASelfAttention with the state `_graphed_core` reads, a stub core that (like the op)
    takes the KL's teacher from the backward when a backward follows (grad enabled) and from the
    forward otherwise, and a list of the KLs it records after a backward."""
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", _fake_make_graphed_callables)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", object)
    POOLS.clear()
    layer = MSASelfAttention.__new__(MSASelfAttention)
    torch.nn.Module.__init__(layer)
    layer.settings, layer._graphs, layer._late_kl = msa_settings(MSAOptions(), None), {}, False
    layer.recorded = []

    def core(q, k, v, iq, ik, doc_start=None, record_late_kl=True):
        layer._late_kl = torch.is_grad_enabled()
        return q * 2.0, (iq.float() ** 2).mean(), torch.ones(())

    layer._core, layer._record_kl = core, layer.recorded.append
    return layer


def _inputs():
    return tuple(torch.randn(1, 8, 2, 4, requires_grad=True) for _ in range(5))


def test_a_replay_keeps_the_late_kl_of_its_capture(monkeypatch):
    """An eager forward between two replays (validation, whose KL comes from the forward) must not
    decide for the replay: its KL is still filled in by the backward, so the forward must not
    record it (it holds NaN there) and the backward must, once."""
    layer = _layer(monkeypatch)
    layer._graphed_core(*_inputs())
    assert layer._late_kl and len(layer.recorded) == 0
    with torch.no_grad():
        layer._core(*_inputs())
    assert not layer._late_kl
    q, *rest = _inputs()
    o, kl, _ = layer._graphed_core(q, *rest)
    assert layer._late_kl and len(layer._graphs) == 1
    o.sum().backward()
    assert len(layer.recorded) == 1 and layer.recorded[0] is kl


def test_a_layers_graphs_share_one_memory_pool(monkeypatch):
    """Each new input shape captures a graph of its own, into the layer's one pool; another layer
    has another pool."""
    first, second = _layer(monkeypatch), _layer(monkeypatch)
    first._graphed_core(*_inputs())
    first._graphed_core(*(torch.randn(1, 16, 2, 4, requires_grad=True) for _ in range(5)))
    first._graphed_core(*_inputs())  # a replay: no capture
    second._graphed_core(*_inputs())
    assert len(POOLS) == 3 and POOLS[0] is POOLS[1] is not None and POOLS[2] is not POOLS[0]
