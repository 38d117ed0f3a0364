"""Paged KV-cache bookkeeping: a reference-counted free-block allocator and per-sequence block tables.

The cache is one tensor of fixed-size blocks (`attention.allocate_kv_cache`); a sequence owns a list of block ids,
its block table, and token `t` of the sequence lives in slot `table[t // block_size] * block_size + t % block_size`.
Blocks are reference-counted so that the n samples of one prompt share the prompt's blocks: `fork` only bumps
counts, and the first write into a shared, partially filled last block copies it first (copy-on-write), so
siblings never see each other's tokens.

Pure Python, no tensors: the engine turns block ids into device tensors. Block 0 is reserved as a scratch block
that padded rows of a batch may write into, so it is never handed out.
"""

from __future__ import annotations

from dataclasses import dataclass

SCRATCH_BLOCK = 0
"""A block never allocated: padded batch rows write their keys and values here."""


class OutOfBlocksError(RuntimeError):
    """The allocator has no free block; the scheduler checks before allocating, so this is a bug if raised."""


class BlockAllocator:
    """Free list plus reference counts over block ids 1..num_blocks-1 (block 0 is the scratch block)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"need at least 2 blocks (one is scratch), got {num_blocks}")
        self.num_blocks = num_blocks
        # Handing out low ids first keeps the touched part of the cache compact.
        self._free = list(range(num_blocks - 1, SCRATCH_BLOCK, -1))
        self._refs = [0] * num_blocks
        self.total_allocations = 0
        """Blocks handed out since creation (fresh allocations only, forks are not counted)."""

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - 1 - len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise OutOfBlocksError("no free KV-cache block")
        block = self._free.pop()
        self._refs[block] = 1
        self.total_allocations += 1
        return block

    def incref(self, block: int) -> None:
        if self._refs[block] <= 0:
            raise ValueError(f"block {block} is not allocated")
        self._refs[block] += 1

    def decref(self, block: int) -> None:
        if self._refs[block] <= 0:
            raise ValueError(f"block {block} is not allocated")
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._free.append(block)

    def refcount(self, block: int) -> int:
        return self._refs[block]

    @property
    def refcounts(self) -> list[int]:
        """The count of every block, indexed by block id; for hot loops, which must not modify it."""
        return self._refs


@dataclass(frozen=True)
class SlotWrite:
    """Where the next token of a sequence goes, and the block copy (copy-on-write) that must happen first."""

    slot: int
    copy_from: int | None = None
    """Source block to copy into the sequence's new last block before writing; None when no copy is needed."""
    copy_to: int | None = None


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)


def allocate_tokens(allocator: BlockAllocator, num_tokens: int, block_size: int) -> list[int]:
    """A fresh block table for `num_tokens` tokens."""
    return [allocator.allocate() for _ in range(blocks_for(num_tokens, block_size))]


def fork(allocator: BlockAllocator, table: list[int]) -> list[int]:
    """A copy of `table` sharing every block (each block's count goes up by one)."""
    for block in table:
        allocator.incref(block)
    return list(table)


def release(allocator: BlockAllocator, table: list[int]) -> None:
    """Drops the sequence's reference to each of its blocks and empties the table."""
    for block in table:
        allocator.decref(block)
    table.clear()


def prepare_append(allocator: BlockAllocator, table: list[int], position: int, block_size: int) -> SlotWrite:
    """Makes room for token `position` (the next one) in `table`, in place, and says where it goes.

    A new block is appended at a block boundary; a shared block that would be written into is replaced by a
    private copy (the caller copies the cache contents as `SlotWrite` says before the forward pass).
    """
    index, offset = divmod(position, block_size)
    if index > len(table):
        raise ValueError(f"position {position} skips a block (table has {len(table)} blocks)")
    if index == len(table):
        table.append(allocator.allocate())
        return SlotWrite(table[index] * block_size + offset)
    block = table[index]
    if allocator.refcount(block) == 1:
        return SlotWrite(block * block_size + offset)
    private = allocator.allocate()
    allocator.decref(block)
    table[index] = private
    return SlotWrite(private * block_size + offset, copy_from=block, copy_to=private)
