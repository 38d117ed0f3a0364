"""The few patches megatron-core 0.16 needs to build, load and run a GPTModel on CPU (gloo). CUDA machines: none.

Applied only when CUDA is absent, idempotently, by `apply_cpu_workarounds()`:
- `torch.cuda.current_device()` is used for device placement (rotary frequencies, some buffers): it returns the
  CPU device instead.
- `torch.cuda.synchronize()` is called by the checkpoint writer: it becomes a no-op.
- `Tensor.cuda()` moves the shared embedding of tied models with PP > 1: it returns the tensor itself.
- The CUDA RNG tracker forks CUDA generator state in attention: megatron-core's own inference tracker (whose fork
  does nothing) is installed instead, so dropout is not supported on CPU.
- The MoE router refers to Transformer Engine's `te_general_gemm`, undefined when TE is absent: it is set to None,
  which megatron-core's own code treats as "use torch".
Callers must also pass an explicit attention mask: the default causal mask is built on `device="cuda"`.
"""

from __future__ import annotations

import torch

_applied = False


def apply_cpu_workarounds() -> bool:
    """Patch what megatron-core needs on a CPU-only machine. Returns whether patches are active."""
    global _applied
    if torch.cuda.is_available():
        return False
    if _applied:
        return True
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[assignment]
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    _applied = True
    return True
