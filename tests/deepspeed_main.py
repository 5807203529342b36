"""One DeepSpeed ZeRO training step of a tiny Hugging Face Llama, then a ZeRO checkpoint.

    torchrun --nproc-per-node=2 tests/deepspeed_main.py HF_DIR OUT_DIR STAGE [STAGE ...]

For each ZeRO stage: the model in HF_DIR (save_pretrained), wrapped by `deepspeed.initialize`
with a plain torch AdamW on CPU/gloo, takes one step on per-rank random tokens and is saved with
`engine.save_checkpoint(OUT_DIR/zero<STAGE>)`; rank 0 then writes the trained model's fp32 logits
on verify's random tokens to OUT_DIR/zero<STAGE>_logits.pt ({tokens, logits}), the numbers a
conversion of that checkpoint must reproduce.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# tokens for the logits: those `python -m msa_model.convert verify` would draw
BATCHES, SEQ, SEED = 2, 64, 0


def main(hf_dir: str, out: Path, stages: list[int]) -> None:
    import deepspeed
    import transformers

    from msa_model.convert.verify import random_tokens

    # DeepSpeed's shared-memory all-reduce for CPU is compiled on first use (minutes on a small
    # machine); gloo does the same collectives
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for stage in stages:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
                  "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        tokens = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(rank))
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
        engine.save_checkpoint(str(out / f"zero{stage}"))
        engine.eval()
        check = random_tokens(model.config.vocab_size, BATCHES, SEQ, SEED)
        with torch.no_grad():
            # every rank runs the forward: under ZeRO-3 the parameters are gathered collectively
            logits = engine(input_ids=check).logits.float()
        if rank == 0:
            torch.save({"tokens": check, "logits": logits}, out / f"zero{stage}_logits.pt")
        dist.barrier()
        engine.destroy()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), [int(s) for s in sys.argv[3:]])
    sys.stdout.flush()
    sys.stderr.flush()
    # DeepSpeed's helper threads can abort the interpreter at exit after a clean run
    os._exit(0)
