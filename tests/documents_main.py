"""The model on packed documents: a packed row gives each document's tokens the losses of that
document run alone.

    python tests/documents_main.py OUT_JSON key=value ...

Builds the model as train.py does (one process), packs documents of several lengths into two
rows with end-of-document tokens between them, derives the document starts the data pipeline
gives (`data.datasets.document_starts`) and compares per-token LM losses of the packed rows with
those of every document run on its own, for the MSA model in both phases (indexer warmup, top-k)
and for the dense baseline. Positions are not reset in the packed rows, so the two runs differ
only by RoPE's rounding at other absolute positions. Writes {name: max relative difference}, and
the same for the packed rows without document starts (which must differ: the test can fail).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

# two rows of 256 tokens: documents shorter than a block, one token long, and longer than the
# top-k x block_size keys a query reads (4 x 16 in the test model)
DOCS = [[37, 5, 1, 99, 114], [150, 106]]


def _packed(vocab: int, eod: int, seq: int, gen: torch.Generator):
    rows = []
    for lengths in DOCS:
        assert sum(lengths) == seq
        row = []
        for n in lengths:
            row += torch.randint(0, vocab, (n - 1,), generator=gen).tolist() + [eod]
        rows.append(row)
    return torch.tensor(rows)


def main(out: Path, overrides: list[str]) -> None:
    from omegaconf import OmegaConf

    from data.datasets import document_starts
    from msa_model.training.data_setup import checkpoint_run_tokenizer
    from msa_model.model.attention import set_msa_phase
    from msa_model.model.gpt import build_model
    from msa_model.training.distributed import init_distributed, shutdown
    from parallel_main import _compose

    cfg = _compose(overrides)
    OmegaConf.resolve(cfg)
    env = init_distributed(cfg.parallel, cfg.trainer.device, cfg.trainer.seed)
    results = {}
    try:
        tok = checkpoint_run_tokenizer(cfg)
        gen = torch.Generator().manual_seed(0)
        S = cfg.model.seq_length
        tokens = _packed(tok.vocab_size - 1, tok.eod, S, gen)
        labels = torch.randint(0, tok.vocab_size, tokens.shape, generator=gen)
        doc_start = document_starts(tokens, tok.eod)
        positions = torch.arange(S).expand_as(tokens)
        for attention in ("msa", "dense"):
            cfg.model.attention = attention
            torch.manual_seed(cfg.trainer.seed)
            model = build_model(cfg.model, cfg.parallel, tok.vocab_size, on_cpu=True)
            model.eval()
            for sparse in ((False, True) if attention == "msa" else (False,)):
                set_msa_phase(model, sparse)
                name = attention if attention == "dense" else ("msa_sparse" if sparse else "msa_warmup")
                with torch.no_grad():
                    packed = model(tokens, positions, doc_start, labels=labels)
                    unmasked = model(tokens, positions, None, labels=labels)
                    alone = torch.empty_like(packed)
                    for b, lengths in enumerate(DOCS):
                        a = 0
                        for n in lengths:
                            alone[b, a:a + n] = model(tokens[b:b + 1, a:a + n], torch.arange(n)[None], None,
                                                      labels=labels[b:b + 1, a:a + n])[0]
                            a += n
                scale = alone.abs().max().item()
                results[name] = (packed - alone).abs().max().item() / scale
                results[name + "_unmasked"] = (unmasked - alone).abs().max().item() / scale
                if sparse:
                    # top-k reads fewer keys than the warmup's dense attention: the phases differ
                    results["msa_phase_gap"] = (packed - warmup).abs().max().item() / scale
                warmup = packed
    finally:
        shutdown()
    out.write_text(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
