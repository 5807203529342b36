"""`python -m msa_model.generate`: the next token is the argmax at temperature 0, a draw from the
nucleus otherwise (only its tokens, in their proportions); generation stops at the end-of-document
token, at --max-new-tokens and at the model's context; a checkpoint it cannot read, or a prompt
as long as the context, is one line and exit code 2. The converted Llama's greedy continuation
equal to transformers' is in tests/test_cpt_tokenizer.py."""

from __future__ import annotations

import pytest
import torch

from msa_model.generate import generate, next_token
from skeleton_helpers import placeholder_run, run_python


def test_the_next_token_is_the_argmax_or_a_draw_from_the_nucleus():
    gen = torch.Generator().manual_seed(0)
    logits = torch.log(torch.tensor([0.1, 0.4, 0.2, 0.3]))
    assert next_token(logits, 0.0, 1.0, gen) == 1
    # a nucleus smaller than the most likely token's probability holds that token alone
    assert {next_token(logits, 1.0, 0.05, gen) for _ in range(200)} == {1}
    # top-p 0.5: tokens 1 (0.4) and 3 (0.3; the tokens before it hold 0.4 < 0.5), drawn 4 : 3
    draws = torch.tensor([next_token(logits, 1.0, 0.5, gen) for _ in range(4000)])
    assert set(draws.tolist()) == {1, 3}
    assert (draws == 1).float().mean().item() == pytest.approx(4 / 7, abs=0.03)
    # temperature 1, no cut: the softmax's own proportions
    draws = torch.tensor([next_token(logits, 1.0, 1.0, gen) for _ in range(8000)])
    freq = torch.bincount(draws, minlength=4).double() / draws.numel()
    assert torch.allclose(freq, torch.tensor([0.1, 0.4, 0.2, 0.3], dtype=torch.float64), atol=0.02), freq
    # a low temperature sharpens toward the argmax
    assert {next_token(logits, 0.01, 1.0, gen) for _ in range(200)} == {1}


class _Counting(torch.nn.Module):
    """Stands in for the model: the most likely token after id t is t + 1 (mod V); padded rows
    past the tokenizer's vocabulary score highest of all and must never be chosen."""

    def __init__(self, vocab: int, padded: int):
        super().__init__()
        self.vocab, self.padded = vocab, padded

    def forward(self, tokens_BS, position_ids, mask):
        logits = torch.zeros(*tokens_BS.shape, self.padded)
        logits.scatter_(-1, ((tokens_BS + 1) % self.vocab).unsqueeze(-1), 5.0)
        logits[..., self.vocab:] = 100.0
        return logits


def test_generation_stops_at_the_end_of_document_the_count_and_the_context():
    model = _Counting(vocab=10, padded=16)
    assert generate(model, "cpu", [3], 20, context=64, vocab=10, eod=7) == ([4, 5, 6, 7], "end of document")
    assert generate(model, "cpu", [3], 2, context=64, vocab=10, eod=7) == ([4, 5], "max_new_tokens")
    # 5 prompt tokens in a context of 8: three more fill it
    assert generate(model, "cpu", [0, 1, 2, 3, 4], 20, context=8, vocab=10, eod=None) == ([5, 6, 7], "context")


def _generate(*args):
    return run_python(["-m", "msa_model.generate", *map(str, args)], timeout=300)


def test_what_it_cannot_use_is_one_line_and_exit_2(tmp_path):
    proc = _generate(tmp_path / "missing", "--prompt", "x")
    assert proc.returncode == 2 and proc.stderr.strip() == f"error: {tmp_path / 'missing'} does not exist"
    run, _ = placeholder_run(tmp_path)
    # the tiny model's context is 512 byte tokens: a prompt of 600 bytes is refused before the model loads
    proc = _generate(run, "--prompt", "y" * 600)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: --prompt: 600 tokens, the model's context is 512 (model.seq_length): give a shorter one")
    proc = _generate(run, "--prompt", "x", "--top-p", "0")
    assert proc.returncode == 2 and "argument --top-p: must be in (0, 1], got 0.0" in proc.stderr
