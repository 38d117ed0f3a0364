"""Read access to the model tensors of a Megatron checkpoint, whatever its storage format.

Tensors are addressed by their distributed-checkpoint key (decoder layers stacked on a leading layer axis) and
read one layer at a time. `DCPSource` serves `torch_dist` checkpoints; the legacy per-rank format provides the
same interface.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from hf_mcore_bridge.checkpoint.dcp_reader import DCPCheckpoint
from hf_mcore_bridge.checkpoint.dtypes import DType
from hf_mcore_bridge.checkpoint.names import split_tensor_parts

if TYPE_CHECKING:
    import torch

NON_MODEL_PREFIXES = ("optimizer.", "rng_state", "rerun_state_machine")
"""Keys a training checkpoint holds besides the model; export skips them."""


class McoreSource(Protocol):
    """What export needs from a Megatron checkpoint."""

    @property
    def stacked(self) -> bool | None:
        """Whether decoder layers are stacked under one key (None: as the model implies)."""
        ...

    def keys(self) -> set[str]:
        """Every model tensor key."""
        ...

    def shape(self, key: str) -> tuple[int, ...]:
        """The global shape, including leading layer / expert axes."""
        ...

    def dtype(self, key: str) -> DType: ...

    def location(self, key: str) -> str:
        """The file a tensor is (first) read from, for messages."""
        ...

    def read(self, key: str, leading: tuple[int, ...]) -> torch.Tensor:
        """The tensor at the given leading (layer / expert) indices, without those axes."""
        ...


class DCPSource:
    """Model tensors of a `torch_dist` checkpoint directory. A tensor megatron-core saves in parts
    (`names.SPLIT_TENSORS`: `<key>.query`, `<key>.key`, ...) is served whole under `<key>`, its parts' rows one
    after another."""

    def __init__(self, checkpoint_dir: Path):
        self.dcp = DCPCheckpoint(checkpoint_dir)
        stored = {k for k in self.dcp.tensor_keys() if not k.startswith(NON_MODEL_PREFIXES)}
        self._parts: dict[str, tuple[str, ...]] = {}
        for key in stored:
            whole, _, part = key.rpartition(".")
            parts = split_tensor_parts(whole)
            if parts is not None and part == parts[0] and all(f"{whole}.{p}" in stored for p in parts):
                self._parts[whole] = tuple(f"{whole}.{p}" for p in parts)
        split = {key for keys in self._parts.values() for key in keys}
        self._keys = (stored - split) | set(self._parts)

    def keys(self) -> set[str]:
        return set(self._keys)

    def shape(self, key: str) -> tuple[int, ...]:
        parts = self._parts.get(key)
        if parts is None:
            return self.dcp.tensor_meta(key).shape
        first, *_ = shapes = [self.dcp.tensor_meta(part).shape for part in parts]
        return (sum(shape[0] for shape in shapes), *first[1:])

    def dtype(self, key: str) -> DType:
        return self.dcp.tensor_meta(self._parts.get(key, (key,))[0]).dtype

    def location(self, key: str) -> str:
        return str(self.dcp.location(self._parts.get(key, (key,))[0]))

    @property
    def stacked(self) -> bool | None:
        return None  # the key names say it: the model config's homogeneity decides which keys to look for

    def read(self, key: str, leading: tuple[int, ...]) -> torch.Tensor:
        parts = self._parts.get(key)
        if parts is not None:
            import torch

            return torch.cat([self._read(part, leading) for part in parts])
        return self._read(key, leading)

    def _read(self, key: str, leading: tuple[int, ...]) -> torch.Tensor:
        if not leading:
            return self.dcp.read(key)
        shape = self.dcp.tensor_meta(key).shape
        rest = shape[len(leading) :]
        region = self.dcp.read(key, (*leading, *(0,) * len(rest)), ((1,) * len(leading) + rest))
        return region.reshape(rest)

    def is_split(self, key: str) -> bool:
        """Whether the tensor is served from parts (no single stored tensor holds its bytes)."""
        return key in self._parts
