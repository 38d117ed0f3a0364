"""`Engine`: generate completions with the embedded decoder, a paged KV cache and continuous batching.

One `generate` call runs to completion: it tokenises the prompts (when given text), queues each prompt as a
group of n samples, and loops scheduler step -> model step -> sampling until every sample has finished. Decode
steps are pipelined: step t+1 is scheduled and queued on the device before step t's tokens reach the host (its
input tokens are taken on the device), so the host's bookkeeping overlaps the device's work (`_decode`). Prefill
steps run eagerly; on CUDA the decode step of a dense model replays a CUDA graph captured for its shape bucket,
and decode attention reads the paged KV blocks in place through a Triton kernel (`triton_decode`; compiled
FlexAttention without Triton, `attention`); the
decoder's pointwise steps and the sampler are compiled there too (`pointwise`, `sampling.Sampler`).
A mixture-of-experts model's decode step is captured too where its experts run through the fast path
(`fused_moe`: tokens sorted by expert and a grouped GEMM, all on the device; `EngineConfig.moe_kernel`, the choice
on CUDA); with the exact per-expert loop, which sizes each expert's batch on the host (`model.routed_experts`, the
choice on CPU), it decodes eagerly. A multi-latent-attention model (DeepSeek-V3) caches each
token's compressed latent, not its keys and values, and decodes through the absorbed projections (`mla.py`): on
CUDA through a Triton kernel reading the latent blocks in place (`triton_mla`), elsewhere in torch over the gathered
blocks; FlexAttention reads no latent cache, nor is an FP8 cache or tensor parallelism implemented for it.

A hybrid model (Qwen3.5) keeps, beside the KV cache of its attention layers, a state cache of its Gated DeltaNet
layers (`state_cache.StateCache`: a slot per running sequence, plus a scratch slot for padded decode rows, taken
from the KV-cache budget): the scheduler hands slots out and back, a prefill names each group's slot
(`gated_delta.prefill_batch`) and then copies the prompt's states to its other samples, and a decode step packs
each row's slot beside its other inputs (`cuda_graphs.pack`), so its CUDA graphs read them like the rest.

Weights come from an HF directory of safetensors, or only from `load_weights` (a refit from a trainer). The
cache and the weights can be released for a colocated trainer with `sleep` and restored with `wake_up`.

Tensor parallelism: given a process group (`tp_group`), every rank runs this same engine on its shard of the
model (`model.py`) and of the KV cache (its KV heads). Scheduling, block tables and sampling are host-side and
deterministic, and every rank sees the same full logits and draws the same counter-based numbers (the seed of an
unseeded request comes from the group's first rank), so all ranks take the same steps and sample the same tokens
with no further communication: continuous batching, preemption, prefix sharing, sleep/wake and `load_weights` work
as on one device. The collectives are ordinary `torch.distributed` calls, so on NCCL they can be captured in the
decode CUDA graphs (not tested: no multi-GPU test here).

A caller can take each sample the moment its tokens are final (`generate(..., on_sample=...)`), e.g. to score
it while the others are still generating; the call still returns every output at the end.

With `EngineConfig.record_routing` a mixture-of-experts model's passes also write each token's chosen experts per
MoE layer into a fixed buffer (`CausalLM.record_routing`), copied per pass in stream order and kept per sequence by
position (a token's first recording wins), so every sample comes back with the experts of every token it ran
(`SampleOutput.routed_experts`, for the trainer's routing replay).

Simplifications: one `generate` call at a time (no asynchronous request stream); no chunked prefill (a prompt
is prefilled in one step, so `max_num_batched_tokens >= max_model_len`); no prefix caching across prompts, only
sharing within the n samples of one prompt (for a hybrid model cross-prompt prefix caching would also need the linear
layers' states at the prefix's end); a preempted sequence is recomputed, never swapped out.
"""

from __future__ import annotations

import math
import os
import weakref
from collections.abc import Callable, Iterable, Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from hf_mcore_bridge.engine.arch import read_spec
from hf_mcore_bridge.engine.attention import (
    FP8_CACHE_DTYPE,
    DecodeMetadata,
    PrefillMetadata,
    allocate_kv_cache,
    bytes_per_token,
    copy_blocks,
)
from hf_mcore_bridge.engine.cuda_graphs import DecodeBatch, DecodeGraphs, batch_bucket, pack, unpack
from hf_mcore_bridge.engine.fused_moe import check_usable as moe_check
from hf_mcore_bridge.engine.fused_moe import grouped_mm_available
from hf_mcore_bridge.engine.gated_delta import prefill_batch
from hf_mcore_bridge.engine.kv_cache import BlockAllocator, blocks_for
from hf_mcore_bridge.engine.model import CausalLM, MissingWeightsError
from hf_mcore_bridge.engine.options import DECODE_KERNELS, MOE_KERNELS, MOE_SORTS
from hf_mcore_bridge.engine.pointwise import EAGER_OPS, compiled_ops
from hf_mcore_bridge.engine.sampling import Sampler, SamplingBatch, SamplingParams, counter_uniforms, stream_key
from hf_mcore_bridge.engine.scheduler import (
    DecodeStep,
    Group,
    PrefillStep,
    Scheduler,
    SchedulerStats,
    Sequence,
)
from hf_mcore_bridge.engine.state_cache import SlotAllocator, StateCache, state_bytes_per_sequence
from hf_mcore_bridge.engine.tp_group import TensorParallel
from hf_mcore_bridge.engine.triton_decode import available as triton_available
from hf_mcore_bridge.engine.triton_decode import check_usable as triton_check
from hf_mcore_bridge.engine.triton_decode import supports as triton_supports
from hf_mcore_bridge.engine.triton_mla import check_usable as mla_check
from hf_mcore_bridge.models.registry import wrapper_for
from hf_mcore_bridge.models.spec import SLIDING_ATTENTION
from hf_mcore_bridge.models.vision_language import VisionLanguage, any_text_name

KV_CACHE_DTYPES = ("auto", "fp8")
"""Values of `EngineConfig.kv_cache_dtype`."""


class EngineAsleepError(RuntimeError):
    """The engine was put to sleep; call `wake_up()` first."""


class Tokenizer(Protocol):
    """What the engine needs of a tokenizer (a `tokenizers.Tokenizer` or a transformers tokenizer)."""

    def encode(self, text: str) -> Any: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True)
class EngineConfig:
    """Resources and limits of an `Engine`."""

    dtype: torch.dtype = torch.bfloat16
    """Dtype of weights, activations and the KV cache."""
    device: str = "cuda"
    """Torch device string, e.g. `cuda`, `cuda:1`, `cpu`."""
    max_num_seqs: int = 256
    """Sequences decoded together at most (each of the n samples of a prompt counts)."""
    max_model_len: int = 4096
    """Prompt plus generated tokens of one sequence, at most."""
    kv_cache_memory_bytes: int = 4 << 30
    """Memory budget of the paged KV cache; sets the number of blocks (per rank under tensor parallelism, where a
    rank's blocks hold only its KV heads). A hybrid model's Gated DeltaNet states (`max_num_seqs + 1` slots of
    `EngineStats.state_bytes_per_sequence`) come out of it first."""
    block_size: int = 32
    """Tokens per KV-cache block. FlexAttention's decode visits a sequence's blocks one at a time, and on an H200
    32-token blocks decoded faster than 16-token ones (`docs/PERFORMANCE.md`); the price is coarser prefix sharing
    (a prompt's partly filled last block is copied per sample)."""
    max_num_batched_tokens: int = 8192
    """Prompt tokens prefilled in one step, at most (must be >= max_model_len: no chunked prefill)."""
    use_cuda_graphs: bool = True
    """Replay CUDA graphs of the decode step (CUDA devices; a MoE model only with a sync-free `moe_kernel`, not
    `exact`, which decodes eagerly)."""
    graph_block_step: int = 4
    """CUDA-graph buckets of the block-table width are multiples of this many blocks."""
    decode_attention: str = "auto"
    """Decode attention kernel: `triton` (one Triton kernel reads each sequence's KV blocks in place; CUDA),
    `flex` (FlexAttention over the blocks; compiled on CUDA, once per batch bucket), `gather` (the blocks are
    gathered, then SDPA; any device), or `auto`: `triton` on CUDA where Triton is installed, else `flex` on CUDA,
    `gather` elsewhere (eager FlexAttention scores every cache slot, and Triton runs on CPU tensors only in its
    interpreter: both exact, for tests only). Multi-latent attention takes `triton` (its own kernel, `triton_mla`)
    or `gather`, and refuses `flex` (FlexAttention reads no latent cache); so does a model with sliding windows or
    attention sinks (GPT-OSS), where `auto` takes `gather` in place of `flex`."""
    flex_min_batch: int = 64
    """With the `flex` kernel, decode steps of fewer sequences (after rounding up to a CUDA-graph batch bucket) use
    `gather`: their attention is a small share of the step, and FlexAttention is compiled once per batch bucket it
    runs at, so this bounds the compilations to the large buckets."""

    fp8_weights: bool = False
    """Multiply by per-block FP8 (e4m3, 128 x 128 blocks) copies of the attention and dense MLP weights
    (`engine.fp8`), requantized from the held weights at the start of every `generate` (so after every load or
    refit); the weights themselves, the KV cache and the other layers stay in `dtype`."""
    kv_cache_dtype: str = "auto"
    """`auto`: the KV cache holds keys and values in `dtype`; `fp8`: in float8_e4m3fn, each the value over
    `kv_cache_scale` (`attention.to_cache`), so a block takes half the bytes of bf16 (twice the blocks for the same
    `kv_cache_memory_bytes`) and decode attention reads half as many. Prefill attends over the unrounded keys and
    values; decode reads the rounded ones. Needs `decode_attention` triton or gather (FlexAttention does not read
    FP8)."""
    kv_cache_scale: float = 1.0
    """Per-tensor scale of an FP8 KV cache (`kv_cache_dtype: fp8`), one for keys and values of every layer: an
    entry holds value / scale, rounded to e4m3 (3 mantissa bits) and clamped to +-448. 1.0 is vLLM's default
    without calibrated scales: keys and values of magnitude 2^-6 to 448 keep a relative error of at most 2^-4."""
    fused_rope: bool = False
    """With the Triton decode kernel, rotate q and k and write k and v into the cache in one Triton kernel a layer
    (`triton_rope`) instead of the compiled rotary kernel and two cache copies (models without per-head q/k
    norms). Off by default: its GPU tests pass on the H200 (`tests/engine/test_engine_gpu.py`), but it has not been
    timed against the default there."""
    fused_sampler: bool | None = False
    """Sample untruncated batches (no top-k / top-p) with one Triton kernel that reads the logits once
    (`triton_sampling`) instead of the compiled torch sampler; None: on CUDA devices where Triton is installed.
    Off by default although faster on the H200 (121 against 171 us for [512, 128256] logits, tokens equal on every
    row; `docs/PERFORMANCE.md`): it has been timed on one shape only."""
    moe_kernel: str = "auto"
    """The routed experts of a mixture-of-experts model: `exact` (the per-expert loop, `model.routed_experts`: a
    host sync per layer, so no CUDA graphs), `triton` (tokens sorted by expert on the device, then a Triton grouped
    GEMM: `fused_moe.fused_experts`), `grouped_mm` (the same sort, then `torch._grouped_mm`; bf16 on CUDA), or
    `auto`: `triton` on CUDA where Triton is installed, else `grouped_mm` on CUDA in bf16 where torch has it,
    else `exact` (and `exact` on CPU, where Triton runs only in its interpreter, for tests)."""
    moe_sort: str = "auto"
    """How `triton` and `grouped_mm` sort the (token, expert) pairs by expert (`expert_sort.sort_experts`; `exact`
    ignores it): `torch` (about fifteen small torch kernels a MoE layer), `triton` (one Triton kernel launch a layer
    for batches of up to 4096 pairs, above that the torch sort; CUDA, or CPU in Triton's interpreter), or `auto`:
    `triton` on CUDA where Triton is installed, else `torch`. On one H200 the Triton sort took Qwen3-30B-A3B's
    full-depth decode step from 21.48 to 17.99 ms (one MoE layer's experts at 64 rows: 0.448 -> 0.311 ms;
    `docs/PERFORMANCE.md`)."""
    record_routing: bool = False
    """Record, for every token a mixture-of-experts model runs (prompt and generated, all but each sample's last
    token, which is never an input), the expert ids each MoE layer chose, and return them with the samples
    (`SampleOutput.routed_experts`): rollout routing replay, where the trainer routes each token to the same
    experts. One `[moe_layers, tokens, k]` copy per pass into a fixed device buffer (captured in decode graphs),
    moved to the host with the pass's tokens."""
    torch_compile: bool | None = None
    """Run the decoder's pointwise steps (`pointwise.py`) and the sampler's reductions through `torch.compile`
    (fused kernels; the sampler reads the logits without writing [B, V] intermediates); None: on CUDA devices.
    Each falls back to eager, with a warning, if its compilation fails. The first steps after start-up compile."""

    lora_rank: int = 0
    """LoRA adapters of this rank applied by the engine's linears (`engine.lora`), loaded under PEFT's names like
    weights; 0: none."""
    lora_scale: float = 1.0
    """The adapters' product is scaled by this (PEFT's alpha / rank)."""
    lora_targets: tuple[str, ...] = ()
    """The HF projections that carry adapters (`q_proj`, `k_proj`, `v_proj`, `o_proj`, `gate_proj`, `up_proj`,
    `down_proj`)."""

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}): a prompt is prefilled in one step"
            )
        if self.max_num_seqs < 1 or self.block_size < 1 or self.max_model_len < 2:
            raise ValueError("max_num_seqs, block_size must be >= 1 and max_model_len >= 2")
        if self.decode_attention not in ("auto", *DECODE_KERNELS):
            kernels = ", ".join(("auto", *DECODE_KERNELS))
            raise ValueError(f"decode_attention must be one of {kernels}, got {self.decode_attention!r}")
        if self.flex_min_batch < 1:
            raise ValueError(f"flex_min_batch must be >= 1, got {self.flex_min_batch}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if not (self.kv_cache_scale > 0 and math.isfinite(self.kv_cache_scale)):
            raise ValueError(f"kv_cache_scale must be a positive finite number, got {self.kv_cache_scale}")
        if self.moe_kernel not in ("auto", *MOE_KERNELS):
            raise ValueError(f"moe_kernel must be one of {', '.join(('auto', *MOE_KERNELS))}, got {self.moe_kernel!r}")
        if self.moe_sort not in ("auto", *MOE_SORTS):
            raise ValueError(f"moe_sort must be one of {', '.join(('auto', *MOE_SORTS))}, got {self.moe_sort!r}")

    def cache_dtype(self) -> torch.dtype:
        """The dtype the KV cache is allocated in (`kv_cache_dtype`)."""
        return FP8_CACHE_DTYPE if self.kv_cache_dtype == "fp8" else self.dtype

    def compiled(self) -> bool:
        """Whether `torch_compile` resolves to compiled steps on this config's device."""
        if self.torch_compile is not None:
            return self.torch_compile
        return torch.device(self.device).type == "cuda"

    def resolved_moe_kernel(self) -> str:
        """The routed-expert kernel `moe_kernel` resolves to on this config's device and dtype."""
        if self.moe_kernel != "auto":
            return self.moe_kernel
        if torch.device(self.device).type != "cuda":
            return "exact"
        if triton_available():
            return "triton"
        return "grouped_mm" if grouped_mm_available() and self.dtype == torch.bfloat16 else "exact"

    def resolved_moe_sort(self) -> str:
        """The sort by expert `moe_sort` resolves to on this config's device (`auto`: `triton` on CUDA where Triton
        is installed, else `torch`)."""
        if self.moe_sort != "auto":
            return self.moe_sort
        return "triton" if torch.device(self.device).type == "cuda" and triton_available() else "torch"

    def decode_kernel(self, head_dim: int | None = None, latent: bool = False) -> str:
        """The decode attention kernel `decode_attention` resolves to on this config's device (for a model of
        `head_dim`, when given: `auto` takes `flex` where the Triton kernel does not support it). A multi-latent
        model (`latent`) decodes through `triton` (`triton_mla`; `auto` on CUDA where Triton is installed) or
        `gather`: FlexAttention reads no latent cache (`mla.py`)."""
        if latent:
            if self.decode_attention == "flex":
                raise ValueError(
                    "decode_attention='flex': multi-latent attention decodes through triton (its latent kernel) or "
                    "gather (torch over the gathered latent blocks); use auto, triton or gather"
                )
            if self.decode_attention != "auto":
                return self.decode_attention
            cuda = torch.device(self.device).type == "cuda"
            return "triton" if cuda and triton_available() else "gather"
        if self.decode_attention != "auto":
            return self.decode_attention
        if torch.device(self.device).type != "cuda":
            return "gather"
        if triton_available() and (head_dim is None or triton_supports(head_dim)):
            return "triton"
        return "flex"


@dataclass(frozen=True)
class SampleOutput:
    """One completion of a prompt."""

    index: int
    """Sample index within its prompt (0..n-1)."""
    token_ids: list[int]
    """Generated tokens; a stop token that ended generation is included."""
    text: str | None
    """The decoded tokens, when the engine has a tokenizer."""
    finish_reason: str
    """`stop` (a stop token was sampled) or `length` (max_tokens or max_model_len reached)."""
    logprobs: list[float] | None
    """Per generated token: log_softmax(logits / temperature) of the sampled token, BEFORE top-k / top-p
    truncation (temperature 1 for greedy); None when not requested."""
    routed_experts: torch.Tensor | None = None
    """With `EngineConfig.record_routing`: `[moe_layers, prompt + generated - 1, k]` (uint8, int16 above 256
    experts; host), the experts each MoE layer chose for every token the engine ran, in position order (the
    prompt's, then every generated token but the last); a token's first recording is kept (a preempted sequence's
    recompute does not replace it). None otherwise."""


@dataclass(frozen=True)
class RequestOutput:
    """The completions of one prompt."""

    prompt_token_ids: list[int]
    samples: list[SampleOutput]


@dataclass
class EngineStats(SchedulerStats):
    """Scheduler counters of the last `generate` call, plus cache facts."""

    blocks_allocated: int = 0
    """Fresh blocks handed out during the call (forks of shared blocks are not counted)."""
    num_blocks: int = 0
    """Blocks in the cache, the scratch block included."""
    pipelined_steps: int = 0
    """Decode steps launched before the previous step's tokens reached the host."""
    discarded_tokens: int = 0
    """Tokens computed for sequences that had already sampled a stop token (the price of pipelining)."""
    kv_bytes_per_token: int = 0
    """KV-cache bytes one token takes over all layers (this rank's, under tensor parallelism): grouped-query
    attention 2 * layers * kv_heads * head_dim * itemsize; multi-latent attention layers * (kv_lora_rank +
    qk_rope_head_dim) * itemsize (`attention.bytes_per_token`); of a hybrid model, its attention layers only."""
    state_bytes_per_sequence: int = 0
    """A hybrid model's Gated DeltaNet states of one sequence over all its linear layers, conv windows and float32
    recurrent states (this rank's; `state_cache.state_bytes_per_sequence`); 0 for other models."""


def iter_safetensors(directory: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every tensor of every `*.safetensors` file in `directory`."""
    from safetensors import safe_open

    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {directory}")
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                yield name, handle.get_tensor(name)


PENDING_TOKEN = -1
"""Placeholder in a sequence's tokens for a sampled token not yet on the host."""


@dataclass
class _Launched:
    """A decode step queued on the device, its tokens on their way to the host."""

    sequences: list[Sequence]
    tokens: torch.Tensor
    """[B] int64 on the device: the next step's input tokens."""
    host: torch.Tensor
    """[2, B] float64 on the host (tokens, log-probs), valid once `event` has completed."""
    event: torch.cuda.Event | None
    indices: list[int]
    """Where each sequence's token goes in its `token_ids`."""
    dropped: set[int] = field(default_factory=set)
    """ids of sequences that stopped at the step before: their result here is discarded."""
    routing: torch.Tensor | None = None
    """With routing recorded: `[moe_layers, B, k]` on the device, the step's expert ids (a copy: the next step
    overwrites the buffer)."""
    positions: list[int] = field(default_factory=list)
    """Each sequence's input position in this step."""


@dataclass
class _Finished:
    """The samples of the `generate` call in progress whose tokens are final, by `id` of their sequence."""

    on_sample: Callable[[int, SampleOutput], None] | None
    first_index: int
    outputs: dict[int, SampleOutput] = field(default_factory=dict)


def _record_routing(seq: Sequence, chunk: torch.Tensor, start: int) -> None:
    """Keep the expert ids `chunk` `[moe_layers, n, k]` of `seq`'s tokens at positions `start...` that it has no
    recording of yet (a preempted sequence's recompute covers positions it has)."""
    if start > seq.routed:
        raise RuntimeError(f"routing of position {start} recorded before that of position {seq.routed}")
    new = chunk[:, seq.routed - start :]
    if new.shape[1]:
        seq.routing.append(new)
        seq.routed += new.shape[1]


def _routed_experts(seq: Sequence) -> torch.Tensor:
    """`seq`'s recorded expert ids `[moe_layers, tokens - 1, k]`: every token but the last (never an input)."""
    inputs = len(seq.token_ids) - 1
    if seq.routed < inputs:
        raise RuntimeError(f"routing recorded for {seq.routed} of the {inputs} tokens a sample ran")
    return torch.cat(seq.routing, dim=1)[:, :inputs].clone()


def _finish_reason(seq: Sequence) -> str | None:
    """Why `seq` ends after its latest token (a stop token, or its length), setting it; None if it goes on."""
    if seq.token_ids[-1] in seq.params.stop_token_ids:
        seq.finish_reason = "stop"
    elif len(seq.token_ids) >= seq.max_len:
        seq.finish_reason = "length"
    return seq.finish_reason


def _text_weights(
    wrapper: VisionLanguage, weights: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """A vision-language class's tensors: the language model's by their text names, the rest left out."""
    for name, tensor in weights:
        text = any_text_name(wrapper, name)
        if text is not None:
            yield text, tensor


def _weakly(method: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`method` (a bound method) called through a weak reference to its object."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> torch.Tensor:
        bound = ref()
        if bound is None:
            raise RuntimeError("the engine of this decode-graph runner has been released")
        return bound(*args)

    return call


class Engine:
    """An embedded vLLM-style engine for the decoders of `mappings/` (Llama, Mistral, Qwen2, Qwen3, Gemma 3, Mixtral,
    Qwen2-MoE, Qwen3-MoE, GLM-4.5, GPT-OSS, DeepSeek-V3 with multi-latent attention, and the hybrid Gated DeltaNet
    models Qwen3.5, Qwen3.5 MoE and Qwen3-Next).

    Args:
        hf_config: a transformers `PretrainedConfig` or a config.json dict.
        config: resources and limits.
        weights_dir: an HF directory of safetensors to load; None leaves the weights to `load_weights`.
        tokenizer: needed only for text prompts and for the `text` of outputs.
        tp_group: the tensor-parallel process group this engine is one rank of (NCCL on GPU, gloo on CPU; e.g.
            megatron-core's `parallel_state.get_tensor_model_parallel_group()`), or None. Every rank of the group
            builds its engine with the same arguments and makes the same calls (`generate` with the same prompts
            and parameters, `load_weights` with the same full tensors, `sleep`, `wake_up`); each holds its heads,
            widths, vocabulary rows and KV heads, and all ranks return the same tokens. None or a group of one
            rank: the single-device engine, without any collective. `kv_cache_memory_bytes` is per rank.
    """

    def __init__(
        self,
        hf_config: Any,
        config: EngineConfig | None = None,
        weights_dir: str | Path | None = None,
        tokenizer: Tokenizer | None = None,
        tp_group: torch.distributed.ProcessGroup | None = None,
    ) -> None:
        self.config = config or EngineConfig()
        self.model_config = read_spec(hf_config)
        self._wrapper = wrapper_for(hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config))
        self.tp = TensorParallel.of(tp_group)
        self.tokenizer = tokenizer
        self.device = torch.device(self.config.device)
        cfg, mc = self.config, self.model_config
        kernel = cfg.decode_kernel(mc.head_dim, latent=mc.mla is not None)
        windowed = mc.sliding_window is not None and SLIDING_ATTENTION in mc.layer_types
        if mc.sliding_window is not None and not windowed and cfg.max_model_len > mc.sliding_window:
            raise NotImplementedError(
                f"a sliding window (window {mc.sliding_window}) over layers that layer_types does not mark "
                f"sliding_attention is not implemented; use max_model_len <= {mc.sliding_window}"
            )
        if kernel == "flex" and (windowed or mc.attention_sinks) and cfg.decode_attention == "auto":
            kernel = "gather"  # the Triton kernel does not take this head_dim, FlexAttention no window or sink
        if kernel == "flex" and (windowed or mc.attention_sinks):
            raise ValueError(
                f"{mc.architecture}: decode_attention='flex' implements no sliding window or attention sinks; use "
                "triton or gather"
            )
        if mc.mla is not None and cfg.kv_cache_dtype == "fp8":
            raise NotImplementedError("kv_cache_dtype fp8 is not implemented for multi-latent attention")
        if kernel == "triton" and mc.mla is not None:
            mla_check(self.device, cfg.block_size)
        elif kernel == "triton":
            triton_check(self.device, mc.head_dim, cfg.block_size)
        if cfg.kv_cache_dtype == "fp8" and kernel == "flex":
            raise ValueError("kv_cache_dtype fp8 needs decode_attention triton or gather (FlexAttention reads no FP8)")
        moe_kernel = cfg.resolved_moe_kernel() if mc.moe is not None else "exact"
        if moe_kernel != "exact":
            moe_check(moe_kernel, self.device, cfg.dtype, cfg.resolved_moe_sort())
        self.model = CausalLM(
            mc,
            cfg.dtype,
            self.device,
            max_positions=cfg.max_model_len,
            decode_kernel=kernel,
            flex_min_batch=cfg.flex_min_batch,
            ops=compiled_ops() if cfg.compiled() else EAGER_OPS,
            tp=self.tp,
            moe_kernel=moe_kernel,
            moe_sort=cfg.resolved_moe_sort(),
        )
        if cfg.lora_rank:  # before any graph is captured: the decode graphs read the adapters in place
            from hf_mcore_bridge.engine.lora import add_adapters

            add_adapters(self.model, cfg.lora_targets, cfg.lora_rank, cfg.lora_scale)
        self.model.kv_scale = cfg.kv_cache_scale if cfg.kv_cache_dtype == "fp8" else 1.0
        self.model.fused_rope = cfg.fused_rope
        self.cache_entry = self.model.cache_entry
        """(planes, heads, width) of a token's entry in a layer's cache (`CausalLM.cache_entry`)."""
        planes, heads, width = self.cache_entry
        self.num_kv_heads = heads
        """KV heads in this rank's cache (all of the model's without tensor parallelism; 1 for multi-latent)."""
        self.kv_bytes_per_token = bytes_per_token(
            self.model.num_kv_layers, self.num_kv_heads, width, cfg.cache_dtype(), planes
        )
        """KV-cache bytes of one token over all attention layers (`EngineStats.kv_bytes_per_token`)."""
        self.state_shape = self.model.state_shape(cfg.dtype)
        """A hybrid model's per-sequence Gated DeltaNet states on this rank; None for other models."""
        self.state_bytes_per_sequence = 0 if self.state_shape is None else state_bytes_per_sequence(self.state_shape)
        # the scratch slot besides one per sequence; taken from the KV budget before the blocks are counted
        state_bytes = (cfg.max_num_seqs + 1) * self.state_bytes_per_sequence
        block_bytes = cfg.block_size * self.kv_bytes_per_token
        self.max_blocks_per_seq = blocks_for(cfg.max_model_len, cfg.block_size)
        need = (self.max_blocks_per_seq + 2) * block_bytes
        if state_bytes and cfg.kv_cache_memory_bytes - state_bytes < need:
            raise ValueError(
                f"kv_cache_memory_bytes={cfg.kv_cache_memory_bytes} leaves {cfg.kv_cache_memory_bytes - state_bytes} "
                f"bytes after the Gated DeltaNet states ({cfg.max_num_seqs + 1} slots x "
                f"{self.state_bytes_per_sequence} = {state_bytes} bytes); one sequence of max_model_len needs "
                f"{self.max_blocks_per_seq} blocks plus 2 (>= {need} bytes)"
            )
        self.num_blocks = (cfg.kv_cache_memory_bytes - state_bytes) // block_bytes
        if self.num_blocks < self.max_blocks_per_seq + 2:
            raise ValueError(
                f"kv_cache_memory_bytes={cfg.kv_cache_memory_bytes} gives {self.num_blocks} blocks; one "
                f"sequence of max_model_len needs {self.max_blocks_per_seq} plus 2 (>= {need} bytes)"
            )
        self.kv_cache: torch.Tensor | None = self._allocate_cache()
        # before any decode graph is captured, which reads and writes these tensors in place
        self.states: StateCache | None = self._allocate_states()
        # Compiled FlexAttention specialises on shapes: its steps run with full-width block tables and bucketed
        # rows, so that it compiles once per batch bucket rather than per (batch, table width).
        flex_rows = cfg.flex_min_batch if kernel == "flex" and self.device.type == "cuda" else None
        self._flex_rows = flex_rows
        fused = cfg.fused_sampler
        if fused is None:
            fused = self.device.type == "cuda" and triton_available()
        self._sampler = Sampler(compile=cfg.compiled(), fused=fused)
        self._routing: torch.Tensor | None = None
        """The buffer every pass writes its expert ids to (`CausalLM.record_routing`), with `record_routing`."""
        if cfg.record_routing:  # before any decode graph is captured: the graphs write into it
            self._routing = self.model.record_routing(max(cfg.max_num_batched_tokens, cfg.max_num_seqs))
        # the exact expert loop sizes each expert's rows on the host: not capturable
        capturable = mc.moe is None or moe_kernel != "exact"
        self._graphs = (
            self._decode_graphs() if cfg.use_cuda_graphs and self.device.type == "cuda" and capturable else None
        )
        self._sleep_level = 0
        self.last_stats: EngineStats | None = None
        # two pinned buffers for the tokens of the (at most two) decode steps in flight
        self._host_buffers = [
            torch.empty(2 * cfg.max_num_seqs, dtype=torch.float64, pin_memory=self.device.type == "cuda")
            for _ in range(2)
        ]
        self._host_slot = 0
        self._pipeline_counts = {"pipelined_steps": 0, "discarded_tokens": 0}
        self._finished = _Finished(None, 0)
        if weights_dir is not None:
            self.load_weights(iter_safetensors(weights_dir))

    @classmethod
    def from_pretrained(
        cls,
        directory: str | Path,
        config: EngineConfig | None = None,
        tokenizer: Tokenizer | None = None,
        tp_group: torch.distributed.ProcessGroup | None = None,
    ) -> Engine:
        """An engine from an HF model directory (config.json plus safetensors); `tp_group` as for `Engine`."""
        import json

        hf_config = json.loads((Path(directory) / "config.json").read_text())
        return cls(hf_config, config, weights_dir=directory, tokenizer=tokenizer, tp_group=tp_group)

    # Weights ---------------------------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], parts: bool = False) -> set[str]:
        """Copies HF-named, full (unsharded) tensors into the engine, in any order and any number of calls.
        `parts`: under tensor parallelism, a tensor of the shape of this rank's part is taken to be that part
        (a trainer's own shard, in HF terms: a refit with no all-gather) and copied as it is.

        q/k/v projections fill slices of the fused `qkv_proj`, gate/up fill `gate_up_proj`, and each expert's
        tensors (HF's per-expert names, as saved on the Hub, or a transformers-5 model's fused in-memory
        `mlp.experts.gate_up_proj` / `down_proj`, so `hf_model.named_parameters()` loads as it is) fill its slice of
        the stacked `experts.gate_up_proj` / `down_proj`; a tied `lm_head` is skipped. Unknown names raise
        `UnknownWeightError`. Returns the HF names loaded by this call. Allowed while awake or asleep at level 1;
        after `sleep(level=2)`, call `wake_up()` first, then reload every weight. Of a vision-language class
        (`models.vision_language`), the language model's tensors load under the checkpoint's or transformers'
        names and the vision tower's and projector's are skipped.
        """
        if self._sleep_level == 2:
            raise EngineAsleepError("weights were released by sleep(level=2); call wake_up() before load_weights")
        if self._wrapper is not None:
            weights = _text_weights(self._wrapper, weights)
        return self.model.load_weights(weights, parts)

    def check_loaded(self) -> None:
        """Raises `MissingWeightsError` naming every weight not loaded yet (also checked by `generate`)."""
        try:
            self.model.check_loaded()
        except MissingWeightsError as err:
            raise MissingWeightsError(
                f"{err} (weights are loaded from weights_dir or through load_weights; after sleep(level=2) "
                "every weight must be reloaded)"
            ) from None

    def _decode_graphs(self) -> DecodeGraphs:
        """The decode step's CUDA-graph runner. It calls the engine through a weak reference, so the two form no
        cycle: dropping the engine frees its weights, cache and graphs at once, not at the garbage collector's next
        pass."""
        return DecodeGraphs(
            _weakly(self._decode_forward),
            self.device,
            self.config.max_num_seqs,
            self.max_blocks_per_seq,
            self.config.graph_block_step,
            full_width_rows=self._flex_rows,
            linear=self.state_shape is not None,
        )

    @property
    def num_cuda_graphs(self) -> int:
        """Decode-step CUDA graphs captured so far (0 off CUDA, for MoE models on the exact expert path or with
        `use_cuda_graphs=False`)."""
        return self._graphs.num_captured if self._graphs is not None else 0

    # Sleep ------------------------------------------------------------------------------------------------------

    @property
    def is_sleeping(self) -> bool:
        return self._sleep_level > 0

    def sleep(self, level: int = 1) -> None:
        """Releases device memory for a colocated trainer: level 1 the KV cache, level 2 the weights as well.

        After level 2, `wake_up()` allocates empty weights that must be refilled through `load_weights` before
        `generate`. `generate` raises `EngineAsleepError` while asleep.
        """
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if self._graphs is not None:
            self._graphs.clear()
        self.kv_cache = None
        self.states = None
        if level == 2:
            self.model.release_weights()
        self._sleep_level = max(self._sleep_level, level)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake_up(self) -> None:
        """Re-allocates what `sleep` released (weights come back empty after level 2: reload them)."""
        if self._sleep_level == 2:
            self.model.allocate_weights()
        if self.kv_cache is None:
            self.kv_cache = self._allocate_cache()
        if self.states is None:
            self.states = self._allocate_states()
        self._sleep_level = 0

    # Generation -------------------------------------------------------------------------------------------------

    def generate(
        self,
        prompts: Seq[str] | Seq[Seq[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        first_index: int = 0,
        on_sample: Callable[[int, SampleOutput], None] | None = None,
    ) -> list[RequestOutput]:
        """Completes each prompt (text, with a tokenizer, or token ids); one `RequestOutput` per prompt, in order.

        `params` is one `SamplingParams` for all prompts or one per prompt. `first_index`: the prompts' place in a
        larger batch split over several engines: prompt i draws the random numbers of prompt `first_index + i` of
        that batch (a seeded request's samples depend on its seed and that index, not on how the batch is split).
        Each sample's `logprobs` are those of
        its sampled tokens under log_softmax(logits / temperature), taken BEFORE top-k / top-p truncation.
        `on_sample(i, sample)` is called once per sample, during the call, as soon as its tokens are final (in the
        order samples finish), with its prompt's position `i` in `prompts` and the `SampleOutput` the result will
        hold for it; an exception it raises ends the call.
        """
        if self._sleep_level:
            raise EngineAsleepError(f"the engine is asleep (level {self._sleep_level}); call wake_up() first")
        self.check_loaded()
        if self.config.fp8_weights:  # from the weights held now: a refit may have replaced them in place
            self.model.quantize_fp8()
        prompt_ids = [self._encode(p) for p in prompts]
        per_prompt = self._params_per_prompt(params, len(prompt_ids))
        allocator = BlockAllocator(self.num_blocks)
        if self.states is not None:  # every slot free at the start of a call, also after one that raised
            self.states.slots = SlotAllocator(self.states.slots.num_slots)
        scheduler = Scheduler(
            allocator,
            self.config.block_size,
            self.config.max_num_seqs,
            self.config.max_num_batched_tokens,
            self.max_blocks_per_seq,
            self.states,
        )
        seeds = self._seeds(per_prompt)
        groups = [
            self._make_group(first_index + i, ids, p, seed)
            for i, (ids, p, seed) in enumerate(zip(prompt_ids, per_prompt, seeds, strict=True))
        ]
        for group in groups:
            scheduler.add(group)
        self._pipeline_counts = {"pipelined_steps": 0, "discarded_tokens": 0}
        self._finished = _Finished(on_sample, first_index)
        try:
            with torch.inference_mode():
                while scheduler.has_work():
                    step = scheduler.schedule()
                    if isinstance(step, PrefillStep):
                        self._prefill(scheduler, step)
                    else:
                        self._decode(scheduler, step)
            for group in groups:  # every sample once, also any a step did not hand over
                self._report(group.sequences)
            outputs = self._finished.outputs
        finally:
            self._finished = _Finished(None, 0)
        self.last_stats = EngineStats(
            **vars(scheduler.stats),
            blocks_allocated=allocator.total_allocations,
            num_blocks=self.num_blocks,
            kv_bytes_per_token=self.kv_bytes_per_token,
            state_bytes_per_sequence=self.state_bytes_per_sequence,
            **self._pipeline_counts,
        )
        return [
            RequestOutput(prompt_token_ids=ids, samples=[outputs[id(seq)] for seq in group.sequences])
            for ids, group in zip(prompt_ids, groups, strict=True)
        ]

    def _params_per_prompt(
        self, params: SamplingParams | Seq[SamplingParams] | None, count: int
    ) -> list[SamplingParams]:
        if params is None:
            params = SamplingParams()
        per_prompt = [params] * count if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != count:
            raise ValueError(f"{len(per_prompt)} SamplingParams for {count} prompts")
        for p in per_prompt:
            if p.n > self.config.max_num_seqs:
                raise ValueError(f"n={p.n} exceeds max_num_seqs={self.config.max_num_seqs}")
        return per_prompt

    def _encode(self, prompt: str | Seq[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer (Engine(..., tokenizer=...))")
            encoded = self.tokenizer.encode(prompt)
            ids = list(getattr(encoded, "ids", encoded))
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("empty prompt")
        if len(ids) >= self.config.max_model_len:
            raise ValueError(f"prompt of {len(ids)} tokens leaves no room within max_model_len")
        vocab = self.model_config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        return ids

    def _seeds(self, per_prompt: list[SamplingParams]) -> list[int]:
        """Each prompt's seed: its own, or a fresh random one (the first tensor-parallel rank's, on every rank, so
        that all ranks draw the same numbers: one broadcast per call that has unseeded prompts)."""
        fresh = [int.from_bytes(os.urandom(8), "little") >> 1 for p in per_prompt if p.seed is None]
        if self.tp is not None and fresh:
            fresh = self.tp.broadcast_seeds(fresh, self.device)  # 63-bit values: exact in int64
        drawn = iter(fresh)
        return [p.seed if p.seed is not None else next(drawn) for p in per_prompt]

    def _make_group(self, index: int, ids: list[int], params: SamplingParams, seed: int) -> Group:
        return Group(
            [
                Sequence(
                    request_index=index,
                    sample_index=s,
                    rng_key=stream_key(seed, (index << 16) | s),
                    prompt_len=len(ids),
                    token_ids=list(ids),
                    params=params,
                    max_len=min(len(ids) + params.max_tokens, self.config.max_model_len),
                )
                for s in range(params.n)
            ]
        )

    def _prefill(self, scheduler: Scheduler, step: PrefillStep) -> None:
        """One prefill step: each admitted group's prefix once, then the first token of each of its sequences."""
        logits = self._run_prefill(step)
        if self._routing is not None:
            routing = self._routing[:, : len(step.input_ids)].to("cpu", copy=True)  # a copy also on a CPU engine
            start = 0
            for group, length in zip(step.groups, step.seq_lens, strict=True):
                for seq in group.sequences:  # the prefix is shared: one chunk for all its samples
                    _record_routing(seq, routing[:, start : start + length], 0)
                start += length
        sequences = [seq for group in step.groups for seq in group.sequences]
        group_of_row = [g for g, group in enumerate(step.groups) for _ in group.sequences]
        logits = logits.index_select(0, self._to_device(group_of_row))
        tokens, logprobs = self._sampler(logits, self._sampling_batch(sequences))
        # One device-to-host transfer for both (token ids are exact in float64).
        token_list, logprob_list = torch.stack([tokens.double(), logprobs.double()]).tolist()
        finished = []
        for seq, token, logprob in zip(sequences, token_list, logprob_list, strict=True):
            seq.token_ids.append(int(token))
            seq.logprobs.append(logprob)
            if _finish_reason(seq) is not None:
                finished.append(seq)
        scheduler.finish(finished)
        self._report(finished)

    def _decode(self, scheduler: Scheduler, step: DecodeStep) -> None:
        """Decode steps, pipelined: step t+1 is scheduled and launched before step t's tokens reach the host, so
        the host's bookkeeping overlaps the device's work.

        Step t+1 is known before t's tokens are: every sequence that does not reach its length at t decodes again,
        its input token taken on the device from t's samples. A sequence that samples a stop token at t has then
        run one step too many: its step-(t+1) result is dropped (its KV write lands in blocks it has released,
        which later steps only reuse after it, in stream order). The pipeline stops, and the caller's loop
        schedules as usual, when groups wait to be admitted or the next step could need a preemption.
        """
        launched = self._launch_decode(step, None)
        while True:
            ending = [seq for seq in launched.sequences if len(seq.token_ids) >= seq.max_len]
            for seq in ending:
                seq.finish_reason = "length"
            scheduler.finish(ending)
            following = None
            staying = len(scheduler.running)
            if staying and not scheduler.waiting and scheduler.allocator.num_free >= staying:
                next_step = scheduler.schedule()
                assert isinstance(next_step, DecodeStep)
                following = self._launch_decode(next_step, launched)
                self._pipeline_counts["pipelined_steps"] += 1
            self._resolve(scheduler, launched, following)
            if following is None:
                return
            launched = following

    def _launch_decode(self, step: DecodeStep, previous: _Launched | None) -> _Launched:
        """Queue one decode step and its sampling on the device (inputs from `previous`'s samples when given) and
        the copy of its tokens to the host; reserve each sequence's token slot."""
        device_ids = None
        if previous is not None:
            row_of = {id(seq): row for row, seq in enumerate(previous.sequences)}
            rows = [row_of[id(seq)] for seq in step.sequences]
            device_ids = previous.tokens
            if rows != list(range(len(previous.sequences))):
                device_ids = device_ids.index_select(0, self._to_device(rows))
        logits = self._run_decode(step, device_ids)
        # queued behind this step's forward and before the next one's, which reuses the buffer
        routing = None if self._routing is None else self._routing[:, : len(step.sequences)].clone()
        tokens, logprobs = self._sampler(logits, self._sampling_batch(step.sequences))
        both = torch.stack([tokens.double(), logprobs.double()])  # token ids are exact in float64
        event = None
        if both.is_cuda:
            self._host_slot ^= 1
            host = self._host_buffers[self._host_slot][: both.numel()].view(both.shape)  # contiguous, pinned
            host.copy_(both, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host = both
        indices = []
        for seq in step.sequences:
            indices.append(len(seq.token_ids))
            seq.token_ids.append(PENDING_TOKEN)
            seq.logprobs.append(0.0)
        return _Launched(step.sequences, tokens, host, event, indices, routing=routing, positions=step.positions)

    def _resolve(self, scheduler: Scheduler, launched: _Launched, following: _Launched | None) -> None:
        """Fill in `launched`'s tokens once on the host; end the sequences that sampled a stop token (dropping
        their result in `following`, already queued)."""
        if launched.event is not None:
            launched.event.synchronize()
        token_list, logprob_list = launched.host.tolist()
        if launched.routing is not None:
            routing = launched.routing.cpu()
            for row, (seq, position) in enumerate(zip(launched.sequences, launched.positions, strict=True)):
                if id(seq) not in launched.dropped:
                    _record_routing(seq, routing[:, row : row + 1], position)
        stopped = []
        for seq, index, token, logprob in zip(
            launched.sequences, launched.indices, token_list, logprob_list, strict=True
        ):
            if id(seq) in launched.dropped:
                continue
            seq.token_ids[index] = int(token)
            seq.logprobs[index - seq.prompt_len] = logprob
            if int(token) in seq.params.stop_token_ids:
                if seq.finish_reason is None:
                    stopped.append(seq)
                seq.finish_reason = "stop"  # also where it reached its length with this token
        if following is not None and stopped:
            queued = {id(seq) for seq in following.sequences}
            for seq in stopped:
                if id(seq) in queued:
                    del seq.token_ids[-1], seq.logprobs[-1]
                    following.dropped.add(id(seq))
                    self._pipeline_counts["discarded_tokens"] += 1
        scheduler.finish(stopped)
        # final now: those that stopped here and those that reached their length with this step's token
        self._report([seq for seq in launched.sequences if seq.finish_reason is not None])

    def _sampling_batch(self, sequences: list[Sequence]) -> SamplingBatch:
        first = sequences[0].params
        # One SamplingParams shared by the whole batch (the usual case) is broadcast rather than listed per row.
        shared = all(seq.params is first for seq in sequences)
        params = [first] if shared else [seq.params for seq in sequences]
        rows = len(sequences)

        def column(values: list[float] | list[int], dtype: torch.dtype) -> torch.Tensor:
            column = torch.tensor(values, dtype=dtype)
            return (column.expand(rows) if len(values) == 1 else column).to(self.device, non_blocking=True)

        uniforms = counter_uniforms(
            np.array([seq.rng_key for seq in sequences], dtype=np.uint64),
            np.array([len(seq.token_ids) - seq.prompt_len for seq in sequences], dtype=np.uint64),
        )
        return SamplingBatch(
            temperature=column([p.temperature for p in params], torch.float32),
            top_k=column([p.top_k for p in params], torch.int64),
            top_p=column([p.top_p for p in params], torch.float32),
            uniforms=torch.from_numpy(uniforms).to(self.device, non_blocking=True),
            any_random=any(p.temperature > 0 for p in params),
            any_greedy=any(p.temperature == 0 for p in params),
            any_truncation=any(p.temperature > 0 and (p.top_k > 0 or p.top_p < 1) for p in params),
            any_scaled=any(p.temperature not in (0.0, 1.0) for p in params),
        )

    def _run_prefill(self, step: PrefillStep) -> torch.Tensor:
        """Logits [groups, vocab] at the last token of each group's prefix."""
        assert self.kv_cache is not None
        lens = torch.tensor(step.seq_lens, dtype=torch.int64)
        max_len = int(lens.max())
        starts = torch.cumsum(lens, 0) - lens
        batch = len(step.seq_lens)
        pad_index = torch.cat([b * max_len + torch.arange(n) for b, n in enumerate(step.seq_lens)])
        meta = PrefillMetadata(
            slot_mapping=self._to_device(step.slots),
            pad_index=pad_index.to(self.device, non_blocking=True),
            key_valid=(torch.arange(max_len)[None, :] < lens[:, None]).to(self.device, non_blocking=True),
            batch_size=batch,
            max_len=max_len,
        )
        if self.states is not None:  # each group's prefix runs once, in its first sequence's state slot
            slots = [group.sequences[0].state_slot for group in step.groups]
            linear = prefill_batch(step.seq_lens, slots, self.states.shape.conv_kernel, self.device)
            meta = replace(meta, linear=linear)
        ids = self._to_device(step.input_ids)
        positions = self._to_device(step.positions)
        last_rows = (starts + lens - 1).to(self.device, non_blocking=True)
        logits = self.model(ids, positions, self.kv_cache, meta, logits_rows=last_rows, states=self.states)
        if self.states is not None:  # the other samples of a prompt start from its states (a copy: see scheduler)
            for group in step.groups:
                first, *others = group.sequences
                if others:
                    self.states.copy(first.state_slot, [seq.state_slot for seq in others])
        return logits

    def _run_decode(self, step: DecodeStep, device_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, vocab] for every running sequence's next token (input tokens from `device_ids` [B] when
        given, else from the step)."""
        assert self.kv_cache is not None
        if step.copies:
            src, dst = zip(*step.copies, strict=True)
            copy_blocks(self.kv_cache, self._to_device(list(src)), self._to_device(list(dst)))
        batch = DecodeBatch(
            step.input_ids, step.positions, step.slots, step.context_lens, step.block_tables, step.state_slots
        )
        if self._graphs is not None:
            return self._graphs.run(batch, device_ids)
        real = rows = len(step.input_ids)
        n_blocks = step.block_tables.shape[1]
        bucket = batch_bucket(real, self.config.max_num_seqs)
        if self._flex_rows is not None and bucket >= self._flex_rows:
            rows, n_blocks = bucket, self.max_blocks_per_seq
        packed = pack(batch, rows, n_blocks).to(self.device, non_blocking=True)
        ids, positions, meta = unpack(packed, rows, n_blocks, linear=self.states is not None)
        if device_ids is not None:
            ids[:real].copy_(device_ids)
        return self._decode_forward(ids, positions, meta)[:real]

    def _to_device(self, values: list[int]) -> torch.Tensor:
        """An int64 device tensor; the copy does not wait for queued device work (the host list is pageable, so
        it is staged before the call returns)."""
        return torch.tensor(values, dtype=torch.int64).to(self.device, non_blocking=True)

    def _decode_forward(self, ids: torch.Tensor, positions: torch.Tensor, meta: DecodeMetadata) -> torch.Tensor:
        assert self.kv_cache is not None
        return self.model(ids, positions, self.kv_cache, meta, states=self.states)

    def _report(self, sequences: list[Sequence]) -> None:
        """The output of each finished sequence (its tokens final), made once; handed to `on_sample` if given."""
        finished = self._finished
        for seq in sequences:
            if id(seq) in finished.outputs:
                continue
            generated = seq.token_ids[seq.prompt_len :]
            output = finished.outputs[id(seq)] = SampleOutput(
                index=seq.sample_index,
                token_ids=generated,
                text=self.tokenizer.decode(generated) if self.tokenizer is not None else None,
                finish_reason=seq.finish_reason or "length",
                logprobs=list(seq.logprobs) if seq.params.logprobs else None,
                routed_experts=_routed_experts(seq) if self._routing is not None else None,
            )
            if finished.on_sample is not None:
                finished.on_sample(seq.request_index - finished.first_index, output)

    def _allocate_cache(self) -> torch.Tensor:
        cfg = self.config
        planes, heads, width = self.cache_entry
        return allocate_kv_cache(
            self.model.num_kv_layers,
            self.num_blocks,
            cfg.block_size,
            heads,
            width,
            cfg.cache_dtype(),
            self.device,
            planes,
        )

    def _allocate_states(self) -> StateCache | None:
        """A hybrid model's zeroed state cache: a slot per sequence plus the scratch one; None for other models."""
        if self.state_shape is None:
            return None
        return StateCache(self.state_shape, self.config.max_num_seqs + 1, self.device)
