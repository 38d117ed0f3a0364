"""An RMSNorm that megatron-core's local layer spec can use under sequence parallelism.

Without Transformer Engine or Apex, megatron-core's local spec builds its norms with `WrappedTorchNorm`, which
refuses `sequence_parallel=True` — and megatron-core refuses to TRAIN a mixture-of-experts layer under tensor
parallelism without sequence parallelism. Under sequence parallelism each TP rank normalises its own slice of
the sequence, so a norm weight's gradient is a partial sum; megatron-core's `finalize_model_grads` all-reduces
over TP the gradient of every parameter marked `sequence_parallel = True` (the mark Transformer Engine's norms
carry), and those of `q_layernorm` / `k_layernorm` by name. `SequenceParallelRMSNorm` is `torch.nn.RMSNorm` with
that mark, built like `WrappedTorchNorm` (same arguments, same parameter), so checkpoints are unchanged.

Multi-latent attention's latent norms (`q_layernorm`, `kv_layernorm` of `MLASelfAttention`) are sequence-parallel
norms too: megatron-core's `get_query_key_value_tensors` hands them the latents of this rank's slice of the sequence
(`[s / TP, b, rank]`, scattered back after the down-projections), so they carry the mark. (`kv_layernorm`'s name is
not one that megatron-core matches; `q_layernorm`'s is, and a parameter is summed once whichever rule picks it.)

Assumes RMSNorm (every architecture of `mappings/`); zero-centred gamma and the other fused-norm options are
refused as `WrappedTorchNorm` refuses them.
"""

from __future__ import annotations

import torch

__all__ = ["SequenceParallelRMSNorm", "use_sequence_parallel_norms"]


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """`torch.nn.RMSNorm` whose weight is marked for megatron-core's sequence-parallel gradient all-reduce."""

    def __init__(
        self,
        config: object,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "RMSNorm",
    ) -> None:
        if getattr(config, "normalization", "RMSNorm") != "RMSNorm" or config.layernorm_zero_centered_gamma:  # type: ignore[attr-defined]
            raise ValueError("SequenceParallelRMSNorm is an RMSNorm without zero-centred gamma")
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = bool(config.sequence_parallel)  # type: ignore[attr-defined]


class _QKNorm(SequenceParallelRMSNorm):
    """A per-head q/k norm: applied after the sequence is gathered, so not sequence-parallel (megatron-core sums
    its gradient over TP by name instead)."""

    def __init__(self, config: object, hidden_size: int, eps: float = 1e-5, **unused: object) -> None:
        super().__init__(config, hidden_size, eps)
        self.weight.sequence_parallel = False  # type: ignore[attr-defined]


def use_sequence_parallel_norms(block_spec: object) -> object:
    """Put the sequence-parallel norms into a megatron-core block spec (`TransformerBlockSubmodules`): each
    layer's input and pre-MLP norms, q/k norms or multi-latent attention's latent norms, and the final norm."""
    block_spec.layer_norm = SequenceParallelRMSNorm  # type: ignore[attr-defined]
    for layer in block_spec.layer_specs:  # type: ignore[attr-defined]
        sub = layer.submodules
        for name in ("input_layernorm", "pre_mlp_layernorm"):
            if _is_norm(getattr(sub, name, None)):
                setattr(sub, name, SequenceParallelRMSNorm)
        attention = getattr(sub.self_attention, "submodules", None)
        if attention is None:
            continue
        latent = hasattr(attention, "kv_layernorm")  # multi-latent attention: norms of sequence-sharded latents
        for name in ("q_layernorm", "kv_layernorm") if latent else ("q_layernorm", "k_layernorm"):
            if _is_norm(getattr(attention, name, None)):
                setattr(attention, name, SequenceParallelRMSNorm if latent else _QKNorm)
    return block_spec


def _is_norm(module: object) -> bool:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return module is WrappedTorchNorm
