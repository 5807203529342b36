"""Offline long-context evaluation of a checkpoint: `python -m msa_model.eval CHECKPOINT --out DIR`.

Retrieval tasks (data/retrieval.py: passkey, multi-key needle with distractors, variable
tracking by default; kvrecall, many key/value needles, with --tasks), generated from a seed with
haystacks cut from the training corpus, at several lengths and needle depths, scored by exact
match of the greedy answer and by the teacher-forced rank of the answer tokens; and the held-out
loss by token position and by offset inside a key block. `runner` loads and scores, `report` writes results.json, results.md and
the plots; `compare` sets finished evaluations side by side.
"""
