"""`python -m msa_model.convert <command> ...`: checkpoint conversion (see README, "Converting dense checkpoints").

    hf-to-msa SRC OUT       Hugging Face Llama/Mistral/Qwen2/Qwen3/Qwen3-MoE/Mixtral/MiniMax-M3 dir -> our checkpoint
    deepspeed-to-msa CKPT_DIR OUT [--hf-config DIR] a DeepSpeed ZeRO checkpoint of such a model -> our checkpoint
    dense-to-msa SRC OUT    our dense-baseline checkpoint -> MSA, index projections added
    msa-to-hf SRC OUT       our checkpoint -> Hugging Face safetensors + config.json (--format minimax_m3 keeps MSA)
    verify HF_DIR SRC       logits parity of our checkpoint with the transformers model (JSON; exit 1
                            when the mean KL is above --max-mean-kl)

Errors in the input (config, tensors, damaged files) end in `error: <file>: <what is wrong>` and
exit code 2, with nothing written. An OUT that holds an earlier conversion is refused the same way
unless --overwrite is given.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from msa_model.config import PRODUCTION_BLOCK_SIZE, PRODUCTION_TOPK
from msa_model.convert import MAX_SEQ_LENGTH
from msa_model.convert.families import FAMILIES
from msa_model.convert.hf_io import ConversionError
from msa_model.convert.index_init import DEFAULT, INIT_CHOICES


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m msa_model.convert", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    def index_args(q, defaults_from_model: bool):
        q.add_argument("--index-init", choices=INIT_CHOICES, default=None,
                       help=f"index projection initialisation (default {DEFAULT}; a source carrying its index "
                            "branch keeps it)")
        keep = (" (default: the model config's)" if defaults_from_model
                else f" (default: the checkpoint's for MiniMax-M3, else chosen for the context: block "
                     f"{PRODUCTION_BLOCK_SIZE} and top-{PRODUCTION_TOPK} from 8K tokens on, smaller below; "
                     "Di = head dim)")
        q.add_argument("--block-size", type=int, default=None, help="MSA key block size" + keep)
        q.add_argument("--topk", type=int, default=None, help="MSA blocks per query" + keep)
        q.add_argument("--index-head-dim", type=int, default=None, help="Di" + keep)
        q.add_argument("--local-blocks", type=int, default=None, help="blocks ending at the query always kept" + keep)
        q.add_argument("--name", default=None, help="model config name (OUT/model/<name>.yaml)")
        q.add_argument("--seed", type=int, default=0, help="seed of the random index init")

    def hf_args(q):
        q.add_argument("--attention", choices=("msa", "dense"), default="msa")
        q.add_argument("--seq-length", type=int, default=None,
                       help="training context written to the model config (default: the source's "
                       "max_position_embeddings, at most --max-seq-length)")
        q.add_argument("--max-seq-length", type=int, default=MAX_SEQ_LENGTH,
                       help=f"cap of the default --seq-length (default {MAX_SEQ_LENGTH})")
        q.add_argument("--tokenizer", default=None, help="directory of the model's Hugging Face tokenizer, copied "
                       "into the checkpoint (default: the source directory; --hf-config's for deepspeed-to-msa)")
        for flag in ("--tp", "--pp", "--ep"):
            q.add_argument(flag, type=int, default=1, help="target layout to check the model against; the checkpoint "
                           "itself loads at any layout")
        index_args(q, defaults_from_model=False)

    q = sub.add_parser("hf-to-msa", help="Hugging Face checkpoint dir -> our dist checkpoint + model config")
    q.add_argument("src")
    q.add_argument("out")
    q.add_argument("--overwrite", action="store_true", help="replace what an earlier conversion wrote to OUT")
    hf_args(q)

    q = sub.add_parser("deepspeed-to-msa", help="DeepSpeed ZeRO 1/2/3 checkpoint of a Hugging Face model -> ours")
    q.add_argument("src", help="ZeRO checkpoint directory (holds `latest` and global_stepN/)")
    q.add_argument("out")
    q.add_argument("--overwrite", action="store_true", help="replace what an earlier conversion wrote to OUT")
    q.add_argument("--hf-config", default=None, help="directory with the model's config.json (default: the "
                   "checkpoint directory, where the Hugging Face Trainer's checkpoint-N/ has it)")
    q.add_argument("--tag", default=None, help="checkpoint tag, e.g. global_step100 (default: `latest`)")
    hf_args(q)

    q = sub.add_parser("dense-to-msa", help="our dense checkpoint -> MSA checkpoint (tensors kept bit-identical)")
    q.add_argument("src", help="checkpoint root (with `latest`) or step directory")
    q.add_argument("out")
    q.add_argument("--overwrite", action="store_true", help="replace what an earlier conversion wrote to OUT")
    q.add_argument("--model-config", default=None, help="model YAML or run config.yaml (default: found next to SRC)")
    index_args(q, defaults_from_model=True)

    q = sub.add_parser("msa-to-hf", help="our checkpoint -> Hugging Face safetensors + config.json")
    q.add_argument("src")
    q.add_argument("out")
    q.add_argument("--overwrite", action="store_true", help="replace what an earlier conversion wrote to OUT")
    q.add_argument("--format", "--family", dest="family", choices=sorted(FAMILIES), default=None,
                   help="target family (default: the family the checkpoint was converted from); minimax_m3 "
                   "keeps the index branch in a format transformers and serving engines run as MSA")
    q.add_argument("--model-config", default=None)
    q.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="tensor dtype (default: the source checkpoint's)")
    q.add_argument("--max-shard-size", type=int, default=5 * 2**30, help="bytes per safetensors shard")

    q = sub.add_parser("verify", help="logits parity with the transformers model (prints JSON)")
    q.add_argument("hf_dir")
    q.add_argument("src")
    q.add_argument("--tp", type=int, default=1, help="load at this TP (under torchrun with tp * ep processes)")
    q.add_argument("--ep", type=int, default=1, help="load at this EP")
    q.add_argument("--batches", type=int, default=2)
    q.add_argument("--seq-length", type=int, default=64)
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--model-config", default=None)
    q.add_argument("--save-logits", default=None, help="also torch.save {tokens, logits} here")
    q.add_argument("--max-mean-kl", type=float, default=1e-3,
                   help="exit 1 when the mean KL between the two models' next-token distributions is above "
                        "this (default 1e-3; a faithful conversion measures about 1e-6 in fp32)")
    return p


def earlier_result(command: str, out: str) -> str | None:
    """What an earlier run of `command` left in OUT and this one would replace (a few names), or
    None. An unfinished save's temporary directory does not count: the next save clears it."""
    out = Path(out)
    if not out.is_dir():
        return None
    if command == "msa-to-hf":
        found = [p.name for p in sorted(out.iterdir()) if p.name == "config.json" or p.suffix == ".safetensors"]
    else:
        found = ["latest"] * (out / "latest").is_file() + [p.name for p in sorted(out.glob("step_*"))]
    return ", ".join(found[:3]) or None


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("megatron").setLevel(logging.WARNING)
    from msa_model.convert import commands
    from msa_model.platform.quiet import backend_note

    if args.command != "verify" and backend_note():
        logging.getLogger(__name__).info("%s", backend_note())
    from msa_model.convert.verify import verify

    try:
        if args.command != "verify" and Path(args.out).exists() and not Path(args.out).is_dir():
            raise ConversionError(f"{args.out}: exists and is not a directory; give another OUT")
        found = earlier_result(args.command, args.out) if args.command != "verify" else None
        if found and not args.overwrite:
            raise ConversionError(f"{args.out} already holds a conversion ({found}): pass --overwrite to replace "
                                  "it, or give another OUT")
        geometry = {k: getattr(args, k, None) for k in ("block_size", "topk", "index_head_dim", "local_blocks")}
        if args.command in ("hf-to-msa", "deepspeed-to-msa"):
            kw = dict(attention=args.attention, index_init=args.index_init, tp=args.tp, pp=args.pp, ep=args.ep,
                      seq_length=args.seq_length, max_seq_length=args.max_seq_length, name=args.name, seed=args.seed,
                      tokenizer=args.tokenizer, **geometry)
            if args.command == "hf-to-msa":
                commands.hf_to_msa(args.src, args.out, **kw)
            else:
                from msa_model.convert.deepspeed_io import deepspeed_to_msa

                deepspeed_to_msa(args.src, args.out, hf_config=args.hf_config, tag=args.tag, **kw)
        elif args.command == "dense-to-msa":
            commands.dense_to_msa(args.src, args.out, model_config=args.model_config, index_init=args.index_init,
                                  name=args.name, seed=args.seed, **geometry)
        elif args.command == "msa-to-hf":
            commands.msa_to_hf(args.src, args.out, family=args.family, model_config=args.model_config,
                               dtype=args.dtype, max_shard_size=args.max_shard_size)
        else:
            result = verify(args.hf_dir, args.src, batches=args.batches, seq_length=args.seq_length, seed=args.seed,
                            tp=args.tp, ep=args.ep, model_config=args.model_config, save_logits=args.save_logits)
            import torch.distributed as dist

            if not dist.is_initialized() or dist.get_rank() == 0:
                print(json.dumps(result))
            if not result["mean_kl"] <= args.max_mean_kl:  # a NaN fails too
                print(f"error: the models differ: mean KL {result['mean_kl']:.3g} > --max-mean-kl "
                      f"{args.max_mean_kl:g} (max |logit diff| {result['max_abs_diff']:.3g})", file=sys.stderr)
                return 1
    except ConversionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        import torch.distributed as dist

        # only a conversion that got as far as building the model holds a process group; an error
        # before that stays the last line printed (no megatron import after it)
        if dist.is_initialized():
            from msa_model.training.distributed import shutdown

            shutdown()
    return 0


# the guard matters: checkpoint saving starts worker processes that re-import this module
if __name__ == "__main__":
    sys.exit(main())
