"""CPT from a Hugging Face model keeps its tokenizer: a tiny random Llama and Qwen3 saved with a real
BPE tokenizer, converted with `hf-to-msa`, read the same ids as transformers gives them, score a
real text as the transformers model does, and train on a prepared dataset whose first step's loss
is the transformers model's loss on the same samples (the trainer fed it those token ids); the
offline evaluation scores the conversion with that tokenizer.

The conversions and forward passes run in worker processes (this file run as a script): megatron's
parallel state and the CPU shim stay out of pytest's process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from skeleton_helpers import metrics, run_python  # noqa: E402
from tokenizer_fixtures import make_bpe_tokenizer, stdlib_texts, write_prepared  # noqa: E402

FAMILIES = ("llama", "qwen3")
GEOMETRY = dict(seq_length=128, block_size=16, topk=2)
LOSS_RTOL = 1e-4


def _cross_entropy(logits_BSV: torch.Tensor, tokens_BS: torch.Tensor) -> float:
    """Mean next-token loss of token rows under their logits (fp64)."""
    logits, targets = logits_BSV[:, :-1].double(), tokens_BS[:, 1:]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).item()


def _convert(root: Path) -> dict:
    """Worker: convert each family, compare tokenization and the loss on a real text."""
    from transformers import AutoTokenizer

    from data.tokenizer import build_tokenizer
    from msa_model.convert.commands import hf_to_msa
    from msa_model.convert.verify import hf_logits, our_logits

    out = {}
    text = stdlib_texts(1, offset=90)[0]
    for fam in FAMILIES:
        hf, msa = root / fam / "hf", root / fam / "msa"
        hf_to_msa(str(hf), str(msa), **GEOMETRY)
        # the checkpoint's copy of the tokenizer, as training loads it, against transformers on the source
        ours = build_tokenizer(str(msa / "step_00000000" / "tokenizer"))
        ids = ours.tokenize(text)
        want = AutoTokenizer.from_pretrained(str(hf))(text, add_special_tokens=False).input_ids
        tokens = torch.from_numpy(ids[: 2 * 128].astype("int64")).view(2, 128)
        out[fam] = {"same_ids": ids.tolist() == want, "identity": ours.identity,
                    "hf_loss": _cross_entropy(hf_logits(str(hf), tokens), tokens),
                    "our_loss": _cross_entropy(our_logits(str(msa), tokens), tokens)}
    return out


def _first_batch_loss(root: Path, fam: str, run_dir: Path) -> float:
    """Worker: the transformers model's loss on the run's first global batch, rebuilt from its
    config with the trainer's own data pipeline."""
    from omegaconf import OmegaConf

    from data.datasets import build_datasets
    from msa_model.convert.verify import hf_logits
    from msa_model.training.data_setup import checkpoint_run_tokenizer

    cfg = OmegaConf.load(run_dir / "config.yaml")
    tokenizer = checkpoint_run_tokenizer(cfg, root / fam / "msa" / "step_00000000")
    train, _ = build_datasets(cfg.data, tokenizer, cfg.model.seq_length,
                              cfg.trainer.max_steps * cfg.parallel.global_batch_size)
    samples = [train[i] for i in range(cfg.parallel.global_batch_size)]
    tokens = torch.stack([torch.cat([s["tokens"], s["labels"][-1:]]) for s in samples])
    return _cross_entropy(hf_logits(str(root / fam / "hf"), tokens), tokens)


def _worker(*args: str) -> str:
    proc = run_python([__file__, *args], timeout=600)  # forked (tests/train_server.py)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from convert_fixtures import save_tiny_hf

    from data.tokenizer import build_tokenizer, copy_tokenizer_files

    root = tmp_path_factory.mktemp("cpt")
    tok = make_bpe_tokenizer(root / "tokenizer", vocab_size=300)  # the tiny models' vocabulary
    for i, fam in enumerate(FAMILIES):
        save_tiny_hf(fam, root / fam / "hf", seed=i)
        copy_tokenizer_files(tok, root / fam / "hf")
    prefix = write_prepared(root / "text", stdlib_texts(30, offset=100), build_tokenizer(str(tok)))
    return root, prefix, json.loads(_worker("convert", str(root)))


@pytest.mark.parametrize("family", FAMILIES)
def test_converted_model_reads_and_scores_text_as_transformers_does(converted, family):
    root, _, results = converted
    r = results[family]
    assert r["same_ids"] and r["identity"]["vocab_size"] == 300
    print(f"{family}: loss on real text, transformers {r['hf_loss']:.6f}, ours {r['our_loss']:.6f}")
    assert r["our_loss"] == pytest.approx(r["hf_loss"], rel=LOSS_RTOL)


def test_cpt_trains_on_the_converted_models_token_ids(converted, tmp_path):
    """recipe=cpt from the converted Llama, tokenizer unset: the checkpoint's is used, and the first
    step's loss is the transformers model's on the same samples (byte ids would score near
    ln(300) = 5.7 on an untrained model's logits too, but not equal to the tokens' loss)."""
    root, prefix, _ = converted
    msa = root / "llama" / "msa"
    run = tmp_path / "run"
    # the converted model as its checkpoint records it (not the test model of run_train)
    cmd = [sys.executable, "train.py", "recipe=cpt", f"init_from={msa}", f"data.blend=[{prefix}]", "data.document_mask=false", f"run_dir={run}",
           f"data.cache_dir={tmp_path / 'cache'}", "trainer.max_steps=2", "trainer.indexer_warmup_tokens=256",
           "parallel.micro_batch_size=2", "parallel.global_batch_size=4", "optim.warmup_steps=1",
           "logging.log_interval=1", "logging.wandb_mode=disabled", "logging.tensorboard=false",
           "logging.progress_bar=false"]
    proc = run_python(cmd[1:])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "(init_from (" in out and "vocabulary 300" in out
    first = metrics(run)[1]
    assert first["phase"] == "warmup"
    expected = float(_worker("first-batch", str(root), "llama", str(run)))
    assert first["lm_loss"] == pytest.approx(expected, rel=LOSS_RTOL)


def test_eval_scores_a_conversion_with_its_model_and_tokenizer(converted, tmp_path):
    """`python -m msa_model.eval` on a conversion's output (a checkpoint root without a run's
    config.yaml) rebuilds the model and the tokenizer the conversion records; one without a
    tokenizer, or a path that is no checkpoint, is refused before the output directory exists."""
    import shutil

    root, _, _ = converted
    msa = root / "qwen3" / "msa"
    args = ["--lengths", "256", "--depths", "0", "--samples", "1", "--tasks", "passkey", "--loss-sequences", "1"]

    def evaluate(path, out):
        return run_python(["-m", "msa_model.eval", str(path), "--out", str(out), *args], timeout=300)

    proc = evaluate(msa, tmp_path / "eval")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert res["label"] == "msa" and res["attention"] == "msa" and res["context"] == GEOMETRY["seq_length"]

    bare = tmp_path / "bare"
    shutil.copytree(msa, bare)
    shutil.rmtree(bare / "step_00000000" / "tokenizer")
    proc = evaluate(bare, tmp_path / "eval-bare")
    assert proc.returncode == 2 and "records no tokenizer" in proc.stderr, proc.stderr[-3000:]
    proc = evaluate(root, tmp_path / "eval-none")
    assert proc.returncode == 2 and "is not a checkpoint" in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "eval-bare").exists() and not (tmp_path / "eval-none").exists()


def _hf_greedy(hf_dir: Path, prompts: list[list[int]], lengths: list[int], eos: int) -> list[list[int]]:
    """Worker: transformers' greedy continuation of each prompt's ids (its own generate)."""
    import transformers

    from msa_model.convert.verify import detect_family, read_config

    fam = detect_family(read_config(str(hf_dir)))
    model = getattr(transformers, fam.architecture).from_pretrained(str(hf_dir), dtype=torch.float32,
                                                                    attn_implementation="eager").eval()
    return [model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=eos,
                           pad_token_id=eos)[0, len(ids):].tolist() for ids, n in zip(prompts, lengths)]


def test_generate_continues_a_conversion_as_transformers_does(converted):
    """`python -m msa_model.generate` on the converted Llama, dense phase (transformers attends to
    every key): its greedy continuations of four prompts, token for token, are transformers'
    generate's."""
    from data.tokenizer import build_tokenizer

    root, _, _ = converted
    prompts = [a for offset in range(95, 99) for a in ("--prompt", stdlib_texts(1, offset=offset)[0][:100])]
    proc = run_python(["-m", "msa_model.generate", str(root / "llama" / "msa"), *prompts, "--phase", "dense",
                       "--max-new-tokens", "12", "--json", "--device", "cpu"], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ours = [json.loads(line) for line in proc.stdout.splitlines()]  # (stdout holds the results alone)
    assert len(ours) == 4 and all(len(o["ids"]) == 12 or o["stopped"] == "end of document" for o in ours), ours
    # the end of a document, where both stop
    eos = build_tokenizer(str(root / "tokenizer")).eod
    theirs = json.loads(_worker("hf-generate", str(root / "llama" / "hf"), json.dumps([o["prompt_ids"] for o in ours]),
                                json.dumps([len(o["ids"]) for o in ours]), str(eos)))
    assert [o["ids"] for o in ours] == theirs
    # (a tiny random model repeats a token once it has one: the prompts make several)
    assert len({i for o in ours for i in o["ids"]}) > 2, [o["ids"] for o in ours]


if __name__ == "__main__":
    if sys.argv[1] == "convert":
        print(json.dumps(_convert(Path(sys.argv[2]))))
    elif sys.argv[1] == "hf-generate":
        print(json.dumps(_hf_greedy(Path(sys.argv[2]), json.loads(sys.argv[3]), json.loads(sys.argv[4]),
                                    int(sys.argv[5]))))
    else:
        print(_first_batch_loss(Path(sys.argv[2]), sys.argv[3], Path(sys.argv[4])))
