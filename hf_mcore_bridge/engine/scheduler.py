"""Continuous-batching scheduler: which sequences run in the next model step, and where their tokens go.

A step is either a prefill (admit waiting groups, compute their tokens' KV once, sample each sequence's first
token) or a decode (one token for every running sequence). Waiting groups are admitted first-come first-served
whenever a sequence slot is free for each of their sequences, the step's token budget allows, and the free blocks
cover their tokens plus one block per sequence of headroom; so sequences join as others finish.

A group is the n samples of one prompt: the prompt is prefilled once into the first sequence's blocks and the
others fork that block table (shared, reference-counted blocks; copy-on-write at the first divergent write).

When a decode step needs more blocks than are free, the most recently admitted running sequences are preempted:
their blocks are released and they wait at the front of the queue to be recomputed from their tokens so far
(prompt and generated), which yields the same continuation because sampling is counter-based. A single sequence
always fits (the engine checks that the cache holds `max_model_len` tokens), so preemption cannot livelock.

A hybrid model (Gated DeltaNet layers beside attention) also gives each sequence a state slot (`state_cache`):
taken, zeroed, when the sequence starts (every sequence of a group, each its own), given back when it finishes or
is preempted (never zeroed there: a sequence still queued on the device may write it once more, before the next
allocation's zeroing in stream order). A preempted sequence recomputes its states from its tokens in a fresh slot,
as it recomputes its KV. The n samples of a prompt share its KV blocks, but not its states: the engine copies the
prompt's states into the other samples' slots after the prefill. There is no prefix caching across prompts, which
for a hybrid model would need the linear layers' states at the cached prefix's end as well as its KV blocks.

Block tables are mirrored in a CPU int32 tensor (one row per sequence slot) so a decode step's table is an
`index_select`, not a rebuild from Python lists.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from hf_mcore_bridge.engine.kv_cache import (
    SCRATCH_BLOCK,
    BlockAllocator,
    allocate_tokens,
    blocks_for,
    fork,
    prepare_append,
    release,
)
from hf_mcore_bridge.engine.sampling import SamplingParams
from hf_mcore_bridge.engine.state_cache import StateCache


@dataclass
class Sequence:
    """One sample being generated: its tokens so far, log-probabilities and blocks."""

    request_index: int
    sample_index: int
    rng_key: int
    """Counter-RNG key of this sample: `sampling.stream_key(seed, stream)`, the stream unique in its call."""
    prompt_len: int
    token_ids: list[int]
    """Prompt followed by the generated tokens."""
    params: SamplingParams
    max_len: int
    """Length (prompt plus generated) at which the sample ends: max_tokens or max_model_len, the lower."""
    logprobs: list[float] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    row: int = -1
    """Row of the scheduler's block-table mirror while running, else -1."""
    state_slot: int = -1
    """A hybrid model's state-cache slot while running (`state_cache.StateCache`), else -1."""
    routing: list[torch.Tensor] = field(default_factory=list)
    """With routing recorded (`EngineConfig.record_routing`): host chunks `[moe_layers, n, k]` of the expert ids
    its tokens were routed to, in position order; `routed` rows in all."""
    routed: int = 0
    finish_reason: str | None = None

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len


@dataclass
class Group:
    """Sequences prefilled together from one token prefix (a prompt's n samples, or one preempted sequence)."""

    sequences: list[Sequence]

    @property
    def tokens(self) -> list[int]:
        return self.sequences[0].token_ids


@dataclass
class SchedulerStats:
    """Counters that show what the scheduler did (for tests and benchmarks)."""

    prefill_steps: int = 0
    decode_steps: int = 0
    prefill_tokens: int = 0
    """Tokens whose KV was computed by prefill steps (a prompt shared by n samples counts once)."""
    max_running: int = 0
    joins_while_running: int = 0
    """Groups admitted while other sequences were running (continuous batching)."""
    waits_for_blocks: int = 0
    """Steps in which the next waiting group had sequence slots but not enough free blocks."""
    preemptions: int = 0
    cow_copies: int = 0
    peak_blocks_used: int = 0


@dataclass(frozen=True)
class PrefillStep:
    groups: list[Group]
    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    seq_lens: list[int]


@dataclass(frozen=True)
class DecodeStep:
    sequences: list[Sequence]
    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    context_lens: list[int]
    block_tables: torch.Tensor
    """[B, n_blocks] int32 (CPU), padded with the scratch block."""
    copies: list[tuple[int, int]]
    """(src, dst) block copies to do before the step (copy-on-write)."""
    state_slots: list[int] = field(default_factory=list)
    """A hybrid model's state slot of each sequence; empty for other models."""


class Scheduler:
    def __init__(
        self,
        allocator: BlockAllocator,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_blocks_per_seq: int,
        states: StateCache | None = None,
    ) -> None:
        self.allocator = allocator
        self.states = states
        """A hybrid model's state cache (at least `max_num_seqs` slots besides the scratch one); None: no states."""
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Group] = deque()
        self.running: list[Sequence] = []
        self.stats = SchedulerStats()
        self.tables = torch.full((max_num_seqs, max_blocks_per_seq), SCRATCH_BLOCK, dtype=torch.int32)
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))

    def add(self, group: Group) -> None:
        self.waiting.append(group)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> PrefillStep | DecodeStep:
        """The next step: a prefill if any waiting group can be admitted, else a decode of all running."""
        admitted = self._admit()
        if admitted:
            return self._prefill_step(admitted)
        if not self.running:
            raise RuntimeError("nothing is running and the next waiting group cannot be admitted")
        return self._decode_step()

    def finish(self, finished: list[Sequence]) -> None:
        """Removes sequences whose `finish_reason` is set from the running set; gives their blocks back."""
        if not finished:
            return
        self.running = [seq for seq in self.running if seq.finish_reason is None]
        for seq in finished:
            self._release(seq)

    def _admit(self) -> list[Group]:
        admitted: list[Group] = []
        tokens = 0
        others_running = bool(self.running)
        while self.waiting:
            group = self.waiting[0]
            size = len(group.sequences)
            if len(self.running) + size > self.max_num_seqs:
                break
            if tokens + len(group.tokens) > self.max_num_batched_tokens:
                break
            # One block of headroom per sequence covers its first decode write (a new block or a COW copy).
            if blocks_for(len(group.tokens), self.block_size) + size > self.allocator.num_free:
                self.stats.waits_for_blocks += 1
                break
            self.waiting.popleft()
            if others_running:
                self.stats.joins_while_running += 1
            self._start(group)
            admitted.append(group)
            tokens += len(group.tokens)
        return admitted

    def _start(self, group: Group) -> None:
        first, *others = group.sequences
        first.blocks = allocate_tokens(self.allocator, len(first.token_ids), self.block_size)
        for seq in others:
            seq.blocks = fork(self.allocator, first.blocks)
        for seq in group.sequences:
            if self.states is not None:
                seq.state_slot = self.states.allocate()
            seq.row = self._free_rows.pop()
            self._mirror(seq)
            self.running.append(seq)
        self.stats.max_running = max(self.stats.max_running, len(self.running))
        self.stats.peak_blocks_used = max(self.stats.peak_blocks_used, self.allocator.num_used)

    def _prefill_step(self, groups: list[Group]) -> PrefillStep:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        for group in groups:
            tokens, blocks = group.tokens, group.sequences[0].blocks
            input_ids += tokens
            positions += range(len(tokens))
            slots += [blocks[p // self.block_size] * self.block_size + p % self.block_size for p in range(len(tokens))]
            seq_lens.append(len(tokens))
        self.stats.prefill_steps += 1
        self.stats.prefill_tokens += len(input_ids)
        return PrefillStep(groups, input_ids, positions, slots, seq_lens)

    def _decode_step(self) -> DecodeStep:
        self._preempt_until_blocks_suffice()
        bs, refs = self.block_size, self.allocator.refcounts
        input_ids, positions, slots, copies = [], [], [], []
        for seq in self.running:
            position = len(seq.token_ids) - 1
            offset = position % bs
            last = seq.blocks[-1]
            # Hot path, taken 15 times in 16: the token goes into the sequence's own, partly filled last block.
            if offset and refs[last] == 1:
                slots.append(last * bs + offset)
            else:
                write = prepare_append(self.allocator, seq.blocks, position, bs)
                if write.copy_from is not None and write.copy_to is not None:
                    copies.append((write.copy_from, write.copy_to))
                self.tables[seq.row, position // bs] = seq.blocks[-1]
                slots.append(write.slot)
            input_ids.append(seq.token_ids[-1])
            positions.append(position)
        context_lens = [p + 1 for p in positions]
        n_blocks = blocks_for(max(context_lens), bs)
        rows = torch.from_numpy(np.array([seq.row for seq in self.running], dtype=np.int64))
        block_tables = self.tables.index_select(0, rows)[:, :n_blocks]
        self.stats.decode_steps += 1
        self.stats.cow_copies += len(copies)
        self.stats.peak_blocks_used = max(self.stats.peak_blocks_used, self.allocator.num_used)
        state_slots = [seq.state_slot for seq in self.running] if self.states is not None else []
        return DecodeStep(
            list(self.running), input_ids, positions, slots, context_lens, block_tables, copies, state_slots
        )

    def _blocks_needed(self) -> int:
        """Fresh blocks the next decode step takes: one per sequence at a block boundary or on a shared block."""
        bs, refs = self.block_size, self.allocator.refcounts
        return sum(1 for seq in self.running if (len(seq.token_ids) - 1) % bs == 0 or refs[seq.blocks[-1]] > 1)

    def _preempt_until_blocks_suffice(self) -> None:
        if self.allocator.num_free >= len(self.running):
            return  # a step takes at most one block per sequence: no need to count
        while self._blocks_needed() > self.allocator.num_free:
            if len(self.running) == 1:
                raise RuntimeError("a single sequence does not fit in the KV cache")
            victim = self.running.pop()
            self._release(victim)
            self.waiting.appendleft(Group([victim]))
            self.stats.preemptions += 1

    def _release(self, seq: Sequence) -> None:
        release(self.allocator, seq.blocks)
        self.tables[seq.row].fill_(SCRATCH_BLOCK)
        self._free_rows.append(seq.row)
        seq.row = -1
        if self.states is not None:
            self.states.free(seq.state_slot)
            seq.state_slot = -1

    def _mirror(self, seq: Sequence) -> None:
        self.tables[seq.row, : len(seq.blocks)] = torch.tensor(seq.blocks, dtype=torch.int32)
