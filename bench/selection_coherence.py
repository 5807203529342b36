"""How coherent a trained indexer's selections are: the distinct blocks a tile of consecutive
queries selects, per layer, against the K blocks each query reads (1.0 = every query of the tile
selected the same blocks). The tile-union path of sparse_attention costs that ratio times the
exact FLOPs (msa_model/ops/sparse_attention/tiles.py).

    PYTHONPATH=. python bench/selection_coherence.py --checkpoint runs/small-pt --T 32768,131072 --save $OUT/sets

Runs the checkpoint's model (sparse phase) on one window of held-out text of the longest length
and keeps what select_blocks returns in every layer; shorter lengths are its prefixes. --save
writes them (`sets_<T>.npz`, int16 [T, G, K] per layer), which `bench_sparse_attention.py
--parts tiles --sets DIR` replays (cut to each length).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
from pathlib import Path

import numpy as np
import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True, help="run directory, checkpoint root or step directory")
    ap.add_argument("--T", default="32768")
    ap.add_argument("--tiles", default="4,8,16,64,128")
    ap.add_argument("--save", default="")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--save-layers", default="", help="which layers' selections --save keeps (default: all)")
    a = ap.parse_args()

    from msa_model.model.attention import set_msa_phase
    from msa_model.eval.runner import _heldout_docs, build_model, heldout_stream, load_config, resolve_checkpoint
    from msa_model.ops.sparse_attention.tiles import tile_union
    from msa_model.ops.sparse_attention.inverse_index import clean_block_idx
    from msa_model.training.data_setup import checkpoint_run_tokenizer

    step_dir, config_path = resolve_checkpoint(a.checkpoint)
    cfg = load_config(config_path, step_dir)
    model, device = build_model(cfg, step_dir, a.device)
    set_msa_phase(model, True)
    tokenizer = checkpoint_run_tokenizer(cfg, step_dir)
    bs, K = cfg.model.msa.block_size, cfg.model.msa.topk

    ops = importlib.import_module("msa_model.ops.msa_attention")
    select = ops.select_blocks
    captured = []

    def capture(*args, **kw):
        out = select(*args, **kw)
        captured.append(out.detach())
        return out

    ops.select_blocks = capture
    # one window at the longest length: the model is causal, so its first T positions select what a
    # window of T would
    longest = max(int(x) for x in a.T.split(",") if x)
    docs, kind = _heldout_docs(cfg, None, cfg.data.glob, longest + 1)
    flat = heldout_stream(docs, tokenizer, longest)[:longest]
    with torch.no_grad():
        model(torch.from_numpy(flat)[None].to(device), torch.arange(longest, device=device)[None], None)
    sets = torch.stack([clean_block_idx(x, bs) for x in captured])  # [layers, 1, T, G, K]
    report = {"checkpoint": str(step_dir), "text": kind, "layers": len(captured), "block_size": bs, "topk": K,
              "lengths": {}}
    for T in (int(x) for x in a.T.split(",") if x):
        cut = sets[:, :, :T]
        per_layer = {}
        for QT in (int(x) for x in a.tiles.split(",") if x):
            # the mean over tiles of |union| / K, per layer (the tile path's FLOPs over the exact ones)
            per_layer[QT] = [round(float(tile_union(s, QT).count.float().mean()) / K, 3) for s in cut]
        valid = (cut >= 0).sum(-1).float().mean().item()
        report["lengths"][T] = {"blocks_per_query": round(valid, 2), "union_over_k": per_layer}
        print(f"T={T} ({kind}, {len(captured)} layers, {valid:.2f} blocks per query): union / K per tile size",
              flush=True)
        for QT, vals in per_layer.items():
            print(f"  {QT:4d} queries: mean {sum(vals) / len(vals):.2f}  per layer {vals}", flush=True)
    if a.save:
        os.makedirs(a.save, exist_ok=True)
        keep = [int(x) for x in a.save_layers.split(",") if x] or list(range(len(sets)))
        # compressed (neighbouring queries repeat their blocks): a few MB per layer at 128K
        np.savez_compressed(Path(a.save) / f"sets_{longest}.npz",
                            **{f"layer{i}": sets[i, 0].to(torch.int16).cpu().numpy() for i in keep})
        report["saved_layers"] = keep
        (Path(a.save) / "coherence.json").write_text(json.dumps(report, indent=1))

if __name__ == "__main__":
    main()
