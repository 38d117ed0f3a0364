"""Dropout on LoRA adapters' input (`policy.lora.dropout`), PEFT's semantics on both training backends.

PEFT computes `lora_B(lora_A(dropout(x))) * scaling` with `nn.Dropout`, active only in `module.train()`: each
adapted projection draws its own mask (q, k and v independently, though they read the same x), the kept elements
scaled by 1 / (1 - p). Both backends run their log-prob forwards (old policy, KL reference, the engine's
comparisons) in eval mode, so only the training forwards drop.

Which masks: torch's global RNG (so that activation recomputation, which saves and restores it, recomputes the same
masks), reseeded for every training mini-batch by `dropout_rng` from `policy.lora.seed`, the optimizer step and the
data replica (not the tensor-parallel rank), and restored afterwards (nothing else's randomness changes). A
resumed run therefore draws the masks of an uninterrupted one, and the tensor-parallel ranks of one replica draw
the same masks; a row-parallel adapter (its input split by columns) cuts its part from a mask of the whole width
(`keep_mask`), so every layout drops the same elements of the whole input.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from hf_mcore_bridge.megatron.lora_config import LoraConfig

__all__ = ["dropout_rng", "dropped", "keep_mask"]


@contextmanager
def dropout_rng(lora: LoraConfig | None, step: int, replica: int) -> Iterator[None]:
    """Inside: torch's RNG (CPU and the current CUDA device) seeded from (`lora.seed`, `step`, `replica`); restored on
    leaving. Nothing changes without LoRA or with dropout 0."""
    if lora is None or not lora.enabled or lora.dropout == 0:
        yield
        return
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(zlib.crc32(f"lora-dropout:{lora.seed}:{step}:{replica}".encode()))
        yield


def keep_mask(shape: tuple[int, ...], p: float, like: torch.Tensor) -> torch.Tensor:
    """A Bernoulli(1 - p) mask of `shape` (1: kept) in `like`'s dtype and device, from torch's RNG."""
    return torch.empty(shape, dtype=like.dtype, device=like.device).bernoulli_(1.0 - p)


def dropped(x: torch.Tensor, mask: torch.Tensor, p: float) -> torch.Tensor:
    """Inverted dropout of `x` with `mask`: kept elements scaled by 1 / (1 - p), as `nn.Dropout`."""
    return x * mask / (1.0 - p)
