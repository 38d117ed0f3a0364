"""The block allocator and block-table operations, step by step."""

from __future__ import annotations

import pytest

from hf_mcore_bridge.engine.kv_cache import (
    SCRATCH_BLOCK,
    BlockAllocator,
    OutOfBlocksError,
    allocate_tokens,
    fork,
    prepare_append,
    release,
)


def test_allocator_never_hands_out_the_scratch_block_and_runs_out():
    allocator = BlockAllocator(4)
    blocks = [allocator.allocate() for _ in range(3)]
    assert SCRATCH_BLOCK not in blocks
    assert sorted(blocks) == [1, 2, 3]
    assert allocator.num_free == 0
    with pytest.raises(OutOfBlocksError):
        allocator.allocate()
    allocator.decref(blocks[0])
    assert allocator.allocate() == blocks[0]


def test_fork_shares_blocks_until_every_reference_is_released():
    allocator = BlockAllocator(10)
    parent = allocate_tokens(allocator, 10, block_size=4)
    assert len(parent) == 3
    child = fork(allocator, parent)
    assert child == parent
    assert allocator.num_used == 3
    assert all(allocator.refcount(b) == 2 for b in parent)
    release(allocator, parent)
    assert allocator.num_used == 3
    release(allocator, child)
    assert allocator.num_used == 0
    assert child == []
    with pytest.raises(ValueError):
        allocator.decref(1)


def test_append_copies_a_shared_partial_block_and_appends_at_boundaries():
    allocator = BlockAllocator(16)
    a = allocate_tokens(allocator, 6, block_size=4)  # block 0 full, block 1 half full
    b = fork(allocator, a)
    shared_last = a[1]
    free = allocator.num_free

    write = prepare_append(allocator, a, 6, 4)  # a writes first: copy-on-write
    assert write.copy_from == shared_last
    assert write.copy_to == a[1] != shared_last
    assert write.slot == a[1] * 4 + 2
    assert allocator.refcount(shared_last) == 1
    assert allocator.num_free == free - 1

    write = prepare_append(allocator, b, 6, 4)  # b is now the only owner: writes in place
    assert write.copy_from is None
    assert write.slot == shared_last * 4 + 2
    assert allocator.num_free == free - 1

    write = prepare_append(allocator, b, 8, 4)  # block boundary: a fresh block
    assert len(b) == 3
    assert write.slot == b[2] * 4
    assert allocator.refcount(a[0]) == 2  # the full first block stays shared


def test_append_cannot_skip_a_block():
    allocator = BlockAllocator(8)
    table = allocate_tokens(allocator, 4, block_size=4)
    with pytest.raises(ValueError):
        prepare_append(allocator, table, 9, 4)
