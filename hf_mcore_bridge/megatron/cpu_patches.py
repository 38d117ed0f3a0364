"""The few patches megatron-core 0.16 needs to build, load and run a GPTModel on CPU (gloo). CUDA machines: none.

Applied only when CUDA is absent, idempotently, by `apply_cpu_workarounds()`:
- `torch.cuda.current_device()` is used for device placement (rotary frequencies, some buffers): it returns the
  CPU device instead.
- `torch.cuda.synchronize()` is called by the checkpoint writer: it becomes a no-op.
- `Tensor.cuda()` moves the shared embedding of tied models with PP > 1: it returns the tensor itself.
- The CUDA RNG tracker forks CUDA generator state in attention: megatron-core's own inference tracker (whose fork
  does nothing) is installed instead, so dropout is not supported on CPU.
- Context parallelism: RoPE's `get_pos_emb_on_this_cp_rank` builds its chunk index in pinned memory, which needs
  an accelerator: inside `rope_utils`, `pin_memory` is dropped from tensor factories (as in the training modules
  below).
- MoE's all-to-all token dispatcher (megatron-core's choice for variable sequence lengths, hence under PP) makes a
  CUDA stream for its device-to-host copies of the token counts, and waits on it: inside `token_dispatcher`,
  `torch.cuda`'s streams and events are stand-ins that do nothing (on the CPU those copies are no copies).
Callers must also pass an explicit attention mask: the default causal mask is built on `device="cuda"`.

`apply_te_absent_workarounds()` is applied wherever Transformer Engine is missing, GPU or not:
- The MoE router refers to Transformer Engine's `te_general_gemm`, undefined when TE is absent: it is set to None,
  which megatron-core's own code treats as "use torch".
- Multi-latent attention believes TE is there whenever `megatron.core.extensions.transformer_engine` imports (it
  does, with stand-ins for TE's classes) and then calls `isinstance` with a stand-in: its `HAVE_TE` is set to
  False.

`apply_foreach_multi_tensor_ops()` (training, GPU or not): where neither Transformer Engine nor Apex is installed,
megatron-core's gradient norm and multi-tensor scale fall back to `megatron.core.utils.local_multi_tensor_l2_norm`
(a norm per tensor, then `torch.tensor` of their list: one host synchronisation per tensor) and
`local_multi_tensor_scale` (two kernels per tensor); they become torch's multi-tensor kernels (`_foreach_norm`
accumulating in float32, `_foreach_mul`), with no host synchronisation. On one H200, before this, the 1B shape's
LoRA training step made 674 host synchronisations against full training's 422 and kept the device busy 40 % of the
step (LoRA has two parameter tensors per adapted projection; on CPU a traced step shows the norm's per-tensor
synchronisations growing with them).

`apply_fla_absent_workarounds()` is applied wherever flash-linear-attention (`fla`, CUDA/Triton kernels) is missing,
GPU or not: megatron-core's `GatedDeltaNet` (Qwen3-Next's and Qwen3.5's linear attention) refuses to build without
it and then calls its `l2norm` and `chunk_gated_delta_rule`. They become torch: `l2norm` as fla and transformers
compute it (`x * rsqrt(sum(x^2) + 1e-6)` over the last dimension) and megatron-core's own
`torch_chunk_gated_delta_rule` (written for its deterministic mode, after transformers' torch implementation).
Without `causal_conv1d` megatron-core already runs its `nn.Conv1d` (padded, cut to the sequence). Packed sequences
are megatron-core's refusal (`NotImplementedError`), left as it is.

Training (pipeline schedules, DDP, `get_megatron_optimizer`, gradient clipping) needs more, applied by
`apply_cpu_training_workarounds()` (it imports megatron-core's optimizer, so it is separate and opt-in):
- The schedules, the optimizer, the grad-clipping module and `megatron.core.utils` (its torch fallback of
  `multi_tensor_l2norm`) create small tensors with `device="cuda"` (token counts, found-inf flags, norms):
  inside those four modules only, `torch.zeros/ones/tensor/empty` map a CUDA
  device to the CPU.
- `clip_grad_by_total_norm_fp32` asserts `param.grad.type() == 'torch.cuda.FloatTensor'`: it is replaced by
  the same scaling (`grad *= max_norm / (total_norm + 1e-6)` when that factor is below 1) without the check.
- The mixed-precision optimizer (bf16/fp16 parameters with fp32 master copies) sorts parameters by their CUDA type
  names (`param.type() == 'torch.cuda.BFloat16Tensor'`): while it is built (`cuda_type_names()`), a CPU tensor's
  `type()` reads as the CUDA type of its dtype.
Not covered: the distributed optimizer's CUDA tensor-type check (use `use_distributed_optimizer=False` on CPU).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from types import ModuleType
from typing import Any

import torch

_applied = False
_training_applied = False


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
    from megatron.core.models.common.embeddings import rope_utils

    rope_utils.torch = _CpuTensorFactories(torch)  # type: ignore[attr-defined]
    from megatron.core.transformer.moe import token_dispatcher

    token_dispatcher.torch = _NoCudaStreams(torch)  # type: ignore[attr-defined]
    _applied = True
    return True


class _NoStream:
    """A CUDA stream and event that do nothing: work on the CPU is already in order."""

    def wait_stream(self, stream: object) -> None:
        pass

    def record_event(self) -> _NoStream:
        return self

    def synchronize(self) -> None:
        pass


class _NoCudaStreamsModule:
    """`torch.cuda` with `Stream()`, `current_stream()` (one and the same stream) and `stream(...)` that do nothing;
    everything else is torch's."""

    _STREAM = _NoStream()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    def Stream(self, *args: Any, **kwargs: Any) -> _NoStream:
        return self._STREAM

    def current_stream(self, *args: Any, **kwargs: Any) -> _NoStream:
        return self._STREAM

    def stream(self, stream: object) -> AbstractContextManager[None]:
        return nullcontext()


class _NoCudaStreams:
    """Stands in for the `torch` module inside a megatron-core module: `torch.cuda`'s streams do nothing."""

    def __init__(self, real: ModuleType) -> None:
        self._real = real
        self.cuda = _NoCudaStreamsModule()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class _CpuTensorFactories:
    """Stands in for the `torch` module inside a megatron-core module: CUDA devices in factories become CPU, and
    factories ask for no pinned memory."""

    _FACTORIES = ("zeros", "ones", "tensor", "empty", "full")

    def __init__(self, real: ModuleType) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._real, name)
        if name not in self._FACTORIES:
            return attr

        def factory(*args: Any, **kwargs: Any) -> torch.Tensor:
            device = kwargs.get("device")
            if device is not None and torch.device(device).type == "cuda":
                kwargs["device"] = "cpu"
            kwargs.pop("pin_memory", None)  # pinned host memory needs an accelerator
            return attr(*args, **kwargs)

        return factory


def _clip_grad_by_total_norm_fp32(
    parameters: Any, max_norm: float, total_norm: float, use_decoupled_grad: bool = False
) -> None:
    params = [parameters] if isinstance(parameters, torch.Tensor) else parameters
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr) for p in params if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        for grad in grads:
            grad.detach().mul_(clip_coeff)


def apply_cpu_training_workarounds() -> bool:
    """Patch what megatron-core's schedules and optimizer need on CPU (see the module docstring)."""
    global _training_applied
    if not apply_cpu_workarounds():
        return False
    if _training_applied:
        return True
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core.pipeline_parallel import schedules

    for module in (schedules, clip_grads, optimizer, utils):
        module.torch = _CpuTensorFactories(torch)  # type: ignore[attr-defined]
    clip_grads.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32
    optimizer.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32
    _training_applied = True
    return True


@contextmanager
def cuda_type_names() -> Iterator[None]:
    """On CPU, while the body runs, `Tensor.type()` (no arguments) of a CPU tensor names the CUDA tensor type of its
    dtype (`torch.cuda.BFloat16Tensor`), so megatron-core's optimizer sorts CPU parameters as it sorts CUDA ones.
    Nothing on CUDA machines."""
    if torch.cuda.is_available():
        yield
        return
    real = torch.Tensor.type

    def type_name(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        name = real(self, *args, **kwargs)
        if args or kwargs or self.device.type != "cpu":
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = type_name  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.Tensor.type = real  # type: ignore[method-assign]


def apply_te_absent_workarounds() -> None:
    """Define what megatron-core's MoE code references from Transformer Engine when TE is not installed."""
    from megatron.core.extensions import transformer_engine
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    if not transformer_engine.HAVE_TE:
        multi_latent_attention.HAVE_TE = False


def foreach_l2_norm(
    chunk_size: int, noop_flag: Any, tensor_lists: list[list[torch.Tensor]], per_tensor: bool, *args: Any
) -> tuple[torch.Tensor, None]:
    """`amp_C.multi_tensor_l2norm`'s contract as megatron-core's clipping calls it (no per-tensor norms): the L2 norm
    of every tensor of `tensor_lists` together, as a one-element float32 tensor on their device, with no host
    synchronisation."""
    tensors = [t for group in tensor_lists for t in group]
    if not tensors:
        return torch.zeros(1), None
    norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None


def foreach_scale(chunk_size: int, noop_flag: Any, tensor_lists: list[list[torch.Tensor]], scale: float) -> None:
    """`amp_C.multi_tensor_scale`'s contract: `tensor_lists[1][i] = tensor_lists[0][i] * scale`, in multi-tensor
    kernels (in place where the two lists are the same tensors)."""
    sources, targets = tensor_lists
    if all(s is t for s, t in zip(sources, targets, strict=True)):
        torch._foreach_mul_(targets, scale)
    else:
        torch._foreach_copy_(targets, torch._foreach_mul(sources, scale))


def apply_foreach_multi_tensor_ops() -> bool:
    """Replace megatron-core's local fallbacks of `multi_tensor_l2norm` and `multi_tensor_scale` (neither Transformer
    Engine nor Apex installed) by `foreach_l2_norm` and `foreach_scale` (see the module docstring); idempotent.
    Returns whether the fallbacks are (now) replaced."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = foreach_l2_norm
    for module in (clip_grads, optimizer):
        if getattr(module, "multi_tensor_scale_impl", None) is utils.local_multi_tensor_scale:
            module.multi_tensor_scale_impl = foreach_scale
    return clip_grads.l2_norm_impl is foreach_l2_norm


def torch_l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """fla's `l2norm` in torch: `x * rsqrt(sum(x^2) + eps)` over `dim`, computed in x's dtype (transformers'
    `l2norm` of its Gated DeltaNet models)."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def apply_fla_absent_workarounds() -> bool:
    """Give megatron-core's `GatedDeltaNet` torch kernels where flash-linear-attention is not installed (see the
    module docstring). Returns whether they are in use."""
    from megatron.core.ssm import gated_delta_net

    if gated_delta_net.HAVE_FLA and gated_delta_net.chunk_gated_delta_rule is not None:
        return gated_delta_net.chunk_gated_delta_rule is gated_delta_net.torch_chunk_gated_delta_rule
    gated_delta_net.l2norm = torch_l2norm  # type: ignore[attr-defined]
    gated_delta_net.chunk_gated_delta_rule = gated_delta_net.torch_chunk_gated_delta_rule
    gated_delta_net.HAVE_FLA = True
    return True
