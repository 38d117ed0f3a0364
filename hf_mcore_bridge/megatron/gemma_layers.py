"""What megatron-core 0.16 lacks of Gemma 3's decoder, put into its own layer specs (no fork): the `(1 + weight)`
RMSNorm under the local spec, the post-attention and post-feedforward norms, the sliding layers' own RoPE base, and
the embedding scale.

- `OffsetRMSNorm`: RMSNorm scaling by `1 + weight`, computed in float32 and rounded back as transformers' Gemma
  norm is (megatron-core's own description of it is `layernorm_zero_centered_gamma`, which Transformer Engine's
  norms compute and the local spec's `WrappedTorchNorm` refuses): every norm of the local spec (input, pre-MLP, q/k,
  final). Under the Transformer Engine spec the fused norms keep Transformer Engine's zero-centred gamma.
- Post-norms: `linear_proj` and `linear_fc2` (whatever class the spec names) are built as a subclass applying an
  `OffsetRMSNorm` (`post_layernorm`) to their output, after the tensor-parallel reduction and before the residual
  add; the checkpoint holds `linear_proj.post_layernorm.weight` and `linear_fc2.post_layernorm.weight`.
- The sliding layers' RoPE: `SlidingRopeSelfAttention` replaces, on the layers whose window is on (megatron-core's
  own `is_layer_window_attention`), the rotary table GPTModel hands every layer by one of the same length at the
  sliding layers' base; the windows themselves are `sdpa_attention`'s (megatron-core's `window_size`).
- The embedding scale: the first decoder layer (global layer number 1, whose input is the embedding's output) is
  built as a subclass that multiplies its input by sqrt(hidden_size) rounded to its dtype, before the residual
  branches off, as transformers scales the embeddings. Inside the layer spec, so any `GPTModel` built from it (the
  bridge API's `layer_spec` included) has it.

Weights are read and written under these names by the mapping table (`mappings/gemma3.py`). Assumes plain RoPE on
the sliding layers (conversion refuses any other) and no context parallelism (refused with windows).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

__all__ = ["OffsetRMSNorm", "ScalesEmbeddings", "SlidingRopeSelfAttention", "use_gemma_layers"]


class OffsetRMSNorm(torch.nn.Module):
    """`x * rsqrt(mean(x^2) + eps) * (1 + weight)` in float32, rounded to x's dtype; the weight (the offset from
    one) starts at zero and is marked for megatron-core's sequence-parallel gradient all-reduce where the config is
    sequence-parallel. Built with a megatron-core norm's arguments."""

    sequence_parallel_weight = True
    """Whether its input is a slice of the sequence under sequence parallelism (not for the per-head q/k norms)."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **unused: Any) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = self.sequence_parallel_weight and bool(config.sequence_parallel)  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.float()
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


class _HeadNorm(OffsetRMSNorm):
    """A per-head q/k norm: applied after the sequence is gathered (megatron-core sums its gradient over TP by
    name)."""

    sequence_parallel_weight = False


class _PostNormed:
    """Mixin: the linear layer's output through `post_layernorm` (megatron-core's linear layers return
    `(output, bias)`; Gemma's have no bias)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        config = kwargs["config"]
        self.post_layernorm = OffsetRMSNorm(config, config.hidden_size, eps=config.layernorm_epsilon)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        output, bias = super().forward(*args, **kwargs)  # type: ignore[misc]
        if bias is not None:
            raise ValueError("a post-normed linear layer takes no bias (Gemma's have none)")
        return self.post_layernorm(output), None


@functools.cache
def post_normed(base: type) -> type:
    """`base` (a linear layer class) with its output normed by `post_layernorm`; one class per base."""
    if issubclass(base, _PostNormed):
        return base
    return type(f"PostNormed{base.__name__}", (_PostNormed, base), {})


@functools.cache
def _sliding_rope_attention(base: type) -> type:
    """`base` (megatron-core's `SelfAttention`) with the sliding layers' own rotary table."""
    if issubclass(base, SlidingRopeSelfAttention):
        return base
    return type(f"SlidingRope{base.__name__}", (SlidingRopeSelfAttention, base), {})


class SlidingRopeSelfAttention:
    """Mixin over megatron-core's `SelfAttention`: on a layer whose window is on, RoPE at `sliding_rope_base`
    instead of the table GPTModel computes at the full layers' base (same positions, same length)."""

    def __init__(self, *args: Any, sliding_rope_base: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
        from megatron.core.transformer.utils import is_layer_window_attention

        config = self.config  # type: ignore[attr-defined]
        self.sliding_rotary: Any = None
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, self.layer_number):  # type: ignore[attr-defined]
            self.sliding_rotary = RotaryEmbedding(
                kv_channels=config.kv_channels,
                rotary_percent=1.0,
                rotary_base=sliding_rope_base,
                use_cpu_initialization=config.use_cpu_initialization,
                cp_group=self.pg_collection.cp,  # type: ignore[attr-defined]
            )

    def forward(self, *args: Any, rotary_pos_emb: Any = None, **kwargs: Any) -> Any:
        if self.sliding_rotary is not None and rotary_pos_emb is not None:
            if isinstance(rotary_pos_emb, tuple):
                raise ValueError("the sliding layers' RoPE takes one rotary table for queries and keys")
            packed = kwargs.get("packed_seq_params") is not None
            length = rotary_pos_emb.shape[0] * (1 if packed else self.pg_collection.cp.size())  # type: ignore[attr-defined]
            rotary_pos_emb = self.sliding_rotary(length, packed_seq=packed)
        return super().forward(*args, rotary_pos_emb=rotary_pos_emb, **kwargs)  # type: ignore[misc]


class ScalesEmbeddings:
    """Mixin over megatron-core's `TransformerLayer`: the first layer of the model multiplies its input (the
    embeddings) by `embedding_scale`, rounded to the input's dtype (transformers' `Gemma3TextScaledWordEmbedding`);
    every other layer is unchanged."""

    def __init__(self, *args: Any, embedding_scale: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.embedding_scale: float | None = embedding_scale if self.layer_number == 1 else None  # type: ignore[attr-defined]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.embedding_scale is not None:
            if "hidden_states" in kwargs:
                kwargs["hidden_states"] = self._scaled(kwargs["hidden_states"])
            else:
                args = (self._scaled(args[0]), *args[1:])
        return super().forward(*args, **kwargs)  # type: ignore[misc]

    def _scaled(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden * torch.tensor(self.embedding_scale, dtype=hidden.dtype, device=hidden.device)


@functools.cache
def _embedding_scaled_layer(base: type) -> type:
    """`base` (a megatron-core transformer layer class) scaling the model's embeddings in its first layer."""
    if issubclass(base, ScalesEmbeddings):
        return base
    return type(f"ScalesEmbeddings{base.__name__}", (ScalesEmbeddings, base), {})


def _is_plain_norm(module: Any) -> bool:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from hf_mcore_bridge.megatron.sequence_parallel_norm import SequenceParallelRMSNorm, _QKNorm

    return module in (WrappedTorchNorm, SequenceParallelRMSNorm, _QKNorm)


def use_gemma_layers(block_spec: Any, model: Any) -> Any:
    """Put `model`'s (a `ModelSpec`) offset norms, post-norms, sliding-layer RoPE and embedding scale into a
    megatron-core block spec (`TransformerBlockSubmodules`); what the model lacks is left as it is."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if model.norm_offset and _is_plain_norm(block_spec.layer_norm):
        block_spec.layer_norm = OffsetRMSNorm
    for layer in block_spec.layer_specs:
        sub = layer.submodules
        attention = sub.self_attention
        if model.norm_offset:
            for name in ("input_layernorm", "pre_mlp_layernorm"):
                if _is_plain_norm(getattr(sub, name, None)):
                    setattr(sub, name, OffsetRMSNorm)
            for name in ("q_layernorm", "k_layernorm"):
                if _is_plain_norm(getattr(attention.submodules, name, None)):
                    setattr(attention.submodules, name, _HeadNorm)
        if model.post_norms:
            attention.submodules.linear_proj = post_normed(attention.submodules.linear_proj)
            sub.mlp.submodules.linear_fc2 = post_normed(sub.mlp.submodules.linear_fc2)
        if model.sliding_rope is not None and isinstance(attention, ModuleSpec):
            attention.module = _sliding_rope_attention(attention.module)
            attention.params = {**attention.params, "sliding_rope_base": model.sliding_rope.theta}
        if model.embedding_scale:
            layer.module = _embedding_scaled_layer(layer.module)
            layer.params = {**layer.params, "embedding_scale": math.sqrt(model.hidden_size)}
    return block_spec
