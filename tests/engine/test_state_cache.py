"""The linear-attention state cache: slots, copies for n samples, resets, and the bytes a sequence takes."""

from __future__ import annotations

import pytest
import torch

from hf_mcore_bridge.engine.state_cache import (
    SCRATCH_SLOT,
    OutOfSlotsError,
    StateCache,
    StateShape,
    state_bytes_per_sequence,
)

TINY = StateShape(
    num_layers=3, conv_dim=10, conv_kernel=4, num_v_heads=2, head_k_dim=3, head_v_dim=5, conv_dtype=torch.bfloat16
)


def test_bytes_per_sequence_of_a_qwen3_next_80b_shaped_model() -> None:
    """36 linear layers (48, three in four), 16 key heads and 32 value heads of 128, kernel 4, bf16 conv state:
    conv (2 * 16 * 128 + 32 * 128) * 3 * 2 = 49,152 bytes and recurrent 32 * 128 * 128 * 4 = 2,097,152 bytes a
    layer, 77,266,944 in all."""
    shape = StateShape(36, 2 * 16 * 128 + 32 * 128, 4, 32, 128, 128, torch.bfloat16)
    assert state_bytes_per_sequence(shape) == 77_266_944


def test_bytes_per_sequence_equal_what_a_slot_holds() -> None:
    cache = StateCache(TINY, num_slots=4, device="cpu")
    held = (cache.conv.nbytes + cache.recurrent.nbytes) // 4
    assert cache.bytes_per_sequence == held == 3 * (10 * 3 * 2 + 2 * 3 * 5 * 4)
    assert cache.recurrent.dtype == torch.float32 and cache.conv.dtype == torch.bfloat16


def test_slots_are_handed_out_zeroed_never_the_scratch_slot_and_run_out() -> None:
    cache = StateCache(TINY, num_slots=3, device="cpu")
    cache.conv.fill_(1.0)
    cache.recurrent.fill_(1.0)
    slots = [cache.allocate(), cache.allocate()]
    assert SCRATCH_SLOT not in slots
    for slot in slots:
        assert not cache.conv[:, slot].any() and not cache.recurrent[:, slot].any()
    assert cache.conv[:, SCRATCH_SLOT].all()
    with pytest.raises(OutOfSlotsError):
        cache.allocate()
    cache.free(slots[0])
    assert cache.allocate() == slots[0]


def test_copy_gives_every_sample_the_prompts_states_and_nothing_else() -> None:
    cache = StateCache(TINY, num_slots=6, device="cpu")
    prompt, *samples = (cache.allocate() for _ in range(4))
    other = cache.allocate()
    cache.conv.copy_(torch.randn(cache.conv.shape))
    cache.recurrent.copy_(torch.randn(cache.recurrent.shape))
    before = cache.conv.clone(), cache.recurrent.clone()
    cache.copy(prompt, samples)
    for states, old in zip((cache.conv, cache.recurrent), before, strict=True):
        for slot in samples:
            assert torch.equal(states[:, slot], old[:, prompt])
        for slot in (prompt, other, SCRATCH_SLOT):
            assert torch.equal(states[:, slot], old[:, slot])


def test_reset_zeroes_one_slot_in_every_layer() -> None:
    cache = StateCache(TINY, num_slots=4, device="cpu")
    a, b = cache.allocate(), cache.allocate()
    cache.conv.fill_(2.0)
    cache.recurrent.fill_(2.0)
    cache.reset(a)
    assert not cache.conv[:, a].any() and not cache.recurrent[:, a].any()
    assert cache.conv[:, b].eq(2).all() and cache.recurrent[:, b].eq(2).all()


def test_misuse_is_refused() -> None:
    cache = StateCache(TINY, num_slots=4, device="cpu")
    a = cache.allocate()
    with pytest.raises(ValueError, match="slot 2 is not allocated"):
        cache.free(2)
    with pytest.raises(ValueError, match="slot 0 is not allocated"):
        cache.copy(a, [SCRATCH_SLOT])
    with pytest.raises(ValueError, match="onto itself"):
        cache.copy(a, [a])
    with pytest.raises(ValueError, match="slot 3 is not allocated"):
        cache.reset(3)
    cache.free(a)
    with pytest.raises(ValueError, match=f"slot {a} is not allocated"):
        cache.free(a)
    with pytest.raises(ValueError, match="at least 2 state slots"):
        StateCache(TINY, num_slots=1, device="cpu")
