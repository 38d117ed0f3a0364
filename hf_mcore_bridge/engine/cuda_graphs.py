"""Decode-step inputs packed into one int64 buffer, and CUDA graphs of the decode step for shape buckets.

A decode step's inputs (token ids, positions, cache slots, context lengths, a hybrid model's state slots, block
tables) are packed on the host into one int64 tensor so a step costs a single host-to-device copy; `unpack` gives
device views into it. The same packing serves the eager path (exact shapes) and the graph path (shapes rounded up
to a bucket).

`DecodeGraphs` captures the decode forward pass once per (batch bucket, block-count bucket) on first use and
replays it afterwards; padded rows read and write only the scratch block and their logits are dropped. Graphs
bake in the addresses of the weights and of the KV cache: a refit that copies in place keeps them valid, but
anything that reallocates either (sleep / wake_up) must call `clear()`; the same holds for a hybrid model's state
tensors (`state_cache.StateCache`), allocated before the first capture and replaced only by sleep / wake_up.
Graphs share one memory pool, which is safe because replays never overlap and each replay's logits are consumed
before the next one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from hf_mcore_bridge.engine.attention import DecodeMetadata
from hf_mcore_bridge.engine.gated_delta import decode_batch
from hf_mcore_bridge.engine.kv_cache import SCRATCH_BLOCK
from hf_mcore_bridge.engine.state_cache import SCRATCH_SLOT

COLUMNS = 5
"""Per-row columns of the packed buffer: token id, position, cache slot, context length, state slot."""

DecodeFn = Callable[[torch.Tensor, torch.Tensor, DecodeMetadata], torch.Tensor]
"""(input_ids [B], positions [B], metadata) -> logits [B, vocab]."""


@dataclass(frozen=True)
class DecodeBatch:
    """Host-side inputs of one decode step (B real rows)."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    context_lens: list[int]
    block_tables: torch.Tensor
    """[B, n_blocks] int32 on the host."""
    state_slots: list[int] = field(default_factory=list)
    """A hybrid model's state-cache slot of each row (`state_cache`); empty for other models."""


def pack(batch: DecodeBatch, rows: int, n_blocks: int) -> torch.Tensor:
    """The batch padded to `rows` x `n_blocks`, as one int64 host tensor [COLUMNS * rows + rows * n_blocks]."""
    real = len(batch.input_ids)
    buf = torch.empty(COLUMNS * rows + rows * n_blocks, dtype=torch.int64)
    columns = buf[: COLUMNS * rows].view(COLUMNS, rows)
    if real:
        # numpy converts Python lists several times faster than torch.tensor does.
        state_slots = batch.state_slots or [SCRATCH_SLOT] * real
        values = (batch.input_ids, batch.positions, batch.slots, batch.context_lens, state_slots)
        columns[:, :real] = torch.from_numpy(np.array(values, dtype=np.int64))
    # Padded rows write to the scratch slot and see one (scratch) token, so their softmax stays finite; their
    # states are the scratch state slot's.
    columns[:3, real:] = 0
    columns[3, real:] = 1
    columns[4, real:] = SCRATCH_SLOT
    tables = buf[COLUMNS * rows :].view(rows, n_blocks)
    tables.fill_(SCRATCH_BLOCK)
    tables[:real, : batch.block_tables.shape[1]] = batch.block_tables
    return buf


def unpack(
    buf: torch.Tensor, rows: int, n_blocks: int, linear: bool = False
) -> tuple[torch.Tensor, torch.Tensor, DecodeMetadata]:
    """Views (input_ids, positions, metadata) into a packed buffer; `linear`: the metadata carries the state slots
    of a hybrid model's Gated DeltaNet layers (`gated_delta.decode_batch`)."""
    meta = DecodeMetadata(
        slot_mapping=buf[2 * rows : 3 * rows],
        block_tables=buf[COLUMNS * rows :].view(rows, n_blocks),
        context_lens=buf[3 * rows : 4 * rows],
        linear=decode_batch(buf[4 * rows : 5 * rows]) if linear else None,
    )
    return buf[:rows], buf[rows : 2 * rows], meta


def batch_bucket(batch: int, max_batch: int) -> int:
    """Rows a graph is captured for: powers of two up to 8, then multiples of 16 up to 128, then of 64."""
    if batch <= 8:
        bucket = 1 << (batch - 1).bit_length()
    elif batch <= 128:
        bucket = -(-batch // 16) * 16
    else:
        bucket = -(-batch // 64) * 64
    return min(bucket, max_batch)


def block_bucket(n_blocks: int, max_blocks: int, step: int) -> int:
    """Block-table width a graph is captured for: a multiple of `step` (at least `n_blocks`)."""
    return min(-(-n_blocks // step) * step, max_blocks)


class Replayable(Protocol):
    def replay(self) -> None: ...


@dataclass
class _Captured:
    graph: Replayable
    inputs: torch.Tensor
    """The packed static inputs the graph reads."""
    logits: torch.Tensor
    """The static logits the graph writes."""


class DecodeGraphs:
    """Lazily captured CUDA graphs of the decode step, keyed by (rows, n_blocks) bucket."""

    def __init__(
        self,
        decode_fn: DecodeFn,
        device: torch.device,
        max_batch: int,
        max_blocks: int,
        block_step: int,
        full_width_rows: int | None = None,
        linear: bool = False,
    ):
        self.decode_fn = decode_fn
        self.device = device
        self.max_batch = max_batch
        self.max_blocks = max_blocks
        self.block_step = block_step
        self.full_width_rows = full_width_rows
        """Batch buckets of at least this many rows are captured with full-width block tables only (a kernel
        compiled per shape runs there); None: always bucket the width."""
        self.linear = linear
        """The model is hybrid: the captured steps read the state slots (`unpack`)."""
        self._graphs: dict[tuple[int, int], _Captured] = {}
        self._pool: tuple[int, int] | None = None

    @property
    def num_captured(self) -> int:
        return len(self._graphs)

    def clear(self) -> None:
        self._graphs.clear()
        self._pool = None

    def run(self, batch: DecodeBatch, device_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, vocab] of the step, from the replay of its bucket's graph. `device_ids` [B], when given,
        are the step's input tokens already on the device (they replace `batch.input_ids`)."""
        real = len(batch.input_ids)
        rows = batch_bucket(real, self.max_batch)
        if self.full_width_rows is not None and rows >= self.full_width_rows:
            n_blocks = self.max_blocks
        else:
            n_blocks = block_bucket(batch.block_tables.shape[1], self.max_blocks, self.block_step)
        captured = self._graphs.get((rows, n_blocks)) or self._capture(rows, n_blocks)
        captured.inputs.copy_(pack(batch, rows, n_blocks), non_blocking=True)
        if device_ids is not None:
            captured.inputs[:real].copy_(device_ids)
        captured.graph.replay()
        return captured.logits[:real]

    def _capture(self, rows: int, n_blocks: int) -> _Captured:
        empty = DecodeBatch([], [], [], [], torch.zeros(0, 0, dtype=torch.int32))
        inputs = pack(empty, rows, n_blocks).to(self.device)
        ids, positions, meta = unpack(inputs, rows, n_blocks, self.linear)
        graph, logits = self._record(ids, positions, meta)
        captured = _Captured(graph, inputs, logits)
        self._graphs[(rows, n_blocks)] = captured
        return captured

    def _record(
        self, ids: torch.Tensor, positions: torch.Tensor, meta: DecodeMetadata
    ) -> tuple[Replayable, torch.Tensor]:
        """Captures one decode forward over the static inputs; returns the graph and its static logits."""
        # Warm-up on a side stream, as graph capture requires (lazy kernel and workspace initialisation).
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.decode_fn(ids, positions, meta)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self.decode_fn(ids, positions, meta)
        return graph, logits
