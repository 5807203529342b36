"""Initial index-branch weights for a dense GQA model turned into MSA.

The index branch (docs/msa.md) scores keys for selection and is trained only by the KL to the
main branch's attention. Two starting points:

- `random`: W_iq, W_ik ~ N(0, 1/H), so a unit-RMS hidden state gives unit-variance index q/k;
  index norms scale by one (weights 1, or 0 for zero-centred `1 + w` norms).
- `derived`: from the dense attention it must imitate. The index query of group g is the mean
  of that group's G query-head projections; the index key is the mean of all Hkv key-head
  projections; the index norms copy the q/k norms. Needs Di = D. With one query head per
  group and one kv head this starts with exactly the main branch's scores.

`derived` is the default: converted from a trained dense model it starts the indexer warmup at
about a third of the random init's KL and keeps a lower KL through it (numbers in the README,
"Converting dense checkpoints"; scripts/convert_index_init_compare.py reproduces them).

Legend: H = hidden, Hkv = GQA groups, G = query heads per group, D = head dim, Di = index head dim.
"""

from __future__ import annotations

import torch

from msa_model.convert.hf_io import ConversionError

INIT_CHOICES = ("derived", "random")
DEFAULT = "derived"


def index_weight_names(model) -> tuple[str, ...]:
    """MSASelfAttention attributes of the index branch, as keyed by `index_weights`."""
    norms = ("index_q_layernorm.weight", "index_k_layernorm.weight") if model.qk_layernorm else ()
    return ("index_q_proj.weight", "index_k_proj.weight", *norms)


def index_weights(model, method: str, q_proj: torch.Tensor, k_proj: torch.Tensor,
                  q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                  generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """Index-branch tensors of one layer, keyed by MSASelfAttention attribute (e.g. "index_q_proj.weight").

    q_proj [Hq*D, H] and k_proj [Hkv*D, H] are the layer's (HF-layout) query and key projections;
    q_norm/k_norm [D] its QK-norm weights (None without QK norm). Results are fp32 [Hkv*Di, H],
    [Di, H] and, with QK norm, [Di], [Di]; the caller casts them to the model's dtype.
    """
    g, d, di, h = model.num_query_groups, model.head_dim, model.msa.index_head_dim, model.hidden_size
    hq = model.num_attention_heads
    out: dict[str, torch.Tensor] = {}
    if method == "random":
        std = h ** -0.5
        out["index_q_proj.weight"] = torch.randn(g * di, h, generator=generator) * std
        out["index_k_proj.weight"] = torch.randn(di, h, generator=generator) * std
        if model.qk_layernorm:
            # unit norm scales: w = 1, or w = 0 for (1 + w) norms
            unit = torch.zeros(di) if getattr(model, "norm_zero_centered", False) else torch.ones(di)
            out["index_q_layernorm.weight"] = unit.clone()
            out["index_k_layernorm.weight"] = unit.clone()
    elif method == "derived":
        check_method(model, method)
        q_GGDH = q_proj.float().reshape(g, hq // g, d, h)
        k_GDH = k_proj.float().reshape(g, d, h)
        out["index_q_proj.weight"] = q_GGDH.mean(dim=1).reshape(g * d, h)
        out["index_k_proj.weight"] = k_GDH.mean(dim=0)
        if model.qk_layernorm:
            out["index_q_layernorm.weight"] = q_norm.float().clone()
            out["index_k_layernorm.weight"] = k_norm.float().clone()
    else:
        check_method(model, method)
    return out


def check_method(model, method: str) -> None:
    """Raise ConversionError when `method` cannot initialise `model`'s index branch."""
    if method not in INIT_CHOICES:
        raise ConversionError(f"unknown index init {method!r}; choose from {INIT_CHOICES}")
    d, di = model.head_dim, model.msa.index_head_dim
    if method == "derived" and di != d:
        raise ConversionError(f"--index-init derived needs index_head_dim == head_dim ({di} != {d}); "
                              f"use --index-init random or --index-head-dim {d}")
