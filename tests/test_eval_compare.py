"""`python -m msa_model.eval.compare`: finished evaluations side by side, each number with its
difference to the first; lengths or buckets one evaluation lacks are '-'; a directory without
results.json is one clear error."""

from __future__ import annotations

import json

from msa_model.eval.compare import main


def _results(label: str, acc: dict[int, float], losses: list[float], excess=None, source="held-out") -> dict:
    lengths = sorted(acc)
    buckets = [{"from": 2 ** i if i else 0, "to": 2 ** (i + 1), "loss": x} for i, x in enumerate(losses)]
    loss = {"source": source, "sequences": 2, "length": 1024, "buckets": buckets, "documents_masked": True}
    if excess is not None:
        loss["by_block_offset"] = {"block_size": 128, "positions": [512, 1024], "start_excess": excess,
                                   "start_excess_se": 0.01, "buckets": [{"from": 0, "to": 16, "loss": 2.0 + excess},
                                                                        {"from": 64, "to": 128, "loss": 2.0}]}
    return {"label": label, "checkpoint": f"runs/{label}/checkpoints/step_00000100", "model": "small",
            "attention": "msa" if excess is not None else "dense", "phase": "sparse" if excess is not None else "dense",
            "key_budget": 512 if excess is not None else None, "context": 1024, "seed": 0, "samples": 4,
            "depths": [0.5], "lengths": lengths,
            "tasks": {"passkey": {str(n): {"accuracy": a, "mean_rank": 0.0} for n, a in acc.items()}},
            "accuracy_by_length": {str(n): a for n, a in acc.items()}, "loss_by_position": loss}


def _write(root, name, results):
    d = root / name
    d.mkdir()
    (d / "results.json").write_text(json.dumps(results))
    return d


def test_two_evaluations_side_by_side_with_differences(tmp_path, capsys):
    dense = _write(tmp_path, "dense", _results("dense", {512: 1.0, 1024: 0.75}, [3.0, 2.5]))
    msa = _write(tmp_path, "msa", _results("msa", {1024: 0.5, 2048: 0.25}, [3.25, 2.5], excess=0.125))
    assert main([str(dense), str(msa), "--out", str(tmp_path / "cmp")]) == 0
    text = capsys.readouterr().out
    assert "| passkey 1024 | 0.75 | 0.50 (-0.25) |" in text
    assert "| passkey 512 | 1.00 | - |" in text and "| passkey 2048 | - | 0.25 |" in text
    assert "| 0-2 | 3.000 | 3.250 (+0.250) |" in text and "| 2-4 | 2.500 | 2.500 (+0.000) |" in text
    assert "| first offsets minus second half | - | 0.125 |" in text
    assert "not the same held-out text" not in text
    assert (tmp_path / "cmp" / "compare.md").read_text() == text
    assert (tmp_path / "cmp" / "loss_by_position.png").stat().st_size > 0


def test_other_held_out_text_is_said_and_one_label_twice_is_told_apart(tmp_path, capsys):
    a = _write(tmp_path, "a", _results("run", {512: 1.0}, [3.0]))
    b = _write(tmp_path, "b", _results("run", {512: 1.0}, [3.0], source="training corpus"))
    assert main([str(a), str(b)]) == 0
    text = capsys.readouterr().out
    assert "**not the same held-out text**" in text
    assert f"| run ({a}) | run ({b}) |" in text


def test_a_directory_without_results_is_one_error(tmp_path, capsys):
    done = _write(tmp_path, "done", _results("a", {512: 1.0}, [3.0]))
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    (stopped / "partial.json").write_text("{}")
    assert main([str(done), str(stopped)]) == 2
    assert capsys.readouterr().err.strip() == (f"error: {stopped}: no results.json, not a finished evaluation "
                                               "(an interrupted evaluation: partial.json only)")
