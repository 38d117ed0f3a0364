"""Embedded vLLM-style inference engine: paged KV cache, continuous batching, vLLM `load_weights` contract.

`Engine` generates with the built-in decoder (Llama, Mistral, Qwen2, Qwen3, and the mixture-of-experts Mixtral,
Qwen2-MoE, Qwen3-MoE, GLM-4.5 and DeepSeek-V3); `VllmEngine` offers the same interface over vLLM where vLLM is
installed. Modules: `arch` (the model's description as the engine reads it, `read_spec`, and which engine parameter each
entry of the architecture's table fills), `model` (the decoder and its weight loader), `layers` (its norm and linear
layers), `fused_moe` (the fast MoE path: tokens sorted by expert on the device, grouped GEMMs; `expert_sort` the sort),
`attention` (paged attention through torch SDPA), `mla` (multi-latent attention over a cache of latents; `triton_mla`
its GPU decode kernel), `kv_cache` (block allocator), `scheduler` (continuous batching), `sampling` (sampling and
log-probabilities), `cuda_graphs` (graphs of the decode step), `engine` (`Engine`), `tp_shards` (which slice of each HF
tensor a tensor-parallel rank keeps), `tp_group` (the tensor-parallel collectives over a given process group),
`vllm_backend` (`VllmEngine`), `options` (the settings a run's config checks without torch). The engine imports nothing
from `convert` or megatron-core.

The names below are re-exported lazily (PEP 562): importing a torch-free module of the package (`options`, `arch`)
does not load the engine and torch with it.
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "ARCHITECTURES": "arch",
    "read_spec": "arch",
    "Engine": "engine",
    "EngineAsleepError": "engine",
    "EngineConfig": "engine",
    "EngineStats": "engine",
    "RequestOutput": "engine",
    "SampleOutput": "engine",
    "iter_safetensors": "engine",
    "MissingWeightsError": "model",
    "UnknownWeightError": "model",
    "SamplingParams": "sampling",
    "VllmEngine": "vllm_backend",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
