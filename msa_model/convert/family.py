"""A Hugging Face model family, as the converter sees it: one object that knows its own layout.

A `Family` says which config.json it reads (`architecture`, `model_type`, `aliases`), how that
config translates to a ModelConfig and back (`keys`, `model_config`, `hf_config`), what it cannot
express (`check_exportable`) and its tensors: `rules` ties every megatron tensor to the HF tensors
it is made of (both directions, through msa_model.convert.hf_mapping's `fuse`/`split`),
`hf_shapes` gives the shape each must have, `open` and `export_layout` turn the layout on disk
into the names `rules` uses and back where the two differ. The commands (hf-to-msa, msa-to-hf,
verify) ask the family and never test its name.

Adding a family is adding one object to msa_model.convert.families.FAMILIES: a `LlamaFamily`
(msa_model.convert.llama_families) for a model of the Llama layout with its own config keys, biases,
norms or expert names, or a subclass of `Family` of its own for another layout (as MiniMax-M3's,
msa_model.convert.minimax_m3; hf_mapping.decoder_rules gives the `model.layers.N` skeleton, the
family its attention's and MLP's tensors).

Imports go one way: the helpers (hf_io, config_keys, hf_mapping) <- this base <- the families
(llama_families, minimax_m3) <- the registry (families) <- the commands (commands, verify).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from msa_model.config import ModelConfig
from msa_model.convert.config_keys import Key
from msa_model.convert.hf_mapping import Rule


@dataclass(frozen=True)
class Family(ABC):
    name: str
    architecture: str  # what msa-to-hf writes
    model_type: str
    # its config.json keys that are one ModelConfig field each, in both directions
    keys: tuple[Key, ...]
    # more architectures / model types read as this family (e.g. a vision-language wrapper)
    aliases: tuple[str, ...] = ()
    # transformers runs this family's sparse attention itself: verify compares the top-k phase
    runs_msa: bool = False

    @abstractmethod
    def model_config(self, hf_config: dict, *, attention: str, seq_length: int, name: str | None,
                     where: str) -> ModelConfig:
        """The ModelConfig of a parsed config.json of this family; ConversionError (naming the
        key) for what our model cannot express."""

    @abstractmethod
    def hf_config(self, model: ModelConfig, source: dict | None = None) -> dict:
        """config.json of `model` exported as this family; keys of `source` (the original
        config.json) that do not describe the architecture (token ids, ...) are kept."""

    @abstractmethod
    def check_exportable(self, model: ModelConfig) -> None:
        """Raise ConversionError naming every option of `model` this family cannot express."""

    @abstractmethod
    def rules(self, model: ModelConfig, with_index: bool) -> list[Rule]:
        """Every megatron tensor of `model` and the HF tensors it is made of, in a fixed order;
        `with_index`: the index branch's too."""

    @abstractmethod
    def hf_shapes(self, model: ModelConfig, with_index: bool) -> dict[str, tuple[int, ...]]:
        """The shape every HF tensor of `rules` must have for `model` (unpadded vocab)."""

    def has_msa_geometry(self, hf_config: dict) -> bool:
        """Whether a source config.json names the MSA block size and top-k (kept by hf-to-msa)."""
        return False

    def open(self, ckpt) -> tuple[object, dict[str, int]]:
        """(the checkpoint seen under the names `rules` uses, {part: tensors skipped}); `ckpt` is an
        HFCheckpoint or TensorDict (msa_model.convert.hf_io) and the view has their interface."""
        return ckpt, {}

    def export_layout(self, tensors: dict[str, torch.Tensor], model: ModelConfig) -> dict[str, torch.Tensor]:
        """The tensors named by `rules` -> the layout msa-to-hf writes."""
        return tensors
