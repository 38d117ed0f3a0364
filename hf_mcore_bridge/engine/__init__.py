"""Embedded vLLM-style inference engine: paged KV cache, continuous batching, vLLM `load_weights` contract.

`Engine` generates with the built-in decoder (Llama, Mistral, Qwen2, Qwen3, and the mixture-of-experts Mixtral,
Qwen2-MoE, Qwen3-MoE, GLM-4.5 and DeepSeek-V3); `VllmEngine` offers the same interface over vLLM where vLLM is
installed. Modules: `arch` (the model's description as the engine reads it, `read_spec`, and which engine
parameter each entry of the architecture's table fills), `model` (the decoder and its weight loader), `layers`
(its norm and linear layers), `attention` (paged attention through torch SDPA), `mla` (multi-latent attention over
a cache of latents), `kv_cache` (block allocator), `scheduler` (continuous batching), `sampling` (sampling and
log-probabilities), `cuda_graphs` (graphs of the decode step), `engine` (`Engine`), `tp_shards` (which slice of
each HF tensor a tensor-parallel rank keeps), `tp_group` (the tensor-parallel collectives over a given process
group), `vllm_backend` (`VllmEngine`). The engine imports nothing from `convert` or megatron-core.
"""

from hf_mcore_bridge.engine.arch import ARCHITECTURES, read_spec
from hf_mcore_bridge.engine.engine import (
    Engine,
    EngineAsleepError,
    EngineConfig,
    EngineStats,
    RequestOutput,
    SampleOutput,
    iter_safetensors,
)
from hf_mcore_bridge.engine.model import MissingWeightsError, UnknownWeightError
from hf_mcore_bridge.engine.sampling import SamplingParams
from hf_mcore_bridge.engine.vllm_backend import VllmEngine

__all__ = [
    "ARCHITECTURES",
    "Engine",
    "EngineAsleepError",
    "EngineConfig",
    "EngineStats",
    "MissingWeightsError",
    "RequestOutput",
    "SampleOutput",
    "SamplingParams",
    "UnknownWeightError",
    "VllmEngine",
    "iter_safetensors",
    "read_spec",
]
