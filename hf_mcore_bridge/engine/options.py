"""Engine settings that a run's config names and checks before anything heavy loads: the decode attention kernels,
the mixture-of-experts kernels and their sort by expert.

Standard library only (the package's `__init__` re-exports lazily), so that `grpo.run.config` validates
`generation.decode_attention` without importing torch.
"""

__all__ = ["DECODE_KERNELS", "MOE_KERNELS", "MOE_SORTS"]

DECODE_KERNELS = ("triton", "flex", "gather")
"""Decode attention kernels (see `engine.attention`)."""

MOE_KERNELS = ("exact", "triton", "grouped_mm")
"""Routed-expert kernels: the exact per-expert loop (`model.routed_experts`), or the sorted grouped GEMM through
Triton or `torch._grouped_mm` (`engine.fused_moe`)."""

MOE_SORTS = ("torch", "triton")
"""How the fast MoE paths sort the (token, expert) pairs by expert (`engine.expert_sort`): about fifteen small torch
kernels, or one Triton kernel (the engine's `auto` on CUDA where Triton is installed)."""
