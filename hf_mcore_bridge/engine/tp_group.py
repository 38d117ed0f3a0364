"""The engine's tensor-parallel collectives over a given `torch.distributed` process group.

The engine never builds a world of its own: the caller passes the group its tensor-parallel ranks form (e.g.
megatron-core's `parallel_state.get_tensor_model_parallel_group()`), NCCL on GPU, gloo on CPU. Three collectives:
the all-reduce of the row-parallel outputs and of the masked vocabulary-parallel embedding, the all-gather of the
vocabulary-parallel logits, and a broadcast of the unseeded requests' seeds (so every rank draws the same
numbers). A group of one rank, or none, gives no `TensorParallel` at all: the model then runs its single-device
code, without a collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hf_mcore_bridge.engine.tp_shards import TPRank


class TensorParallel:
    """A tensor-parallel group of two or more ranks and the engine's collectives over it."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.place = TPRank(dist.get_world_size(group), dist.get_rank(group))

    @classmethod
    def of(cls, group: dist.ProcessGroup | None) -> TensorParallel | None:
        """None for no group or a group of one rank (the single-device path), else the group's collectives."""
        if group is None or dist.get_world_size(group) == 1:
            return None
        return cls(group)

    @property
    def size(self) -> int:
        return self.place.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x`, in place (a rank's partial output of a row-parallel layer)."""
        dist.all_reduce(x, group=self.group)
        return x

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """[N, V/tp] vocabulary blocks of every rank -> the full [N, vocab_size] logits (padding cut off), the
        same tensor on every rank."""
        rows, per_rank = logits.shape
        out = logits.new_empty(self.size * rows, per_rank)
        dist.all_gather_into_tensor(out, logits.contiguous(), group=self.group)
        return out.view(self.size, rows, per_rank).transpose(0, 1).reshape(rows, -1)[:, :vocab_size]

    def broadcast_seeds(self, seeds: list[int], device: torch.device) -> list[int]:
        """The first rank's `seeds` on every rank (int64)."""
        tensor = torch.tensor(seeds, dtype=torch.int64, device=device)
        dist.broadcast(tensor, group=self.group, group_src=0)
        return tensor.tolist()
