"""Per-sequence states of a hybrid model's linear-attention layers, beside the paged KV cache of its attention layers.

A Gated DeltaNet layer (`gated_delta.py`) keeps no per-token cache: each sequence carries, for every linear layer,
its conv state `[conv_dim, kernel - 1]` (the last inputs of the causal conv1d) and its recurrent state
`[v_heads, head_k_dim, head_v_dim]` (float32), whatever its length. Those live in two tensors with one slot per
sequence, `conv [layers, slots, conv_dim, kernel - 1]` and `recurrent [layers, slots, v_heads, head_k_dim,
head_v_dim]`; a sequence holds one slot from admission until it finishes or is preempted.

- `allocate` hands out a slot with zeroed states (a fresh sequence: transformers' forward without a cache);
- `copy` puts a slot's states into other slots: the n samples of one prompt start from the prompt's state once it
  is prefilled (a copy, not a share: unlike the KV cache's blocks, every decode step rewrites the whole state);
- `free` gives the slot back; a preempted sequence frees its slot and, readmitted, gets a zeroed one and
  recomputes its states from its tokens (as its KV blocks are recomputed);
- slot 0 is scratch, never handed out: padded rows of a batch (CUDA-graph buckets) read and write it.

The slot bookkeeping is pure Python (`SlotAllocator`); the tensor operations are indexed copies, one per tensor
over every layer. Under tensor parallelism each rank's states hold only its heads (`LinearAttnSpec.local`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCRATCH_SLOT = 0
"""A slot never allocated: padded batch rows read and write their states here."""


class OutOfSlotsError(RuntimeError):
    """No free state slot; the scheduler checks before admitting, so this is a bug if raised."""


@dataclass(frozen=True)
class StateShape:
    """What one sequence's states are made of (per rank under tensor parallelism)."""

    num_layers: int
    """Linear-attention layers of the model (full-attention layers keep no state here)."""
    conv_dim: int
    conv_kernel: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_dtype: torch.dtype
    """The conv state's dtype: the activations' (it holds projection outputs, stored without loss)."""

    @property
    def conv_state(self) -> tuple[int, int]:
        return (self.conv_dim, self.conv_kernel - 1)

    @property
    def recurrent_state(self) -> tuple[int, int, int]:
        return (self.num_v_heads, self.head_k_dim, self.head_v_dim)


RECURRENT_DTYPE = torch.float32
"""The recurrent state's dtype: float32 always (it accumulates over the whole sequence)."""


def state_bytes_per_sequence(shape: StateShape) -> int:
    """Bytes one sequence's states take over all linear layers: layers * (conv_dim * (kernel - 1) * conv itemsize
    + v_heads * head_k_dim * head_v_dim * 4)."""
    conv = shape.conv_dim * (shape.conv_kernel - 1) * shape.conv_dtype.itemsize
    recurrent = shape.num_v_heads * shape.head_k_dim * shape.head_v_dim * RECURRENT_DTYPE.itemsize
    return shape.num_layers * (conv + recurrent)


class SlotAllocator:
    """Free list over slots 1..num_slots-1 (slot 0 is scratch)."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 2:
            raise ValueError(f"need at least 2 state slots (one is scratch), got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, SCRATCH_SLOT, -1))
        self._used = [False] * num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise OutOfSlotsError("no free state slot")
        slot = self._free.pop()
        self._used[slot] = True
        return slot

    def free(self, slot: int) -> None:
        self.check(slot)
        self._used[slot] = False
        self._free.append(slot)

    def check(self, slot: int) -> None:
        """`ValueError` unless `slot` is allocated."""
        if not 0 <= slot < self.num_slots or not self._used[slot]:
            raise ValueError(f"state slot {slot} is not allocated")


class StateCache:
    """The conv and recurrent states of `num_slots - 1` sequences (slot 0 scratch), every linear layer."""

    def __init__(self, shape: StateShape, num_slots: int, device: torch.device | str) -> None:
        self.shape = shape
        self.slots = SlotAllocator(num_slots)
        self.conv = torch.zeros(shape.num_layers, num_slots, *shape.conv_state, dtype=shape.conv_dtype, device=device)
        self.recurrent = torch.zeros(
            shape.num_layers, num_slots, *shape.recurrent_state, dtype=RECURRENT_DTYPE, device=device
        )

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv [slots, conv_dim, kernel - 1], recurrent [slots, v_heads, dk, dv]) of linear layer `index`:
        views that the layer reads and writes in place."""
        return self.conv[index], self.recurrent[index]

    def allocate(self) -> int:
        """A free slot, its states zeroed."""
        slot = self.slots.allocate()
        self.reset(slot)
        return slot

    def free(self, slot: int) -> None:
        self.slots.free(slot)

    def reset(self, slot: int) -> None:
        """Zeroes an allocated slot's states (a sequence that starts over)."""
        self.slots.check(slot)
        self.conv[:, slot].zero_()
        self.recurrent[:, slot].zero_()

    def copy(self, source: int, targets: list[int]) -> None:
        """Puts `source`'s states into every slot of `targets` (all allocated, none the source)."""
        self.slots.check(source)
        for target in targets:
            self.slots.check(target)
            if target == source:
                raise ValueError(f"state slot {source} copied onto itself")
        if not targets:
            return
        index = torch.tensor(targets, dtype=torch.int64, device=self.conv.device)
        for states in (self.conv, self.recurrent):
            states.index_copy_(1, index, states[:, source : source + 1].expand(-1, len(targets), *states.shape[2:]))

    @property
    def bytes_per_sequence(self) -> int:
        return state_bytes_per_sequence(self.shape)
