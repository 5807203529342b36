"""Reading and writing Hugging Face checkpoint directories (config.json + safetensors).

A directory holds either one `model.safetensors` or shards listed by
`model.safetensors.index.json` ({"weight_map": {tensor name: shard file}}). Tensors are read
lazily, one at a time, so a conversion never holds two copies of the model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"


class ConversionError(ValueError):
    """A checkpoint that cannot be converted; the message names the file or tensor at fault."""


def read_config(src: str | Path) -> dict:
    """The parsed config.json of a Hugging Face checkpoint directory."""
    path = Path(src) / CONFIG_FILE
    if Path(src).is_file():
        hint = f": give {Path(src).parent}" if Path(src).name == CONFIG_FILE else ""
        raise ConversionError(f"{src}: a file; expected a directory holding {CONFIG_FILE} (a Hugging Face "
                              f"checkpoint directory){hint}")
    if not Path(src).is_dir():
        raise ConversionError(f"{src}: no such directory (a Hugging Face checkpoint directory)")
    if not path.is_file():
        ours = (Path(src) / "latest").is_file() or (Path(src) / "metadata.json").is_file()
        hint = " (it is a checkpoint of this repository; `msa-to-hf` exports one)" if ours else ""
        raise ConversionError(f"{src}: no {CONFIG_FILE}; expected a Hugging Face checkpoint directory{hint}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConversionError(f"{path}: not valid JSON ({e})") from e


def open_safetensors(path: Path):
    """safe_open of one file; a truncated or otherwise damaged file is a ConversionError naming it
    (safetensors checks at open that the header parses and its offsets cover the file exactly)."""
    try:
        return safe_open(path, framework="pt")
    except (SafetensorError, OSError) as e:
        raise ConversionError(f"{path}: not a readable safetensors file, truncated or damaged ({e})") from e


class HFCheckpoint:
    """Lazy access to the tensors of a (possibly sharded) safetensors checkpoint directory.

    `names` lists every tensor; `get(name)` reads one. Every file's header is read at open time:
    a missing, truncated or damaged shard, and a tensor that the index assigns to a shard which
    does not hold it, are reported then (ConversionError naming the file), before any work.
    """

    def __init__(self, src: str | Path):
        self.root = Path(src)
        self._weight_map: dict[str, str] = {}
        self._handles: dict[str, object] = {}
        index = self.root / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ConversionError(f"{index}: not a safetensors index (needs a 'weight_map' object): {e}") from e
            missing = sorted({f for f in weight_map.values() if not (self.root / f).is_file()})
            if missing:
                example = next(n for n, f in weight_map.items() if f == missing[0])
                raise ConversionError(
                    f"{self.root}: missing shard file(s) {missing} listed in {INDEX_FILE} "
                    f"(e.g. {missing[0]} should hold {example!r})")
            self._weight_map = dict(weight_map)
            for file in sorted(set(weight_map.values())):
                held = set(self._handle(file).keys())
                lacking = sorted(n for n, f in weight_map.items() if f == file and n not in held)
                if lacking:
                    raise ConversionError(f"{self.root / file}: does not hold {lacking[:3]}"
                                          f"{' ...' if len(lacking) > 3 else ''}, which {INDEX_FILE} assigns to it")
        elif (self.root / SINGLE_FILE).is_file():
            self._weight_map = {name: SINGLE_FILE for name in self._handle(SINGLE_FILE).keys()}
        else:
            found = sorted(p.name for p in self.root.glob("*.safetensors"))
            hint = f"; found {found} but no {INDEX_FILE} naming them" if found else ""
            raise ConversionError(f"{self.root}: no {SINGLE_FILE} or {INDEX_FILE}{hint}")

    @property
    def names(self) -> list[str]:
        return sorted(self._weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self._weight_map

    def _handle(self, file: str):
        if file not in self._handles:
            self._handles[file] = open_safetensors(self.root / file)
        return self._handles[file]

    def _read(self, name: str, how: str):
        """safe_open's `how` ("get_slice" or "get_tensor") of tensor `name`; errors name the file."""
        if name not in self._weight_map:
            raise ConversionError(f"{self.root}: tensor {name!r} not found in the checkpoint")
        file = self._weight_map[name]
        try:
            return getattr(self._handle(file), how)(name)
        except SafetensorError as e:
            raise ConversionError(f"{self.root / file}: cannot read tensor {name!r}: {e}") from e

    def _slice(self, name: str):
        return self._read(name, "get_slice")

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The safetensors dtype string ("F32", "BF16", ...)."""
        return self._slice(name).get_dtype()

    def get(self, name: str) -> torch.Tensor:
        return self._read(name, "get_tensor")

    def get_row(self, name: str, i: int) -> torch.Tensor:
        """`get(name)[i]`, reading only that row (one expert of a stacked expert tensor)."""
        sl, file = self._slice(name), self._weight_map[name]
        try:
            return sl[i]
        except SafetensorError as e:
            raise ConversionError(f"{self.root / file}: cannot read row {i} of tensor {name!r}: {e}") from e


class TensorDict:
    """The HFCheckpoint interface over tensors already in memory (a DeepSpeed state dict)."""

    _DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}

    def __init__(self, tensors: dict[str, torch.Tensor], where: str):
        self.tensors, self.root = tensors, where

    @property
    def names(self) -> list[str]:
        return sorted(self.tensors)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.get(name).shape)

    def dtype(self, name: str) -> str:
        return self._DTYPES.get(self.get(name).dtype, str(self.get(name).dtype))

    def get(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise ConversionError(f"{self.root}: tensor {name!r} not found in the checkpoint")
        return self.tensors[name]

    def get_row(self, name: str, i: int) -> torch.Tensor:
        return self.get(name)[i]


def save_safetensors(tensors: dict[str, torch.Tensor], out: str | Path, max_shard_bytes: int = 5 * 2**30) -> list[str]:
    """Write `tensors` as model.safetensors, or as shards + index when larger than one shard.

    Returns the written file names. Tensors keep their dtype; they are made contiguous. The weight
    files of an earlier save in `out` go first: a stale model.safetensors beside new shards is what
    transformers would load, and a stale index would name shards of another save.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for old in [out / SINGLE_FILE, out / INDEX_FILE, *out.glob("model-*-of-*.safetensors")]:
        old.unlink(missing_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in tensors:
        t = tensors[name].contiguous()
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(out / SINGLE_FILE), metadata=metadata)
        return [SINGLE_FILE]
    files, weight_map, total = [], {}, 0
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / file), metadata=metadata)
        files.append(file)
        for name, t in shard.items():
            weight_map[name] = file
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return files


def load_all(src: str | Path, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor (or the listed ones) of a checkpoint directory, in memory."""
    ckpt = HFCheckpoint(src)
    return {n: ckpt.get(n) for n in (names if names is not None else ckpt.names)}
