"""The lower bound on one decode step's time set by an H200's memory bandwidth and compute, for a decoder-only model.

A decode step runs one token of each of `rows` sequences through the model. It reads every weight of the matrix
products once (per layer q, k, v, o and the gated MLP's gate, up and down, plus the output layer; an embedding
lookup reads only the rows it needs and is not counted) and each sequence's cached keys and values (`context`
tokens x layers x 2 x KV heads x head_dim). Its FLOPs are 2 per multiply-add: 2 x matmul weights per token, plus
attention's two products over the context (2 x 2 x heads x head_dim x context per token and layer). The step
cannot be faster than the larger of bytes / bandwidth and FLOPs / compute; the measured step over that bound is how
far from the hardware's limit it runs. Assumes: weights and cache in the same dtype, norms and activations
negligible (a few MB against GBs), no weight sharing across layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

H200_BYTES_PER_S = 4.3e12
"""Memory bandwidth of one H200 taken for the bound (its HBM3e, as achieved by a large device-to-device copy)."""
H200_FLOPS = 790e12
"""bf16 matrix-multiply rate of one H200 taken for the bound (below the 989e12 dense peak: what large GEMMs reach)."""


@dataclass(frozen=True)
class StepBound:
    """One decode step's bytes and FLOPs and the time they need at the H200's limits."""

    weight_bytes: float
    kv_bytes: float
    flops: float

    @property
    def limit_s(self) -> float:
        """max(bytes / bandwidth, FLOPs / compute)."""
        return max((self.weight_bytes + self.kv_bytes) / H200_BYTES_PER_S, self.flops / H200_FLOPS)

    @property
    def bound(self) -> str:
        """Which limit binds: "memory" or "compute"."""
        memory = (self.weight_bytes + self.kv_bytes) / H200_BYTES_PER_S
        return "memory" if memory >= self.flops / H200_FLOPS else "compute"


def _dims(config: Any) -> tuple[int, int, int, int, int, int, int]:
    """layers, hidden, heads, KV heads, head_dim, FFN width, vocabulary of a transformers Llama-style config."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return (
        config.num_hidden_layers,
        config.hidden_size,
        heads,
        kv_heads,
        head_dim,
        config.intermediate_size,
        config.vocab_size,
    )


def matmul_weights(config: Any) -> int:
    """Weights a token's matrix products read: attention and gated MLP per layer, and the output layer."""
    layers, hidden, heads, kv_heads, head_dim, ffn, vocab = _dims(config)
    attention = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
    return layers * (attention + 3 * hidden * ffn) + vocab * hidden


def decode_step_bound(config: Any, rows: int, context: int, bytes_per_element: int = 2) -> StepBound:
    """The bound of one decode step at `rows` sequences of `context` cached tokens each (the new one included)."""
    layers, _, heads, kv_heads, head_dim, _, _ = _dims(config)
    weights = matmul_weights(config)
    kv = rows * context * layers * 2 * kv_heads * head_dim
    flops = rows * (2.0 * weights + 4.0 * layers * heads * head_dim * context)
    return StepBound(float(weights * bytes_per_element), float(kv * bytes_per_element), flops)
