"""Engine settings that a run's config names and checks before anything heavy loads: the decode attention kernels.

Standard library only (the package's `__init__` re-exports lazily), so that `grpo.run.config` validates
`generation.decode_attention` without importing torch.
"""

__all__ = ["DECODE_KERNELS"]

DECODE_KERNELS = ("triton", "flex", "gather")
"""Decode attention kernels (see `engine.attention`)."""
