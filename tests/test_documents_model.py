"""Packed documents end to end: the data pipeline's document starts and the model on them.

The model runs in a subprocess (tests/documents_main.py; megatron and the CPU shim stay out of
the pytest process): each document of a packed row gets the per-token LM losses of that document
run alone, in both MSA phases and in the dense baseline.
"""

from __future__ import annotations

import json

import torch

from data.datasets import build_train_iterator, document_starts
from skeleton_helpers import REPO, TINY_TEST, run_python

EOD = 256


def test_document_starts_follow_end_of_document_tokens():
    tokens = torch.tensor([[5, EOD, 3, 4, EOD, EOD, 7],
                           [1, 2, 3, 4, 5, 6, EOD],
                           [EOD, 9, 9, 9, EOD, 2, 2]])
    want = torch.tensor([[0, 0, 2, 2, 2, 5, 6],
                         [0, 0, 0, 0, 0, 0, 0],
                         [0, 1, 1, 1, 1, 5, 5]], dtype=torch.int32)
    assert torch.equal(document_starts(tokens, EOD), want)


class _Tokens(torch.utils.data.Dataset):
    """Stands in for GPTDataset: items of tokens [S] (and what else a sample holds)."""

    class config:  # noqa: N801  the attribute path GPTDataset has
        class tokenizer:  # noqa: N801
            eod = EOD
            vocab_size = EOD + 1

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"tokens": self.rows[i], "labels": self.rows[i]}


def test_iterator_adds_document_starts_only_when_asked():
    rows = [torch.tensor([1, EOD, 2, 3]), torch.tensor([EOD, EOD, 4, 5]), torch.tensor([6, 7, 8, EOD])]
    batch = next(build_train_iterator(_Tokens(rows), 0, 3, 0, 1, document_mask=True))
    assert batch["doc_start"].dtype == torch.int32
    assert torch.equal(batch["doc_start"], document_starts(torch.stack(rows), EOD))
    assert "doc_start" not in next(build_train_iterator(_Tokens(rows), 0, 3, 0, 1))


def test_packed_documents_give_each_document_its_own_losses(tmp_path):
    out = tmp_path / "documents.json"
    cmd = [str(REPO / "tests" / "documents_main.py"), str(out), *TINY_TEST, f"run_dir={tmp_path}/run"]
    proc = run_python(cmd, timeout=600)  # forked from a process that has imported the trainer
    assert proc.returncode == 0, proc.stderr[-4000:]
    diff = json.loads(out.read_text())
    for name in ("msa_warmup", "msa_sparse", "dense"):
        # fp32 rounding of RoPE at other absolute positions: ~1e-7
        assert diff[name] < 1e-5, (name, diff)
        # without the starts, later documents see earlier ones: far off
        assert diff[name + "_unmasked"] > 1e-2, (name, diff)
    # the sparse phase reads fewer keys than the warmup's dense attention (the check above covers it)
    assert diff["msa_phase_gap"] > 1e-3, diff
