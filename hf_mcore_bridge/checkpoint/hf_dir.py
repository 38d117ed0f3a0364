"""Reading HF model directories: config, safetensors shards (indexed or single), assets. Validated up front.

Only safetensors are read: a `.bin` (pickle) checkpoint is refused unless explicitly allowed, and even then it
is loaded with `torch.load(weights_only=True)`. Tensors are read one at a time (or a row range of one), so memory
stays bounded by the largest tensor.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import SafetensorError, safe_open

from hf_mcore_bridge.checkpoint import dtypes, expert_parts
from hf_mcore_bridge.checkpoint.names import fill
from hf_mcore_bridge.checkpoint.paths import PathError, lookup
from hf_mcore_bridge.checkpoint.pickles import refused_globals
from hf_mcore_bridge.errors import CheckpointError

if TYPE_CHECKING:
    import torch

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
ASSET_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
)
"""Non-weight files carried along with a model (config, generation config, tokenizer)."""


@dataclass(frozen=True)
class TensorInfo:
    """Where a tensor lives and what it is, read from the safetensors header."""

    file: Path
    shape: tuple[int, ...]
    dtype: dtypes.DType
    data_offset: int | None = None
    """Where the tensor's bytes (row-major, little-endian) start in `file`; None when not stored as such there."""


@dataclass(frozen=True)
class TextView:
    """A vision-language checkpoint seen as its language model: the text config, and the stored tensor names."""

    config: dict[str, Any]
    """The language model's config (with its `architectures`)."""
    rename: Callable[[str], str | None]
    """A stored name -> its name in the language model; None for a tensor outside it."""
    carried: Callable[[str], bool]
    """Whether a tensor outside the language model is the wrapper's own (kept aside, not unknown)."""
    metadata: dict[str, str]
    """What an export needs to name the language model's tensors again (kept with the carried tensors)."""


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a file, with a one-line error when it is missing or malformed."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} does not hold a JSON object")
    return data


def data_offsets(file: Path) -> dict[str, int]:
    """Each tensor's data offset in a safetensors file (already validated by `safe_open`), from its header: an
    8-byte little-endian length, then that many bytes of JSON whose `data_offsets` count from the header's end."""
    with file.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    return {
        name: 8 + length + int(entry["data_offsets"][0])
        for name, entry in header.items()
        if name != "__metadata__" and isinstance(entry, dict)
    }


def _present(path: Path) -> bool:
    """Whether something is at `path`; `PathError` ("cannot be followed: ...") for a symlink loop, a name too
    long, and a dangling symlink."""
    if lookup(path, path.name) is not None:
        return True
    if path.is_symlink():
        raise PathError(path.name, path, f"is a symlink to {os.readlink(path)}, which does not exist")
    return False


class HFCheckpoint:
    """An HF model directory, opened and validated: every shard readable, every indexed tensor present."""

    def __init__(
        self,
        path: Path | str,
        *,
        allow_pickle: bool = False,
        view: Callable[[dict[str, Any], Iterable[str]], TextView | None] | None = None,
    ):
        """`view`: given the config and the tensor names, how to see the checkpoint as the language model inside
        it (None: as it is)."""
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path} is not a directory")
        self.config = read_json(self.path / "config.json")
        self._tensors: dict[str, TensorInfo] = {}
        self._aliases: dict[str, tuple[str, int | None, str]] = {}
        self._pickled: dict[str, torch.Tensor] | None = None
        self._stored: dict[str, str] = {}
        self.view: TextView | None = None
        self.wrapper_config: dict[str, Any] | None = None
        """The config of the vision-language class this checkpoint is of (`config` is its language model's)."""
        self.carried: dict[str, TensorInfo] = {}
        """The wrapper's own tensors (vision tower, projector) by stored name, outside `names()`."""
        if _present(self.path / INDEX_NAME):
            self._open_index()
        elif _present(self.path / SINGLE_NAME):
            self._open_file(self.path / SINGLE_NAME, None)
        elif any(self.path.glob("*.bin")):
            if not allow_pickle:
                raise CheckpointError(
                    f"{self.path} holds only pickle (.bin) weights; convert them to safetensors, "
                    "or pass --allow-pickle if you trust the source"
                )
            self._open_pickle()
        else:
            raise CheckpointError(f"{self.path} has no {SINGLE_NAME} or {INDEX_NAME}")
        found = view(self.config, list(self._tensors)) if view is not None else None
        if found is not None:
            self._view_text(found)

    def _view_text(self, view: TextView) -> None:
        self.view, self.wrapper_config, self.config = view, self.config, view.config
        tensors: dict[str, TensorInfo] = {}
        for stored, info in self._tensors.items():
            text = view.rename(stored)
            if text is None and view.carried(stored):
                self.carried[stored] = info
                continue
            tensors[text or stored] = info
            self._stored[text or stored] = stored
        self._tensors = tensors

    @property
    def architecture(self) -> str:
        """The first `architectures` entry of the config."""
        names = self.config.get("architectures") or []
        if not names:
            raise CheckpointError(f"{self.path / 'config.json'} has no 'architectures' entry")
        return str(names[0])

    def _open_index(self) -> None:
        index = read_json(self.path / INDEX_NAME)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{self.path / INDEX_NAME} has no weight_map")
        by_file: dict[str, set[str]] = {}
        for name, file in weight_map.items():
            by_file.setdefault(file, set()).add(name)
        for file, names in sorted(by_file.items()):
            shard = self.path / file
            try:
                present = _present(shard)
            except PathError as err:
                raise CheckpointError(f"{INDEX_NAME} names shard {file}, which {err.reason}") from None
            if not present:
                raise CheckpointError(f"{INDEX_NAME} names shard {file}, which does not exist")
            self._open_file(shard, names)

    def _open_file(self, file: Path, expected: set[str] | None) -> None:
        try:
            with safe_open(str(file), framework="numpy") as handle:  # headers only: no torch needed
                names = list(handle.keys())
                offsets = data_offsets(file)
                for name in names:
                    view = handle.get_slice(name)
                    dtype = dtypes.BY_SAFETENSORS.get(view.get_dtype())
                    if dtype is None:
                        raise CheckpointError(f"{file.name}: tensor {name} has unsupported dtype {view.get_dtype()}")
                    self._tensors[name] = TensorInfo(file, tuple(view.get_shape()), dtype, offsets.get(name))
        except (SafetensorError, OSError, ValueError) as err:
            raise CheckpointError(f"{file} is not a readable safetensors file (corrupt or truncated): {err}") from None
        if expected is not None:
            missing = sorted(expected - set(names))
            if missing:
                raise CheckpointError(f"{file.name} lacks {len(missing)} tensor(s) its index names, e.g. {missing[0]}")

    def _open_pickle(self) -> None:
        import torch

        self._pickled = {}
        for file in sorted(self.path.glob("*.bin")):
            try:
                state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            except Exception as err:
                refused = refused_globals(file, err)
                if refused is not None:
                    raise CheckpointError(f"{file} {refused}") from None
                reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                raise CheckpointError(f"{file} could not be read as a weights-only torch file: {reason}") from None
            for name, tensor in state.items():
                self._pickled[name] = tensor
                self._tensors[name] = TensorInfo(file, tuple(tensor.shape), dtypes.of(tensor.dtype))

    def add_fused_aliases(self, rules: dict[str, tuple[str, str]], wanted: list[tuple[str, int | None, int | None]]):
        """Serve per-expert names from fused `[num_experts, ...]` tensors where only those are stored.

        `rules` maps a per-expert name template to (fused template, part); `wanted` lists (template, layer,
        expert) of the names the model needs. Aliased names read one expert's slice of the fused tensor.
        """
        for template, layer, expert in wanted:
            name = fill(template, layer, expert)
            if template not in rules or name in self._tensors:
                continue
            fused_template, part = rules[template]
            fused = fill(fused_template, layer, expert)
            if fused not in self._tensors:
                continue
            info = self._tensors[fused]
            shape = info.shape[1:] if expert is not None else info.shape
            if shape:  # a fused tensor of the wrong rank is reported by the shape check
                shape = expert_parts.part_shape(part, shape)
            self._aliases[name] = (fused, expert, part)
            self._tensors[name] = TensorInfo(info.file, shape, info.dtype)

    def location(self, name: str) -> tuple[Path, int] | None:
        """The file and offset where a tensor's bytes are stored as they are (row-major, little-endian); None for
        tensors served otherwise (a slice of a fused tensor, a pickle)."""
        if name in self._aliases or self._pickled is not None:
            return None
        info = self.info(name)
        return None if info.data_offset is None else (info.file, info.data_offset)

    def fused_source(self, name: str) -> tuple[str, bool, str] | None:
        """For a per-expert name read from a fused tensor: (fused name, has an expert axis, part); else None."""
        alias = self._aliases.get(name)
        return None if alias is None else (alias[0], alias[1] is not None, alias[2])

    def names(self) -> set[str]:
        """All tensor names in the checkpoint (fused expert tensors that are read per expert appear per expert)."""
        consumed = {fused for fused, _, _ in self._aliases.values()}
        return set(self._tensors) - consumed

    def info(self, name: str) -> TensorInfo:
        """Shape, dtype and file of a tensor."""
        try:
            return self._tensors[name]
        except KeyError:
            raise CheckpointError(f"tensor {name} is missing from {self.path}") from None

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """A tensor (or the row range [start, stop) of its first dimension), read from disk now."""
        if name in self._aliases:
            return self._read_alias(name, rows)
        info = self.info(name)
        return self._read_stored(self._stored.get(name, name), info, rows)

    def read_carried(self, stored: str) -> torch.Tensor:
        """One of the wrapper's own tensors (`carried`), by its stored name."""
        return self._read_stored(stored, self.carried[stored], None)

    def _read_stored(self, name: str, info: TensorInfo, rows: tuple[int, int] | None) -> torch.Tensor:
        if self._pickled is not None:
            tensor = self._pickled[name]
            return (tensor[rows[0] : rows[1]] if rows else tensor).clone()
        try:
            with safe_open(str(info.file), framework="pt") as handle:
                if rows is None:
                    return handle.get_tensor(name)
                return handle.get_slice(name)[rows[0] : rows[1]]
        except (SafetensorError, OSError) as err:
            raise CheckpointError(f"reading {name} from {info.file.name} failed: {err}") from None

    def _read_alias(self, name: str, rows: tuple[int, int] | None) -> torch.Tensor:
        fused, expert, part = self._aliases[name]
        tensor = expert_parts.take(self._expert_slice(fused, expert), part)
        return tensor[rows[0] : rows[1]].clone() if rows else tensor

    def _expert_slice(self, fused: str, expert: int | None) -> torch.Tensor:
        """One expert's slice of a fused tensor (all of it for `expert` None), read from disk now."""
        info = self._tensors[fused]
        try:
            with safe_open(str(info.file), framework="pt") as handle:
                stored = self._stored.get(fused, fused)  # a wrapper's stored name for the text model's
                slice_ = handle.get_slice(stored)
                return slice_[expert : expert + 1][0] if expert is not None else handle.get_tensor(stored)
        except (SafetensorError, OSError) as err:
            raise CheckpointError(f"reading {fused} from {info.file.name} failed: {err}") from None

    def copy_assets(self, destination: Path) -> list[str]:
        """Copy config, generation config and tokenizer files into `destination`; returns their names."""
        destination.mkdir(parents=True, exist_ok=True)
        copied = []
        for name in ASSET_FILES:
            source = self.path / name
            if source.is_file():
                shutil.copy2(source, destination / name)
                copied.append(name)
        return copied
