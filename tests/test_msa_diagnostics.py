"""MSA diagnostics and the retrieval data: the statistics against a brute-force computation on
random inputs; a tiny training run that logs them (values in range, the per-layer KL equal to the
logged one, a heatmap PNG, the index branch's gradient norm); the offline eval on its checkpoint;
synthetic retrieval documents alone and in the training mixture."""

from __future__ import annotations

import json
import math
import random
import re
import subprocess
import sys

import pytest
import torch

from data.retrieval import KV_MAX_PAIRS, KV_MIN_PAIRS, KV_SPACING, TASKS, Haystack, make_example, training_documents
from skeleton_helpers import REPO, _env, metrics, run_python, run_train

B, T, HQ, G, D, DI, BK, TOPK = 2, 45, 4, 2, 8, 8, 8, 2


def _brute(q, k, iq, ik, sel):
    """Per (b, t, g): dense group block mass [N], indexer block mass [N], oracle top-k set."""
    n_blocks = -(-T // BK)
    out = {}
    for b in range(B):
        for t in range(T):
            for g in range(G):
                heads = range(g * HQ // G, (g + 1) * HQ // G)
                p = torch.stack([torch.softmax(q[b, t, h] @ k[b, :t + 1, g].T / math.sqrt(D), -1) for h in heads]).mean(0)
                s = torch.softmax(iq[b, t, g] @ ik[b, :t + 1].T / math.sqrt(DI), -1)
                mass = torch.zeros(n_blocks, dtype=torch.float64).index_add_(0, torch.arange(t + 1) // BK, p.double())
                stud = torch.zeros(n_blocks, dtype=torch.float64).index_add_(0, torch.arange(t + 1) // BK, s.double())
                oracle = set(mass.topk(TOPK).indices.tolist())
                out[b, t, g] = (mass, stud, oracle, {int(x) for x in sel[b, t, g] if x >= 0})
    return out


def test_chunk_statistics_match_a_brute_force_count():
    from msa_model.ops.select_blocks.reference import select_blocks_reference
    from msa_model.training.diagnostics import SCALARS, block_mass, chunk_statistics

    torch.manual_seed(0)
    q, k = torch.randn(B, T, HQ, D), torch.randn(B, T, G, D)
    iq, ik = torch.randn(B, T, G, DI), torch.randn(B, T, DI)
    n_blocks = -(-T // BK)
    sel = select_blocks_reference(iq, ik, BK, TOPK)
    ref = _brute(q, k, iq, ik, sel)

    mass_BTHN, _ = block_mass(q, k, None, BK, 1 / math.sqrt(D), n_blocks)
    mass = mass_BTHN.view(B, T, G, HQ // G, n_blocks).mean(3)
    for key, (m, *_rest) in ref.items():
        torch.testing.assert_close(mass[key].double(), m, atol=1e-5, rtol=1e-5)

    st = chunk_statistics({"q": q, "k": k, "iq": iq, "ik": ik, "block_idx": sel, "q_offset": 0, "scale": None},
                          BK, TOPK, n_blocks, force_sink=False)
    got = dict(zip(SCALARS, (st["scalars"][:, 0] / st["scalars"][:, 1]).tolist()))
    contested = [key for key in ref if key[1] // BK + 1 > TOPK]
    recall = sum(len(ref[x][2] & ref[x][3]) / TOPK for x in contested) / len(contested)
    captured = sum(float(ref[x][0][list(ref[x][3])].sum()) for x in contested) / len(contested)
    oracle_mass = sum(float(ref[x][0][list(ref[x][2])].sum()) for x in contested) / len(contested)
    ent = sum(float(-(ref[x][1] * ref[x][1].clamp_min(1e-300).log()).sum() / math.log(x[1] // BK + 1))
              for x in contested) / len(contested)
    first = sum(0 in ref[x][3] for x in contested) / (TOPK * len(contested))
    previous = sum(x[1] // BK - 1 in ref[x][3] for x in contested) / len(contested)
    previous_oracle = sum(x[1] // BK - 1 in ref[x][2] for x in contested) / len(contested)
    assert 0 < previous < 1 and 0 < previous_oracle < 1  # random scores: neither always nor never
    assert got["previous_block"] == pytest.approx(previous, abs=1e-9)
    assert got["previous_block_oracle"] == pytest.approx(previous_oracle, abs=1e-9)
    # two local blocks: the previous block is always selected
    sel2 = select_blocks_reference(iq, ik, BK, TOPK, local_blocks=2)
    st2 = chunk_statistics({"q": q, "k": k, "iq": iq, "ik": ik, "block_idx": sel2, "q_offset": 0, "scale": None},
                           BK, TOPK, n_blocks, force_sink=False, local_blocks=2)
    assert (st2["scalars"][SCALARS.index("previous_block")] == st2["scalars"][SCALARS.index("previous_block"), 1]).all()
    assert got["recall"] == pytest.approx(recall, abs=1e-6)
    assert got["captured_mass"] == pytest.approx(captured, abs=1e-5)
    assert got["oracle_mass"] == pytest.approx(oracle_mass, abs=1e-5)
    assert got["oracle_mass"] >= got["captured_mass"]
    assert got["selection_entropy"] == pytest.approx(ent, abs=1e-5)
    assert got["slots_first"] == pytest.approx(first, abs=1e-9)
    assert got["slots_local"] == pytest.approx(1 / TOPK)  # every contested query fills all slots
    # heatmap rows are per query block: the indexer's row sums are the slots used, the oracle's k
    heat = st["heatmap"] / st["rows"][None, :, None]
    last = n_blocks - 1
    assert heat[1, last].sum().item() == pytest.approx(TOPK)
    assert heat[0, last].sum().item() == pytest.approx(TOPK)


def _haystack(tmp_path):
    rng = random.Random(0)
    root = tmp_path / "corpus"
    root.mkdir()
    for i in range(3):
        (root / f"m{i}.py").write_text("\n".join(f"x{j} = {rng.randrange(1000)}  # line {j}" for j in range(400)))
    return root, Haystack(sorted(root.glob("*.py")), pool_bytes=1 << 20, seed=0)


def test_retrieval_examples_are_exact_length_deterministic_and_answerable(tmp_path):
    _, hay = _haystack(tmp_path)
    for task in TASKS:
        for depth in (0.0, 0.5, 1.0):
            a = make_example(task, 700, depth, hay, random.Random(7))
            b = make_example(task, 700, depth, hay, random.Random(7))
            assert a == b and len(a.prompt) + len(a.answer) == 700
            assert a.answer.isdigit() and len(a.answer) == 5
            # the value that answers the question is written in the haystack
            assert a.answer in a.prompt
        assert make_example(task, 700, 0.5, hay, random.Random(8)).prompt != a.prompt
    ex = make_example("passkey", 1000, 0.25, hay, random.Random(1))
    assert abs(ex.prompt.index(b"PASSKEY =") / 1000 - 0.25) < 0.05
    with pytest.raises(ValueError, match="too short"):
        make_example("vartrack", 100, 0.5, hay, random.Random(1))
    with pytest.raises(ValueError, match="unknown retrieval task"):
        make_example("nope", 700, 0.5, hay, random.Random(1))
    docs = list(training_documents(hay, 20_000, 1024, seed=3))
    assert sum(map(len, docs)) >= 20_000 and all(128 <= len(d) <= 1024 for d in docs)
    # the default mixture is the three tasks of one question each
    assert all(d.count(b"assert ") == 1 and not re.search(rb"KEY_[a-z]+[0-9] ", d) for d in docs)


def _kv_count(length: int) -> int:
    return min(KV_MAX_PAIRS, max(KV_MIN_PAIRS, length // KV_SPACING))


def _kv_lines(doc: bytes):
    """kvrecall's needles {key: value} (in haystack order) and its questions [(key, answer)] (the
    last one's answer is the document's last 5 bytes)."""
    needles = re.findall(rb'\n(KEY_[a-z]+[0-9]) = "([0-9]{5})"\n', doc)
    questions = re.findall(rb'\nassert (KEY_[a-z]+[0-9]) == "([0-9]{5})', doc)
    return dict(needles), needles, questions


@pytest.mark.parametrize("length", [256, 700, 8192])
def test_kvrecall_documents_ask_for_every_needle_and_examples_for_one(tmp_path, length):
    """A training document asks for every needle (one per KV_SPACING bytes), each answer its
    needle's value; the evaluation's example of the same length asks for one, whose needle lies
    at the depth; both exactly the length and the same for the same seed."""
    _, hay = _haystack(tmp_path)
    for seed in range(4):
        depth = random.Random(seed).random()
        doc = make_example("kvrecall", length, depth, hay, random.Random(seed), ask_all=True)
        assert doc == make_example("kvrecall", length, depth, hay, random.Random(seed), ask_all=True)
        text = doc.prompt + doc.answer
        assert len(text) == length and text.endswith(b'"' + doc.answer)
        values, needles, questions = _kv_lines(text)
        assert len(needles) == len(values) == _kv_count(length)
        assert sorted(k for k, _ in questions) == sorted(values)
        assert all(values[k] == answer for k, answer in questions)
        assert questions[-1][1] == doc.answer
        # after the haystack: question lines only
        assert text.endswith(b"".join(b'\nassert ' + k + b' == "' + a + b'"' for k, a in questions)[:-1])

        ex = make_example("kvrecall", length, depth, hay, random.Random(seed))
        assert ex == make_example("kvrecall", length, depth, hay, random.Random(seed))
        text = ex.prompt + ex.answer
        assert len(text) == length and ex.answer.isdigit() and len(ex.answer) == 5
        values, needles, questions = _kv_lines(text)
        assert len(needles) == _kv_count(length) and len(questions) == 1
        key = questions[0][0]
        assert values[key] == ex.answer
        # its needle is cut into the haystack at the depth, after the needles before it
        needle_bytes = sum(len(k) + 12 for k, _ in needles)
        filler = length - needle_bytes - (len(key) + 13) - len(ex.answer)
        at = text.index(b"\n" + key + b' = "')
        assert round(depth * filler) <= at <= round(depth * filler) + needle_bytes - (len(key) + 12)
    assert make_example("kvrecall", length, 0.5, hay, random.Random(9)).prompt != ex.prompt


def test_training_documents_mix_the_tasks_asked_for(tmp_path):
    _, hay = _haystack(tmp_path)
    docs = list(training_documents(hay, 50_000, 2048, seed=3, tasks=("kvrecall",)))
    assert sum(map(len, docs)) >= 50_000 and all(256 <= len(d) <= 2048 for d in docs)
    for d in docs:
        values, needles, questions = _kv_lines(d)
        assert len(questions) == len(needles) >= 2 and all(values[k] == a for k, a in questions)
    mixed = list(training_documents(hay, 50_000, 2048, seed=3, tasks=("passkey", "kvrecall")))
    assert {b"PASSKEY" in d for d in mixed} == {True, False}
    assert all((b"PASSKEY" in d) != bool(_kv_lines(d)[1]) for d in mixed)


def test_short_training_documents_from_data_retrieval_min_length(tmp_path):
    """min_length draws lengths from it up to the maximum (the default starts at 256); a length
    below what a document's needles and question take is raised to that, and a context too short
    for them is refused."""
    _, hay = _haystack(tmp_path)
    docs = list(training_documents(hay, 60_000, 512, seed=3, tasks=("passkey", "kvrecall"), min_length=128))
    lengths = [len(d) for d in docs]
    assert min(lengths) >= 128 and max(lengths) <= 512 and sum(n < 200 for n in lengths) > len(lengths) // 8
    assert min(len(d) for d in training_documents(hay, 60_000, 512, seed=3, tasks=("passkey",))) >= 256
    for d in docs:
        values, _, questions = _kv_lines(d)
        assert all(values[k] == a for k, a in questions)
    # below what a document's needles and question take: raised to that
    short = list(training_documents(hay, 20_000, 512, seed=3, tasks=("passkey", "kvrecall"), min_length=40))
    least = {task: min(len(d) for d in short if (b"PASSKEY" in d) == (task == "passkey"))
             for task in ("passkey", "kvrecall")}
    assert 60 < least["passkey"] < 100 and 100 < least["kvrecall"] < 200, least
    with pytest.raises(ValueError, match="too short for its needles .* needs a longer model.seq_length"):
        list(training_documents(hay, 20_000, 80, seed=3, tasks=("kvrecall",)))
    # the setting is part of the tokenized cache's key; unset, the key is the one caches had before it
    from data.datasets import _mixture_key
    from msa_model.config import DataConfig

    keys = {n: _mixture_key(DataConfig(retrieval_share=0.5, retrieval_min_length=n), 0.5, 512) for n in (0, 128)}
    assert keys[0] == "retrieval=0.5,512,1234,windows,pad".replace("1234", str(DataConfig().seed))
    assert keys[128] == keys[0] + ",min_length=128"


def test_training_documents_are_sized_in_the_models_tokens(tmp_path):
    """With a BPE tokenizer the training documents' lengths and their total are the model's tokens:
    each the longest of at most its drawn length (uniform in [max / 8, max] tokens), answerable,
    more bytes than tokens."""
    from data.tokenizer import HFTokenizer
    from tokenizer_fixtures import make_bpe_tokenizer

    _, hay = _haystack(tmp_path)
    bpe = HFTokenizer(make_bpe_tokenizer(tmp_path / "tok", vocab_size=600, files=20))
    count = lambda doc: len(bpe.tokenize(doc))  # noqa: E731
    docs = list(training_documents(hay, 30_000, 1024, seed=3, tasks=TASKS, count=count))
    tokens = [count(d) for d in docs]
    assert 30_000 <= sum(tokens) < 30_000 + 1024
    assert all(0.98 * 256 <= n <= 1024 for n in tokens) and max(tokens) > 900, tokens
    assert sum(map(len, docs)) > 1.2 * sum(tokens)
    assert any(b"PASSKEY" in d for d in docs) and any(_kv_lines(d)[1] for d in docs)
    for d in docs:
        values, _, questions = _kv_lines(d)
        assert all(values[k] == a for k, a in questions)
    # the same seed draws the same documents
    assert list(training_documents(hay, 30_000, 1024, seed=3, tasks=TASKS, count=count)) == docs


def test_retrieval_examples_are_measured_in_the_models_tokens(tmp_path):
    """With a BPE tokenizer an evaluation length is tokens, as the model reads them (prompt and
    answer tokenized apart, as score_example does): at most the length, within 2% of it, the same
    example for the same (seed, task, length, depth, index); with bytes, exactly the length."""
    from data.tokenizer import ByteTokenizer, HFTokenizer
    from msa_model.eval.runner import _example_rng, example_of_tokens
    from tokenizer_fixtures import make_bpe_tokenizer

    _, hay = _haystack(tmp_path)
    bpe = HFTokenizer(make_bpe_tokenizer(tmp_path / "tok", vocab_size=600, files=20))
    for task in TASKS:
        for length in (512, 2048):
            rng = lambda: _example_rng(0, task, length, 0.5, 3)  # noqa: E731
            ex = example_of_tokens(task, length, 0.5, hay, bpe, rng)
            n = sum(len(ids) for ids in bpe.tokenize_batch([ex.prompt, ex.answer]))
            assert 0.98 * length <= n <= length, (task, length, n)
            assert len(ex.prompt) + len(ex.answer) > length  # more bytes than tokens
            assert example_of_tokens(task, length, 0.5, hay, bpe, rng) == ex
            assert ex.answer in ex.prompt
        byte = example_of_tokens(task, 700, 0.5, hay, ByteTokenizer(), lambda: random.Random(7))
        assert byte == make_example(task, 700, 0.5, hay, random.Random(7))


def test_the_needle_token_is_the_asked_values_first_digit(tmp_path):
    """Every task's asked value is found in its needle line, not in the question: with bytes its
    first digit; with BPE the token holding it (the tokenizer's offsets: a token may begin with the
    space before it)."""
    from data.tokenizer import ByteTokenizer, HFTokenizer
    from msa_model.eval.runner import _example_rng, example_of_tokens, needle_token
    from tokenizer_fixtures import make_bpe_tokenizer

    _, hay = _haystack(tmp_path)
    bpe = HFTokenizer(make_bpe_tokenizer(tmp_path / "tok", vocab_size=600, files=20))
    for task in TASKS:
        for depth in (0.0, 0.5, 1.0):
            ex = make_example(task, 1500, depth, hay, _example_rng(0, task, 1500, depth, 1))
            at = needle_token(ex, ByteTokenizer())
            assert ex.prompt[at:at + 5] == ex.answer, (task, depth)
            line = ex.prompt[ex.prompt.rfind(b"\n", 0, at) + 1:ex.prompt.find(b"\n", at)]
            assert not line.startswith(b"assert"), line
            ex = example_of_tokens(task, 1024, depth, hay, bpe, lambda: _example_rng(0, task, 1024, depth, 1))
            t = needle_token(ex, bpe)
            ids = bpe.tokenize_batch([ex.prompt])[0]
            before, token = bpe.detokenize(list(ids[:t])), bpe.detokenize([ids[t]])
            # the prompt's text up to this token ends before the value, and the token starts it
            assert ex.answer[:1].decode() in token and before.rstrip().endswith(("=", '= "', '"')), (task, before[-8:],
                                                                                                     token)
    ex = make_example("passkey", 800, 0.5, hay, random.Random(3))
    assert needle_token(ex.__class__(ex.task, ex.length, ex.depth, b"no needle here", ex.answer), ByteTokenizer()) \
        is None


def _needle_chance_cases():
    from msa_model.eval.runner import needle_chance

    return [needle_chance(160, 165, 16, 4),  # the needle in the query's own block
            needle_chance(60, 5, 16, 4),  # 4 visible blocks: all selected
            needle_chance(160, 40, 16, 4),
            needle_chance(160, 150, 16, 4, local_blocks=2),  # the block before the query's, local too
            needle_chance(160, 40, 16, 4, local_blocks=2),
            needle_chance(160, 40, 16, 4, force_sink=True),  # block 0 forced too: 2 free of 9
            needle_chance(160, 5, 16, 4, force_sink=True)]  # the needle in the forced block 0


def test_the_needle_selection_counts_the_layers_and_groups_holding_its_block():
    """Two layers of two groups, the query in the second of two query chunks: three of the four
    (layer, group) pairs name the needle's block (16-token blocks: token 40 is in block 2)."""
    from msa_model.eval.runner import QuerySelection, _needle_selection

    def capture(rows_g, query=13):
        c = QuerySelection(query)
        c.add(block_idx=torch.full((1, 8, 2, 3), -1, dtype=torch.int32), q_offset=0, q=torch.zeros(1))
        idx = torch.full((1, 8, 2, 3), -1, dtype=torch.int32)
        idx[0, 5] = torch.tensor(rows_g, dtype=torch.int32)  # query 8 + 5 = 13
        c.add(block_idx=idx, q_offset=8)
        c.seal()
        return c

    layers = [capture([[0, 2, -1], [1, 0, -1]]), capture([[2, 1, 0], [0, 1, 2]])]
    assert _needle_selection(layers, 40, 16) == 0.75
    # query 12: its slots are all empty
    assert _needle_selection([capture([[2, 1, 0], [0, 1, 2]], query=12)], 40, 16) == 0.0
    # random blocks: 3 free slots over the 10 blocks before query 160's (block 10), 2 over 9 with
    # two local blocks
    assert _needle_chance_cases() == [1.0, 1.0, 3 / 10, 1.0, 2 / 9, 2 / 9, 1.0]
    warmup = QuerySelection(3)
    warmup.add(block_idx=None, q_offset=0)
    assert _needle_selection([warmup], 40, 16) is None


def test_every_field_of_an_evaluation_example_draws_another_one(tmp_path):
    """The samples of one (task, length, depth) are different examples, and so are those of
    another seed, length or depth: every character of the example's name counts."""
    from msa_model.eval.runner import _example_rng

    _, hay = _haystack(tmp_path)
    for task in TASKS:
        names = [(0, task, 700, 0.5, i) for i in range(6)] + [(1, task, 700, 0.5, 0), (0, task, 701, 0.5, 0),
                                                              (0, task, 700, 0.25, 0)]
        answers = {make_example(task, n[2], n[3], hay, _example_rng(*n)).answer for n in names}
        assert len(answers) == len(names), task
        assert _example_rng(0, task, 700, 0.5, 3).random() == _example_rng(0, task, 700, 0.5, 3).random()


def _last_line(script: str, *args) -> str:
    """The last line `script` prints, run as `python -c script ARGS...` in a fresh process (forked
    from one that has imported the trainer)."""
    proc = run_python(["-c", script, *map(str, args)], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


# the documents of a dataset of retrieval windows (each entry documents ending in the
# end-of-document token, then the pad id up to the window's length)
SPLIT_ENTRIES = (
    "import numpy as np\n"
    "def split_entries(prefix, eod):\n"
    "    docs = []\n"
    "    ds = IndexedDataset(prefix)\n"
    "    for entry in (ds[i] for i in range(len(ds))):\n"
    "        start = 0\n"
    "        for end in np.flatnonzero(entry == eod):\n"
    "            if end > start:\n"
    "                docs.append(np.array(entry[start:end]))  # a copy: the entry is a view of the file\n"
    "            start = end + 1\n"
    "    return docs\n"
)


def test_retrieval_share_puts_synthetic_documents_in_the_token_file(tmp_path):
    """The share of synthetic documents, of the tasks data.retrieval_tasks names, in a dataset of
    their own whose every entry is one window of whole documents."""
    root, _ = _haystack(tmp_path)
    script = (
        "import sys, numpy as np\n"
        "from pathlib import Path\n"
        "from omegaconf import OmegaConf\n"
        "from msa_model.config import DataConfig\n"
        "from data.corpus import list_corpus_files\n"
        "from data.datasets import _cache_key, prepare_tokens, retrieval_prefix\n"
        "from megatron.core.datasets.indexed_dataset import IndexedDataset\n"
        + SPLIT_ENTRIES +
        "out = []\n"
        "for share, tasks in ((0.0, None), (0.3, None), (0.3, ['kvrecall'])):\n"
        "    cfg = OmegaConf.structured(DataConfig(source=sys.argv[1], glob='*.py', cache_dir=sys.argv[2],"
        " retrieval_share=share))\n"
        "    if tasks: cfg.retrieval_tasks = tasks\n"
        "    prefix = prepare_tokens(cfg, seq_length=512)\n"
        "    ds = IndexedDataset(prefix)\n"
        "    docs = [bytes(np.asarray(ds[i][:-1], dtype=np.uint8)) for i in range(len(ds))]\n"
        "    windows = set()\n"
        "    if retrieval_prefix(prefix):\n"
        "        docs += [bytes(np.asarray(d, dtype=np.uint8)) for d in split_entries(retrieval_prefix(prefix), ds[0][-1])]\n"
        "        rds = IndexedDataset(retrieval_prefix(prefix))\n"
        "        windows = set(np.array(rds.sequence_lengths).tolist())\n"
        "    questions = [d.count(b'assert ') for d in docs]\n"
        "    out.append((len(docs), sum(map(len, docs)), questions, Path(prefix).parent.name, windows))\n"
        "root, files = list_corpus_files(sys.argv[1], '*.py', cfg.max_bytes)\n"
        "old_key = _cache_key('byte-v1', root, files, f'retrieval=0.3,512,{cfg.seed}')\n"
        "out.append(Path(sys.argv[1]).name + '-' + old_key)\n"
        "print(out)\n"
    )
    (n0, tok0, q0, _, w0), (n1, tok1, q1, dir1, w1), (n2, tok2, q2, dir2, w2), old_dir1 = \
        eval(_last_line(script, root, tmp_path / "cache"))
    assert n0 == 3 and q0 == [0, 0, 0] and w0 == set()
    # the synthetic documents in a dataset of whole windows, each entry exactly the context
    assert w1 == w2 == {512}
    assert q1[:3] == [0, 0, 0] and q1[3:] == [1] * (n1 - 3) and n1 > 3
    # at least the share's tokens (the blend's weights make the share of the samples: the needle test below)
    assert tok1 - tok0 >= 0.3 / 0.7 * tok0
    # kvrecall documents of 256-512 bytes, each asking for all its needles
    assert q2[:3] == [0, 0, 0] and n2 > 3 and all(_kv_count(256) <= q <= _kv_count(512) for q in q2[3:])
    assert len(set(q2[3:])) > 1
    assert tok2 - tok0 >= 0.3 / 0.7 * tok0
    # a cache of the documents appended to the corpus's (before they had a dataset of windows) is not reused
    assert dir1 != old_dir1 and dir2 != dir1


def test_retrieval_share_counts_a_bpe_tokenizers_tokens(tmp_path):
    """With a BPE tokenizer the synthetic share and the documents' lengths are in its tokens (once
    they were bytes with every tokenizer: such a cache has another key)."""
    from tokenizer_fixtures import make_bpe_tokenizer

    root, _ = _haystack(tmp_path)
    tok = make_bpe_tokenizer(tmp_path / "tok", vocab_size=600, files=20)
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from omegaconf import OmegaConf\n"
        "from msa_model.config import DataConfig\n"
        "from data.corpus import list_corpus_files\n"
        "from data.datasets import _cache_key, prepare_tokens, retrieval_prefix\n"
        "from data.tokenizer import build_tokenizer\n"
        "from megatron.core.datasets.indexed_dataset import IndexedDataset\n"
        + SPLIT_ENTRIES +
        "cfg = OmegaConf.structured(DataConfig(source=sys.argv[1], glob='*.py', cache_dir=sys.argv[2],"
        " retrieval_share=0.3, tokenizer=sys.argv[3]))\n"
        "prefix = prepare_tokens(cfg, seq_length=512)\n"
        "ds = IndexedDataset(prefix)\n"
        "tokenizer = build_tokenizer(sys.argv[3])\n"
        "root, files = list_corpus_files(sys.argv[1], '*.py', cfg.max_bytes)\n"
        "byte_sized = _cache_key(tokenizer.identity['sha256'], root, files, f'retrieval=0.3,512,{cfg.seed}')\n"
        "synthetic = [len(d) + 1 for d in split_entries(retrieval_prefix(prefix), tokenizer.eod)]\n"
        "print([len(ds[i]) for i in range(len(ds))] + synthetic, Path(prefix).parent.name == Path(sys.argv[1]).name + '-' + byte_sized)\n"
    )
    lengths, old_key = _last_line(script, root, tmp_path / "cache", tok).rsplit(" ", 1)
    lengths = eval(lengths)
    corpus, synthetic = lengths[:3], lengths[3:]
    assert sum(synthetic) >= 0.3 / 0.7 * sum(corpus)
    # each document and its end-of-document token within a window, the longest near it
    assert all(0.98 * 256 <= n <= 512 for n in synthetic) and max(synthetic) > 480, synthetic
    assert old_key == "False"


def test_every_retrieval_question_has_its_needle_in_its_training_window(tmp_path):
    """The training samples of a kvrecall mixture: half of them retrieval documents, and every
    question's needle in the question's window. Appended to the corpus's documents, 55% of the
    questions had theirs at 512 tokens: a window boundary cut the rest from their needles."""
    root, _ = _haystack(tmp_path)
    script = (
        "import re, sys, numpy as np\n"
        "from omegaconf import OmegaConf\n"
        "from msa_model.config import DataConfig\n"
        "from data.datasets import build_datasets\n"
        "from data.tokenizer import BYTE, build_tokenizer\n"
        "cfg = OmegaConf.structured(DataConfig(source=sys.argv[1], glob='*.py', cache_dir=sys.argv[2],"
        " retrieval_share=0.5, retrieval_tasks=['kvrecall']))\n"
        "train, _ = build_datasets(cfg, build_tokenizer(BYTE, cfg.eod_token), 512, 120)\n"
        "held = found = asked = 0\n"
        "for i in range(120):\n"
        "    t = train[i]['tokens'].numpy()\n"
        "    text = bytes(np.where(t < 256, t, 10).astype(np.uint8))\n"
        "    questions = list(re.finditer(rb'assert (KEY_\\w+) == \"', text))\n"
        "    held += bool(questions)\n"
        "    asked += len(questions)\n"
        "    found += sum(m.group(1) + b' = \"' in text[:m.start()] for m in questions)\n"
        "print(held, asked, found)\n"
    )
    held, asked, found = map(int, _last_line(script, root, tmp_path / "cache").split())
    assert 40 <= held <= 80 and asked > 100
    assert found == asked


@pytest.fixture(scope="module")
def diag_run(tmp_path_factory, data_cache):
    # one micro-batch a step (so the diagnostics see the whole step), warmup for steps 1-2
    run_dir = tmp_path_factory.mktemp("diag") / "run"
    run_train(run_dir, "trainer.max_steps=4", "parallel.global_batch_size=2", "trainer.indexer_warmup_tokens=1024",
              "logging.msa_diagnostics_interval=2", "checkpoint.interval=0", data_cache=data_cache)
    return run_dir


def test_training_logs_diagnostics_in_range_and_a_heatmap(diag_run):
    m = metrics(diag_run)
    assert [m[s]["phase"] for s in (2, 4)] == ["warmup", "sparse"]
    assert "msa/recall" not in m[1] and "msa/recall" not in m[3]
    for step in (2, 4):
        r = m[step]
        for name in ("recall", "captured_mass", "oracle_mass", "selection_entropy", "attention_entropy",
                     "slots_first", "slots_recent", "previous_block", "previous_block_oracle",
                     "block_popularity_max"):
            for key in (f"msa/{name}", f"msa/{name}/layer_01", f"msa/{name}/layer_02"):
                assert 0.0 <= r[key] <= 1.0, (step, key, r[key])
        assert r["msa/oracle_mass"] >= r["msa/captured_mass"] - 1e-9
        assert r["msa/slots_local"] == pytest.approx(1 / 4)
        # the diagnostics' KL (reference ops, this step's only micro-batch) is the logged KL
        assert r["msa/kl"] == pytest.approx(r["kl_loss"], rel=1e-4)
        assert 0 < r["grad_norm_msa_index"] < r["grad_norm"]
    for step in (2, 4):
        png = diag_run / "diagnostics" / f"step_{step:08d}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        saved = json.loads(png.with_suffix(".json").read_text())
        assert len(saved["heatmap_indexer"]) == 2 and len(saved["heatmap_indexer"][0]) == 256 // 16
    assert "msa diagnostics step 4: recall@k" in (diag_run / "train.log").read_text()


def test_diagnostics_of_packed_documents_match_the_trained_kl(tmp_path, data_cache):
    """data.document_mask=true (synthetic retrieval documents of 128-1024 tokens make boundaries in
    most 256-token rows): the layers hand their document starts to the diagnostics, whose KL is
    the training's document-masked KL."""
    run_dir = tmp_path / "run"
    run_train(run_dir, "trainer.max_steps=2", "parallel.global_batch_size=2", "trainer.indexer_warmup_tokens=0",
              "logging.msa_diagnostics_interval=2", "checkpoint.interval=0", "data.document_mask=true",
              "data.retrieval_share=0.5", data_cache=data_cache)
    r = metrics(run_dir)[2]
    assert r["phase"] == "sparse"
    assert r["msa/kl"] == pytest.approx(r["kl_loss"], rel=1e-4)
    assert 0.0 <= r["msa/recall"] <= 1.0 and r["msa/oracle_mass"] >= r["msa/captured_mass"] - 1e-9


def test_eval_runs_on_the_checkpoint_and_writes_results(diag_run, tmp_path):
    out = tmp_path / "eval"
    cmd = ["-m", "msa_model.eval", str(diag_run), "--out", str(out), "--lengths", "256,384",
           "--depths", "0,1", "--samples", "1", "--loss-sequences", "2", "--tasks", ",".join(TASKS)]
    proc = run_python(cmd, timeout=300)  # forked from a process that has imported the trainer
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    assert res["attention"] == "msa" and res["phase"] == "sparse" and res["key_budget"] == 64
    assert set(res["tasks"]) == set(TASKS) and res["lengths"] == [256, 384]
    for per in res["tasks"].values():
        for n in ("256", "384"):
            assert set(per[n]["by_depth"]) == {"0", "1"}
            assert 0.0 <= per[n]["accuracy"] <= 1.0 and 0.0 <= per[n]["mean_rank"] < 257
            # both lengths exceed the key budget: every task's needle is looked for in the selection
            assert 0.0 <= per[n]["needle_selected"] <= 1.0 and 0.0 < per[n]["needle_chance"] <= 1.0
    buckets = res["loss_by_position"]["buckets"]
    assert [b["from"] for b in buckets] == [0, 64, 128, 256] and all(0 < b["loss"] < 10 for b in buckets)
    assert res["loss_by_position"]["source"] == "held-out"
    # past the key budget (4 blocks of 16) and inside the 256-token training context
    by_offset = res["loss_by_position"]["by_block_offset"]
    assert by_offset["block_size"] == 16 and by_offset["positions"] == [64, 256]
    assert [b["from"] for b in by_offset["buckets"]] == list(range(0, 16, 2))
    assert all(0 < b["loss"] < 10 for b in by_offset["buckets"])
    assert "Loss by offset in a 16-token key block" in (out / "results.md").read_text()
    assert "| passkey needle block selected |" in (out / "results.md").read_text()
    for name in ("results.md", "accuracy.png", "loss_by_position.png"):
        assert (out / name).stat().st_size > 0

    bad = run_python(["-m", "msa_model.eval", str(tmp_path), "--out", str(tmp_path / "x")], timeout=300)
    assert bad.returncode == 2 and "is not a checkpoint" in bad.stderr


def test_selection_coherence_reads_the_checkpoint_and_its_held_out_text(diag_run):
    """bench/selection_coherence.py on the run's checkpoint: the eval's loaders as they are called
    now (it called them with their old arguments), the held-out text in the run's tokens."""
    proc = subprocess.run([sys.executable, "bench/selection_coherence.py", "--checkpoint", str(diag_run), "--T", "256",
                           "--tiles", "4", "--device", "cpu"], cwd=REPO, env={**_env(), "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    line = re.search(r"4 queries: mean ([0-9.]+)", proc.stdout)
    assert "T=256 (held-out, 2 layers" in proc.stdout and line and 0 < float(line.group(1)) <= 4, proc.stdout


def test_loss_by_block_offset_finds_a_loss_at_the_blocks_start():
    """A loss raised at the first offsets of every 32-token block, past position 96 only: the first
    bucket holds it, the others and the positions before 96 do not count."""
    from msa_model.eval.runner import loss_by_block_offset

    per_pos = torch.rand(320, dtype=torch.float64) * 0.01 + 1.0
    pos = torch.arange(320)
    per_pos[(pos >= 96) & (pos % 32 < 4)] += 2.0
    per_pos[:96] += 5.0
    res = loss_by_block_offset(per_pos, 32, 96, 320)
    assert res["positions"] == [96, 320] and [b["from"] for b in res["buckets"]] == list(range(0, 32, 4))
    assert res["buckets"][0]["loss"] == pytest.approx(3.005, abs=0.006)
    assert all(b["loss"] == pytest.approx(1.005, abs=0.006) for b in res["buckets"][1:])
    assert res["start_excess"] == pytest.approx(2.0, abs=0.01)
    # the positions' spread (uniform on [0, 0.01]): standard error sqrt(var/28 + var/112), var = 1e-4 / 12
    assert res["start_excess_se"] == pytest.approx(math.sqrt(1e-4 / 12 * (1 / 28 + 1 / 112)), rel=0.35)
    # too few positions, or a block too small to split
    assert loss_by_block_offset(per_pos, 32, 96, 150) is None and loss_by_block_offset(per_pos, 4, 0, 320) is None


def _blend_run(tmp_path):
    """A run directory whose config trained on data.blend, with a placeholder checkpoint."""
    from skeleton_helpers import placeholder_run

    return placeholder_run(tmp_path, blend=[[1.0, str(tmp_path / "data" / "web")]])


def test_eval_of_a_run_on_prepared_datasets_asks_for_a_corpus(tmp_path):
    """A run on data.blend keeps data.source's default (the embedded corpus) that it never read:
    the evaluation asks for --corpus instead of calling that corpus held-out, and writes nothing."""
    run, cfg = _blend_run(tmp_path)
    assert cfg.data.source == "stdlib"
    proc = run_python(["-m", "msa_model.eval", str(run), "--out", str(tmp_path / "eval")], timeout=300)
    assert proc.returncode == 2 and "trained on prepared datasets (data.blend); give --corpus DIR" in proc.stderr, \
        proc.stdout[-2000:] + proc.stderr[-3000:]
    assert not (tmp_path / "eval").exists()


def test_eval_reads_every_file_of_a_corpus_given_to_a_blend_run(tmp_path):
    """A blend run's data.glob is the schema's `**/*.py`, not a description of --corpus: the text
    files of --corpus are read whatever their names; a missing or empty --corpus is refused in one
    line, exit code 2, before the output directory or the model exist."""
    from msa_model.eval.runner import check_corpus, corpus_glob

    run, cfg = _blend_run(tmp_path)
    corpus = tmp_path / "texts"
    corpus.mkdir()
    for name in ("a.txt", "b.md"):
        (corpus / name).write_text("some text\n")
    glob = corpus_glob(cfg, str(corpus), True, None)
    assert [p.name for p in check_corpus(str(corpus), glob, 1 << 30, "--corpus")] == ["a.txt", "b.md"]
    assert corpus_glob(cfg, str(corpus), True, "*.md") == "*.md"
    # the run's own file-directory corpus keeps the run's glob
    cfg.data.blend = None
    assert corpus_glob(cfg, None, True, None) == corpus_glob(cfg, str(corpus), True, None) == "**/*.py"

    def evaluate(*args):
        return run_python(["-m", "msa_model.eval", str(run), "--out", str(tmp_path / "eval"), *args], timeout=300)

    for args, message in ((["--corpus", str(tmp_path / "nope")], "no such directory"),
                          (["--corpus", str(corpus), "--glob", "*.rst"], "no files match '*.rst'")):
        proc = evaluate(*args)
        assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith("error: --corpus ") \
            and message in proc.stderr, proc.stdout[-2000:] + proc.stderr[-3000:]
        assert not (tmp_path / "eval").exists()


def test_eval_reads_a_runs_relative_paths_from_its_launch_directory(tmp_path, monkeypatch):
    """A run launched in WORK with data.source=corpus is evaluated from elsewhere: the corpus and
    tokenizer paths of its config.yaml are WORK's."""
    from omegaconf import OmegaConf

    from msa_model.config import TrainConfig
    from msa_model.eval.runner import load_config

    work, run = tmp_path / "work", tmp_path / "work" / "runs" / "fd"
    run.mkdir(parents=True)
    cfg = OmegaConf.structured(TrainConfig)
    cfg.data.source, cfg.data.tokenizer = "corpus", "tok"
    (run / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    (run / "launch.sh").write_text(f"#!/usr/bin/env bash\nset -euo pipefail\ncd {work}\npython train.py\n")
    monkeypatch.chdir(tmp_path)
    loaded = load_config(run / "config.yaml", run / "checkpoints" / "step_00000001")
    assert (loaded.data.source, loaded.data.tokenizer) == (str(work / "corpus"), str(work / "tok"))
    cfg.data.source, cfg.data.tokenizer = "stdlib", "byte"
    (run / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    loaded = load_config(run / "config.yaml", run / "checkpoints" / "step_00000001")
    assert (loaded.data.source, loaded.data.tokenizer) == ("stdlib", "byte")


@pytest.mark.parametrize("warmup", [False, True], ids=["sparse", "warmup"])
def test_a_packed_row_measures_what_its_documents_measure_alone(warmup):
    """With packed documents the statistics (sums and counts) of a row are those of its documents
    run one by one as rows of their own: blocks are numbered per document, as selection does."""
    from msa_model.ops.select_blocks.reference import select_blocks_reference
    from msa_model.training.diagnostics import chunk_statistics

    torch.manual_seed(1)
    cuts = [0, 19, 52, 70]  # three documents in one row of 70 tokens
    Tr = cuts[-1]
    q, k = torch.randn(1, Tr, HQ, D), torch.randn(1, Tr, G, D)
    iq, ik = torch.randn(1, Tr, G, DI), torch.randn(1, Tr, DI)
    doc = torch.zeros(1, Tr, dtype=torch.int32)
    for a, b in zip(cuts[:-1], cuts[1:]):
        doc[:, a:b] = a
    n_blocks = -(-Tr // BK)

    def stats(sl, ds):
        iq_, ik_ = iq[:, sl], ik[:, sl]
        sel = None if warmup else select_blocks_reference(iq_, ik_, BK, TOPK, doc_start_BT=ds)
        chunk = {"q": q[:, sl], "k": k[:, sl], "iq": iq_, "ik": ik_, "block_idx": sel, "q_offset": 0,
                 "scale": None, "doc_start": ds}
        return chunk_statistics(chunk, BK, TOPK, n_blocks, force_sink=False)

    packed = stats(slice(None), doc)
    alone = [stats(slice(a, b), None) for a, b in zip(cuts[:-1], cuts[1:])]
    for key in ("scalars", "popularity", "heatmap", "rows"):
        torch.testing.assert_close(packed[key], sum(x[key] for x in alone), atol=1e-6, rtol=1e-6,
                                   msg=lambda m, key=key: f"{key}: {m}")
    assert packed["scalars"][0, 1] > 0  # some queries see more than top-k blocks

    # and split into query chunks as context parallelism splits it (keys: the whole prefix, with
    # every key's document start): the chunks' sums are the row's
    def chunk(a, b):
        sel = None if warmup else select_blocks_reference(iq[:, a:b], ik[:, :b], BK, TOPK, q_offset=a,
                                                          doc_start_BT=doc[:, a:b])
        c = {"q": q[:, a:b], "k": k[:, :b], "iq": iq[:, a:b], "ik": ik[:, :b], "block_idx": sel, "q_offset": a,
             "scale": None, "doc_start": doc[:, a:b], "key_doc_start": doc}
        return chunk_statistics(c, BK, TOPK, n_blocks, force_sink=False)

    split = [chunk(0, 30), chunk(30, Tr)]
    for key in ("scalars", "popularity", "heatmap", "rows"):
        torch.testing.assert_close(packed[key], split[0][key] + split[1][key], atol=1e-6, rtol=1e-6,
                                   msg=lambda m, key=key: f"split {key}: {m}")
