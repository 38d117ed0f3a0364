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
    """Model tensors of a `torch_dist` checkpoint directory."""

    def __init__(self, checkpoint_dir: Path):
        self.dcp = DCPCheckpoint(checkpoint_dir)

    def keys(self) -> set[str]:
        return {k for k in self.dcp.tensor_keys() if not k.startswith(NON_MODEL_PREFIXES)}

    def shape(self, key: str) -> tuple[int, ...]:
        return self.dcp.tensor_meta(key).shape

    def dtype(self, key: str) -> DType:
        return self.dcp.tensor_meta(key).dtype

    def location(self, key: str) -> str:
        return str(self.dcp.location(key))

    @property
    def stacked(self) -> bool | None:
        return None  # the key names say it: the model config's homogeneity decides which keys to look for

    def read(self, key: str, leading: tuple[int, ...]) -> torch.Tensor:
        if not leading:
            return self.dcp.read(key)
        shape = self.shape(key)
        rest = shape[len(leading) :]
        region = self.dcp.read(key, (*leading, *(0,) * len(rest)), ((1,) * len(leading) + rest))
        return region.reshape(rest)
