"""Does the indexer pick the blocks attention needs? Per-layer MSA diagnostics on one micro-batch.

Every `logging.msa_diagnostics_interval` steps each MSA layer keeps the inputs of its first forward
of the step (q, k, iq, ik and the selection, through `MSASelfAttention.diagnostics_capture`), and
after the step this callback measures, with the readable reference ops:

- the oracle: the main branch's dense attention mass per key block, averaged over the heads of
  each GQA group (`block_mass`: reference sparse attention with block-indicator values), and its
  top-k blocks;
- the indexer's choice: the layer's selection (in warmup, what select_blocks would pick) and its
  own block distribution (softmax of the index scores, summed per block).

Logged per layer as `msa/<metric>/layer_NN` and as the mean over layers `msa/<metric>`
(metrics.jsonl, TensorBoard, wandb), over the (query, group) pairs of queries that see more than
top-k blocks (for the others selection is trivially everything):

    recall             share of the oracle top-k blocks the indexer selected (recall@k)
    captured_mass      dense attention mass on the selected blocks; oracle_mass: on the oracle's
    kl                 the indexer KL of the layer's phase (dense support in warmup), all queries
    selection_entropy  entropy of the indexer's block distribution / log(visible blocks): 0 = sure,
                       1 = cannot tell blocks apart; attention_entropy: the same for the oracle
    slots_local / slots_first / slots_recent
                       share of filled slots on the query's own block, on block 0, and on the
                       top-k - 1 blocks right before the own block (a sliding window's choice)
    previous_block     share of (query, group) pairs whose selection holds the block right
                       before the query's own; previous_block_oracle: whose oracle top-k does.
                       With one local block (model.msa.local_blocks=1) a query at its block's
                       start reads no earlier text unless that block is selected
    block_popularity_max
                       selection rate of the most often selected key block, among the queries
                       for which it is a non-local visible block (1 = every query takes it)

Also `<run_dir>/diagnostics/step_NNNNNNNN.png` (per layer: how often each query block selects each
key block, indexer next to oracle; sent to wandb as an image) and `step_NNNNNNNN.json` (per-layer
values, block popularity and heatmaps). Values are sums and counts reduced over every rank, so
they are the same at any TP/CP/PP/DP layout up to which micro-batches are seen. With packed
documents (`data.document_mask=true`) blocks are numbered per document, as the selection numbers
them, so a packed row measures what its documents measure one by one (under CP the layers gather
every key's document start for this).

B = batch, T = queries of a chunk, Hq = query heads, G = groups, N = key blocks, K = top-k.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist

from msa_model.ops.common import default_scale
from msa_model.ops.indexer_kl.reference import indexer_kl_forward
from msa_model.ops.select_blocks.reference import select_blocks_reference
from msa_model.ops.sparse_attention.reference import sparse_attention_forward
from msa_model.training.callbacks import Callback

log = logging.getLogger(__name__)

SCALARS = ("recall", "captured_mass", "oracle_mass", "kl", "selection_entropy", "attention_entropy",
           "slots_local", "slots_first", "slots_recent", "previous_block", "previous_block_oracle")


class LayerCapture:
    """What one layer saw in its first forward after arming: a list of query chunks, each a dict
    of q [B,T,Hq,D], k [B,>=q_offset+T,G,D], iq [B,T,G,Di], ik [B,>=q_offset+T,Di], block_idx
    [B,T,G,K] int32 or None (warmup), q_offset, scale, doc_start int [B,T] or None and
    key_doc_start int [B,>=q_offset+T] (every key's, for packed documents). Later forwards (further micro-batches,
    recomputation) are ignored."""

    def __init__(self):
        self.chunks: list[dict] = []
        self.sealed = False

    def add(self, **items) -> None:
        if not self.sealed:
            self.chunks.append({k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in items.items()})

    def seal(self) -> None:
        self.sealed = bool(self.chunks)


@torch.no_grad()
def block_mass(q: torch.Tensor, k: torch.Tensor, block_idx, block_size: int, scale: float, n_blocks: int,
               q_offset: int = 0, doc_start=None, key_doc_start=None):
    """Attention mass per key block: fp32 [B, T, Hq, N] (rows sum to 1 over the support), and the
    lse [B, T, Hq]. q [B,T,Hq,D], k [B,q_offset+T,Hkv,D]. The reference sparse attention with
    values v[j] = one-hot(block of j) returns exactly sum_j p[j] v[j]; D block columns per pass.
    With packed documents (doc_start int [B, T] of the queries, key_doc_start int [B, >= Tk] of
    every key; the same tensor when q_offset is 0) the blocks are each document's own (key j is in
    block (j - start of its document) // block_size), as the selection's ids are."""
    B, T, Hq, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    pos_J = torch.arange(Tk, device=q.device)
    if doc_start is not None and key_doc_start is None:
        if q_offset:
            raise ValueError("block_mass with documents and q_offset > 0 needs every key's document start")
        key_doc_start = doc_start
    block_BJ = pos_J[None, :] if doc_start is None else pos_J[None, :] - key_doc_start[:, :Tk].long()
    block_BJ = block_BJ // block_size
    block_BJ = block_BJ.expand(B, Tk)
    parts, lse = [], None
    for n0 in range(0, n_blocks, D):
        v_BJD = (block_BJ[:, :, None] == n0 + torch.arange(D, device=q.device)[None, None, :]).to(q.dtype)
        v = v_BJD[:, :, None, :].expand(B, Tk, Hkv, D).contiguous()
        o, lse = sparse_attention_forward(q, k, v, block_idx, block_size, scale, True, q_offset, doc_start)
        parts.append(o[..., :min(D, n_blocks - n0)].float())
    return torch.cat(parts, dim=-1), lse


def _normalised_entropy(p_BTGN, vis_BTN):
    ent = -torch.special.xlogy(p_BTGN, p_BTGN).sum(-1)
    return ent / torch.log(vis_BTN.sum(-1).clamp_min(2).double())[:, :, None]


@torch.no_grad()
def chunk_statistics(c: dict, block_size: int, topk: int, n_blocks: int, force_sink: bool,
                     local_blocks: int = 1, kl_temperature: float = 1.0) -> dict:
    """Sums and counts (float64) of one captured chunk: {"scalars": [S, 2], "popularity": [2, N],
    "heatmap": [2, N, N] (indexer, oracle), "rows": [N]}. With packed documents (the chunk's
    "doc_start" int [B, T] and, for q_offset > 0, "key_doc_start" [B, >= q_offset + T]) blocks
    are numbered per document, as the selection numbers them, so a packed row gives the sums of
    its documents measured one by one. The student's distribution (its block mass, the KL) is
    the training KL's, at `kl_temperature` (model.msa.kl_temperature)."""
    off = c["q_offset"]
    ds, key_ds = c.get("doc_start"), c.get("key_doc_start")
    q = c["q"].float()
    B, T, Hq, D = q.shape
    end = off + T
    k, iq, ik = c["k"][:, :end].float(), c["iq"].float(), c["ik"][:, :end].float()
    G, Di = k.shape[2], iq.shape[-1]
    scale, index_scale = default_scale(D, c["scale"]), default_scale(Di, None) / kl_temperature
    dev = q.device

    mass_BTHN, lse_dense = block_mass(q, k, None, block_size, scale, n_blocks, off, ds, key_ds)
    mass = mass_BTHN.view(B, T, G, Hq // G, n_blocks).mean(3).double()
    student = block_mass(iq, ik[:, :, None, :], None, block_size, index_scale, n_blocks, off, ds,
                         key_ds)[0].double()
    sel = c["block_idx"]
    if sel is None:
        sel = select_blocks_reference(iq, ik, block_size, topk, force_sink=force_sink, q_offset=off,
                                      doc_start_BT=ds, local_blocks=local_blocks)
        lse = lse_dense
    else:
        lse = sparse_attention_forward(q, k, k, sel, block_size, scale, True, off, ds)[1]
    kl = indexer_kl_forward(q, k, iq, ik, c["block_idx"], lse, block_size, scale, index_scale, off, ds)

    # each query's own block (in its document's numbering) and the blocks it sees
    pos_BT = (off + torch.arange(T, device=dev))[None, :].expand(B, T)
    qblk_BT = (pos_BT if ds is None else pos_BT - ds.long()) // block_size
    blocks_N = torch.arange(n_blocks, device=dev)
    vis_BTN = blocks_N[None, None, :] <= qblk_BT[:, :, None]
    cont_BT = vis_BTN.sum(-1) > topk
    cont = cont_BT[:, :, None].expand(B, T, G).double()
    sel_l = sel.long()
    sel_BTGN = torch.zeros(B, T, G, n_blocks + 1, dtype=torch.bool, device=dev)
    sel_BTGN.scatter_(-1, torch.where(sel_l < 0, n_blocks, sel_l), True)
    sel_BTGN = sel_BTGN[..., :n_blocks]
    top_BTGK = mass.masked_fill(~vis_BTN[:, :, None, :], -1.0).topk(min(topk, n_blocks), dim=-1).indices
    oracle = torch.zeros(B, T, G, n_blocks, dtype=torch.bool, device=dev).scatter_(-1, top_BTGK, True)
    oracle = torch.where(cont_BT[:, :, None, None], oracle, vis_BTN[:, :, None, :])

    filled = (sel_l >= 0).double()
    qb = qblk_BT[:, :, None, None]
    # the block before the query's own (a counted query sees more than top-k blocks: it exists)
    prev_BTG1 = (qblk_BT - 1).clamp_min(0)[:, :, None, None].expand(B, T, G, 1)
    n_cont = cont.sum()
    slots = (filled.sum(-1) * cont).sum()

    def over_cont(x_BTG):
        return torch.stack([(x_BTG.double() * cont).sum(), n_cont])

    scalars = torch.stack([
        over_cont((sel_BTGN & oracle).sum(-1).double() / topk),
        over_cont((mass * sel_BTGN).sum(-1)),
        over_cont((mass * oracle).sum(-1)),
        torch.stack([kl.double() * B * T * G, torch.tensor(float(B * T * G), dtype=torch.float64, device=dev)]),
        over_cont(_normalised_entropy(student, vis_BTN)),
        over_cont(_normalised_entropy(mass, vis_BTN)),
        torch.stack([(((sel_l == qb) & (sel_l >= 0)).double().sum(-1) * cont).sum(), slots]),
        torch.stack([(((sel_l == 0) & (qb > 0)).double().sum(-1) * cont).sum(), slots]),
        torch.stack([(((sel_l < qb) & (sel_l >= qb - (topk - 1)) & (sel_l >= 0)).double().sum(-1) * cont).sum(), slots]),
        over_cont(sel_BTGN.gather(-1, prev_BTG1).squeeze(-1)),
        over_cont(oracle.gather(-1, prev_BTG1).squeeze(-1)),
    ])
    option_BTN = (vis_BTN & (blocks_N[None, None, :] != qblk_BT[:, :, None])).double() * cont_BT[:, :, None].double()
    popularity = torch.stack([(sel_BTGN.double() * option_BTN[:, :, None, :]).sum((0, 1, 2)),
                              option_BTN.sum((0, 1)) * G])
    qblk = qblk_BT.reshape(-1)
    heat = torch.zeros(2, n_blocks, n_blocks, dtype=torch.float64, device=dev)
    heat[0].index_add_(0, qblk, sel_BTGN.double().sum(2).reshape(B * T, n_blocks))
    heat[1].index_add_(0, qblk, oracle.double().sum(2).reshape(B * T, n_blocks))
    rows = torch.zeros(n_blocks, dtype=torch.float64, device=dev).index_add_(
        0, qblk, torch.full((B * T,), float(G), dtype=torch.float64, device=dev))
    return {"scalars": scalars, "popularity": popularity, "heatmap": heat, "rows": rows}


def _ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    return torch.where(den > 0, num / den.clamp_min(1e-300), torch.full_like(num, float("nan")))


class MSADiagnostics(Callback):
    """Arms the capture before every `interval`-th step and reports after it (module docstring)."""

    name = "msa_diagnostics"

    def __init__(self, interval: int, msa_cfg, num_layers: int, seq_length: int, run_dir, is_main: bool):
        self.interval, self.msa_cfg, self.num_layers = interval, msa_cfg, num_layers
        self.n_blocks = -(-seq_length // msa_cfg.block_size)
        self.out_dir, self.is_main = Path(run_dir) / "diagnostics", is_main
        self._captures: dict[int, LayerCapture] = {}

    def on_step_start(self, trainer) -> None:
        if self.interval <= 0 or (trainer.state.step + 1) % self.interval:
            return
        from msa_model.model.attention import msa_layers

        self._captures = {}
        for layer in msa_layers(trainer.model_chunks):
            layer.diagnostics_capture = self._captures[layer.layer_number] = LayerCapture()

    def on_step_end(self, trainer, metrics: dict) -> None:
        if not self._captures:
            return
        from msa_model.model.attention import msa_layers

        t0 = time.perf_counter()
        for layer in msa_layers(trainer.model_chunks):
            layer.diagnostics_capture = None
        captures, self._captures = self._captures, {}
        result = self.measure(captures, trainer.device)
        step = trainer.state.step
        for name, per_layer in result["layers"].items():
            finite = [v for v in per_layer if v == v]
            if finite:
                metrics[f"msa/{name}"] = sum(finite) / len(finite)
            for i, v in enumerate(per_layer):
                if v == v:
                    metrics[f"msa/{name}/layer_{i + 1:02d}"] = v
        if self.is_main:
            self._write(step, result)
            log.info("msa diagnostics step %d: recall@k %s | captured mass %s (oracle %s) | kl %s | selection "
                     "entropy %s | slots local/first/recent %s/%s/%s | previous block %s (oracle %s) | popular "
                     "block %s | %.1f s", step,
                     *(_fmt(metrics.get(f"msa/{n}")) for n in ("recall", "captured_mass", "oracle_mass", "kl",
                                                              "selection_entropy", "slots_local", "slots_first",
                                                              "slots_recent", "previous_block",
                                                              "previous_block_oracle", "block_popularity_max")),
                     time.perf_counter() - t0)

    @torch.no_grad()
    def measure(self, captures: dict[int, LayerCapture], device) -> dict:
        """Every rank calls this (one all-reduce). Returns per-layer lists (nan where a layer has no
        counted queries) under "layers", and "popularity" [L][N], "heatmap" [L][2][N][N]."""
        L, N, S = self.num_layers, self.n_blocks, len(SCALARS)
        c = self.msa_cfg
        scalars = torch.zeros(L, S, 2, dtype=torch.float64, device=device)
        pop = torch.zeros(L, 2, N, dtype=torch.float64, device=device)
        heat = torch.zeros(L, 2, N, N, dtype=torch.float64, device=device)
        rows = torch.zeros(L, N, dtype=torch.float64, device=device)
        for layer_number, cap in captures.items():
            for chunk in cap.chunks:
                st = chunk_statistics(chunk, c.block_size, c.topk, N, c.force_sink, c.local_blocks,
                                      c.kl_temperature)
                i = layer_number - 1
                scalars[i] += st["scalars"].to(device)
                pop[i] += st["popularity"].to(device)
                heat[i] += st["heatmap"].to(device)
                rows[i] += st["rows"].to(device)
        flat = torch.cat([scalars.flatten(), pop.flatten(), heat.flatten(), rows.flatten()])
        if dist.is_initialized():
            dist.all_reduce(flat)
        sizes = [scalars.numel(), pop.numel(), heat.numel(), rows.numel()]
        scalars, pop, heat, rows = (t.view_as(ref) for t, ref in zip(flat.split(sizes), (scalars, pop, heat, rows)))
        values = _ratio(scalars[..., 0], scalars[..., 1])
        popularity = _ratio(pop[:, 0], pop[:, 1])
        layers = {name: values[:, j].tolist() for j, name in enumerate(SCALARS)}
        layers["block_popularity_max"] = [float(p[p == p].max()) if (p == p).any() else float("nan")
                                          for p in popularity]
        freq = heat / rows[:, None, :, None].clamp_min(1)
        return {"layers": layers, "popularity": popularity.tolist(), "heatmap": freq.float().cpu()}

    def _write(self, step: int, result: dict) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        stem = self.out_dir / f"step_{step:08d}"
        payload = {"step": step, "layers": result["layers"], "block_popularity": result["popularity"],
                   "heatmap_indexer": result["heatmap"][:, 0].tolist(), "heatmap_oracle": result["heatmap"][:, 1].tolist()}
        stem.with_suffix(".json").write_text(json.dumps(payload, allow_nan=True) + "\n")
        png = stem.with_suffix(".png")
        plot_heatmaps(result["heatmap"], result["layers"]["recall"], png, step)
        try:
            import wandb

            if wandb.run is not None:
                wandb.run.log({"msa/selection_heatmap": wandb.Image(str(png))}, step=step)
        except ImportError:
            pass


def plot_heatmaps(freq_L2NN: torch.Tensor, recall: list[float], path: Path, step: int) -> None:
    """One row of panels per two layers: indexer and oracle selection frequency (query block x key
    block, 0..1) of each layer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    L = freq_L2NN.shape[0]
    cols = 4 if L > 1 else 2
    nrows = -(-2 * L // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(2.6 * cols, 2.5 * nrows), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    image = None
    for i in range(L):
        for j, who in enumerate(("indexer", "oracle")):
            ax = axes.flat[2 * i + j]
            ax.axis("on")
            image = ax.imshow(freq_L2NN[i, j].numpy(), vmin=0.0, vmax=1.0, cmap="viridis", origin="upper")
            r = recall[i]
            title = f"layer {i + 1} {who}" + (f" (recall {r:.2f})" if who == "indexer" and r == r else "")
            ax.set_title(title, fontsize=8)
            ax.set_xlabel("key block", fontsize=7)
            if (2 * i + j) % cols == 0:
                ax.set_ylabel("query block", fontsize=7)
            ax.tick_params(labelsize=6)
    fig.suptitle(f"selection frequency at step {step}", fontsize=10)
    if image is not None:
        fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.6)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.3f}"
