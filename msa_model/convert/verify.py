"""Check a conversion by numbers: our model's logits against the transformers model's.

`our_logits(...)` runs one of our checkpoints (at any TP, under torchrun) on token batches in the
indexer-warmup mode (dense attention: the main branch is exactly a dense source model's
attention) or, for MiniMax-M3, whose transformers model runs MSA itself, in the top-k mode;
`compare(...)` reports max |logit difference| and the mean KL(p_source || p_ours) per token.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.nn.functional as F

from msa_model.convert import megatron_io as mio
from msa_model.convert.config_keys import text_config
from msa_model.convert.families import detect_family
from msa_model.convert.hf_io import read_config


def random_tokens(vocab_size: int, batches: int, seq_length: int, seed: int) -> torch.Tensor:
    """int64 [batches, seq_length] uniform over the vocabulary."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batches, seq_length), generator=gen)


@torch.no_grad()
def our_logits(src: str, tokens_BS: torch.Tensor, *, tp: int = 1, ep: int = 1, model_config: str | None = None,
               sparse: bool = False, both_phases: bool = False):
    """fp32 logits [B, S, V] (V = model.vocab_size, padding removed) of our checkpoint at `src`.

    `sparse=False` is the indexer-warmup phase (dense attention), `True` the top-k phase;
    `both_phases=True` returns {False: dense logits, True: sparse logits}. Under
    torchrun with tp * ep > 1 every rank runs the same tokens and returns the full logits.
    """
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from msa_model.model.attention import set_msa_phase

    from msa_model.convert.commands import _padded_vocab_in_checkpoint

    cfg = mio.load_model_config(model_config or mio.find_model_config(src))
    if cfg.vocab_size is None:
        # a model trained here (tokenizer vocabulary): all its padded rows, as msa-to-hf exports them
        cfg = dataclasses.replace(cfg, vocab_size=_padded_vocab_in_checkpoint(src))
    parallel = mio.init_megatron(tp=tp, ep=ep, sequence_parallel=tp > 1 and cfg.num_experts > 0)
    model = mio.build(cfg, parallel)
    mio.load(model, src)
    B, S = tokens_BS.shape
    position_ids = torch.arange(S).unsqueeze(0).expand(B, S)
    phases = {}
    for phase in (False, True) if both_phases else (sparse,):
        set_msa_phase(model, sparse=phase)
        out = model(tokens_BS, position_ids, None)
        # GPTModel returns this rank's vocabulary shard, [B, S, V/tp]
        full = gather_from_tensor_model_parallel_region(out.transpose(0, 1).contiguous()).transpose(0, 1)
        phases[phase] = full[..., : cfg.vocab_size].float()
    return phases if both_phases else phases[sparse]


@torch.no_grad()
def hf_logits(hf_dir: str, tokens_BS: torch.Tensor) -> torch.Tensor:
    """fp32 logits [B, S, V] of the transformers model in `hf_dir` (its own class, eager attention)."""
    import transformers

    cfg = read_config(hf_dir)
    fam = detect_family(cfg)
    archs = [a for a in cfg.get("architectures") or () if a in (fam.architecture, *fam.aliases)]
    cls = getattr(transformers, archs[0] if archs else fam.architecture)
    model = cls.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    return model(tokens_BS).logits.float()


def compare(reference_BSV: torch.Tensor, ours_BSV: torch.Tensor) -> dict[str, float]:
    """max |diff| and mean over tokens of KL(softmax(reference) || softmax(ours)), in fp64."""
    ref, ours = reference_BSV.double(), ours_BSV.double()
    log_p, log_q = F.log_softmax(ref, -1), F.log_softmax(ours, -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return {"max_abs_diff": (ref - ours).abs().max().item(), "mean_kl": kl.mean().item(),
            "tokens": int(ref.shape[0] * ref.shape[1])}


def verify(hf_dir: str, src: str, *, batches: int = 2, seq_length: int = 64, seed: int = 0, tp: int = 1,
           ep: int = 1, model_config: str | None = None, save_logits: str | None = None) -> dict:
    """Parity of our checkpoint `src` with the transformers model in `hf_dir` on random tokens, in
    the indexer-warmup phase (top-k for MiniMax-M3, which transformers runs sparse).
    `save_logits` also stores {tokens, logits, sparse_logits}."""
    from msa_model.convert.commands import _require_checkpoint_dir

    cfg = read_config(hf_dir)
    _require_checkpoint_dir(src)
    sparse = detect_family(cfg).runs_msa
    tokens = random_tokens(int(text_config(cfg)["vocab_size"]), batches, seq_length, seed)
    ours = our_logits(src, tokens, tp=tp, ep=ep, model_config=model_config, both_phases=True)
    result = {"tp": tp, "ep": ep, "phase": "sparse (top-k)" if sparse else "dense (indexer warmup)",
              **compare(hf_logits(hf_dir, tokens), ours[sparse])}
    if save_logits:
        Path(save_logits).parent.mkdir(parents=True, exist_ok=True)
        torch.save({"tokens": tokens, "logits": ours[False], "sparse_logits": ours[True]}, save_logits)
    return result
