"""python -m msa_model.generate CHECKPOINT --prompt TEXT [options]: text from a checkpoint.

A quick look at what a run, or a conversion, has learned. The prompt is tokenized with the
checkpoint's tokenizer and starts as the run's documents did (its BOS where data.add_bos), then
goes on one token at a time: the most likely one (--temperature 0, the default), or one drawn at
--temperature from the smallest set of tokens that holds --top-p of the probability, seeded by
--seed. Each new token runs the model over the whole text again (no KV cache: the index branch
selects blocks over the text as in training), so this is for short checks within the model's
context (model.seq_length), not for serving. MSA models select their top-k blocks (the sparse
phase) unless --phase dense. It stops after --max-new-tokens, at the end-of-document token, or at
the context's end.

CHECKPOINT is what `python -m msa_model.eval` takes: a run directory, a checkpoint root (with
`latest`) or a step_* directory, or a conversion's output. --prompt again gives more prompts, each
continued on its own by the model loaded once. The text goes to stdout (--json: one object a line,
the prompt's and the new tokens' ids and the text); a line on stderr for each says how many tokens
were made and why it stopped.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import warnings

import torch

warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\..*")
warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed\..*")
warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed\.checkpoint\..*")
warnings.filterwarnings("ignore", category=FutureWarning, module=r"msa_model\.cpu_shim")

log = logging.getLogger(__name__)


def next_token(logits_V: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    """The id that follows, from the logits of the last position: the argmax at temperature 0,
    else a draw from softmax(logits / temperature) cut to the most likely tokens whose
    probabilities first reach `top_p` together (the token that crosses it included)."""
    if temperature == 0:
        return int(logits_V.argmax())
    probs = torch.softmax(logits_V.double() / temperature, dim=-1)
    if top_p < 1.0:
        p, order = probs.sort(descending=True)
        # a token stays when the tokens before it hold less than top_p
        keep = (p.cumsum(0) - p) < top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], p[keep])
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def generate(model, device, prompt_ids: list[int], max_new: int, context: int, vocab: int, eod: int | None,
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0) -> tuple[list[int], str]:
    """(the new ids, why it stopped: "max_new_tokens", "end of document" or "context")."""
    from msa_model.eval.runner import _logits

    generator = torch.Generator().manual_seed(seed)
    ids, new = list(prompt_ids), []
    while len(new) < max_new:
        if len(ids) >= context:
            return new, "context"
        logits = _logits(model, torch.tensor([ids], device=device))[0, -1, :vocab].float().cpu()
        token = next_token(logits, temperature, top_p, generator)
        ids.append(token)
        new.append(token)
        if token == eod:
            return new, "end of document"
    return new, "max_new_tokens"


def run(args) -> list[dict]:
    from msa_model.eval.runner import EvalError, build_model, load_config, resolve_checkpoint, untrained_index
    from msa_model.model.attention import set_msa_phase
    from msa_model.training.data_setup import checkpoint_run_tokenizer, document_bos
    from msa_model.training.distributed import shutdown
    from msa_model.training.run_dir import setup_logging

    setup_logging(None, True)
    # stdout is the text's: the log goes to stderr
    root = logging.getLogger()
    for console in list(root.handlers):
        to_stderr = logging.StreamHandler(sys.stderr)
        to_stderr.setFormatter(console.formatter)
        to_stderr.filters = list(console.filters)
        root.removeHandler(console)
        root.addHandler(to_stderr)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise EvalError("--device cuda: CUDA is not available here (--device auto or cpu)")
    step_dir, config_path = resolve_checkpoint(args.checkpoint)
    cfg = load_config(config_path, step_dir)
    tokenizer = checkpoint_run_tokenizer(cfg, step_dir)
    bos = document_bos(cfg.data, tokenizer)
    context = cfg.model.seq_length
    prompts = [([bos] if bos is not None else []) + [int(i) for i in tokenizer.tokenize(text)] for text in args.prompt]
    for n, ids in enumerate(prompts, 1):
        which = f"--prompt #{n}" if len(prompts) > 1 else "--prompt"
        if not ids:
            raise EvalError(f"{which}: empty (the model needs a token to go on from)")
        if len(ids) >= context:
            raise EvalError(f"{which}: {len(ids):,} tokens, the model's context is {context:,} "
                            "(model.seq_length): give a shorter one")
    msa = cfg.model.attention == "msa"
    untrained = untrained_index(step_dir) if msa and args.phase == "sparse" else None
    if untrained:
        log.warning("the index branch is %s: the sparse phase selects with it (--phase dense reads every key)",
                    untrained)
    model, device = build_model(cfg, step_dir, args.device)
    try:
        if msa:
            set_msa_phase(model, args.phase == "sparse")
        results = []
        for ids in prompts:
            started = time.perf_counter()
            new, stop = generate(model, device, ids, args.max_new_tokens, context, tokenizer.vocab_size,
                                 tokenizer.eod, args.temperature, args.top_p, args.seed)
            log.info("%d new tokens in %.1f s (%s, %s attention%s); stopped: %s", len(new),
                     time.perf_counter() - started, step_dir, cfg.model.attention,
                     f", {args.phase} phase" if msa else "", stop)
            results.append({"checkpoint": str(step_dir), "prompt_ids": ids, "ids": new,
                            "text": tokenizer.detokenize(new), "stopped": stop})
    finally:
        shutdown()
    return results


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def _non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0.0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _count(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m msa_model.generate", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a run dir, a checkpoint root (with `latest`), a step_* directory or a "
                                      "conversion's output")
    p.add_argument("--prompt", required=True, action="append",
                   help="the text to go on from (again for more prompts, each continued on its own)")
    p.add_argument("--max-new-tokens", type=_count, default=64)
    p.add_argument("--temperature", type=_non_negative, default=0.0, help="0: the most likely token (default)")
    p.add_argument("--top-p", type=_fraction, default=1.0, help="sample from the tokens holding this much probability")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--phase", choices=["sparse", "dense"], default="sparse",
                   help="MSA models: top-k selection (sparse) or the warmup's dense attention")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--json", action="store_true", help="print one JSON object (ids and text) instead of the text")
    args = p.parse_args(argv)

    from msa_model.eval.runner import EvalError

    try:
        results = run(args)
    except EvalError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    for prompt, result in zip(args.prompt, results):
        # --json: one object a line; text: each prompt with its continuation, a blank line between
        print(json.dumps(result) if args.json else prompt + result["text"] + ("\n" if len(results) > 1 else ""),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
