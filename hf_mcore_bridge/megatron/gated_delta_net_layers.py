"""The hybrid decoder of Qwen3-Next and Qwen3.5 under megatron-core's local layer spec: Gated DeltaNet linear
attention on the layers `layer_types` marks `linear_attention`, gated full attention on the others.

megatron-core 0.16 builds this decoder only with Transformer Engine
(`get_transformer_block_with_experimental_attention_variant_spec`); here its own pieces are put into the local
block spec instead (no fork):
- a linear layer's `self_attention` is megatron-core's `GatedDeltaNet` with a column-parallel `in_proj`, a
  row-parallel `out_proj` and `PlainRMSNorm` as its gated output norm. megatron-core builds that norm from the
  config, which would make it zero-centred with the rest (`layernorm_zero_centered_gamma`); transformers'
  `RMSNormGated` scales by `weight` itself;
- the layer's input norm stays the layer's own module and is saved where Transformer Engine fuses it, as
  `self_attention.in_proj.layer_norm_weight` (the local spec saves a full-attention layer's as
  `self_attention.linear_qkv.layer_norm_weight`);
- the full-attention layers are the local spec's (their output gate is megatron-core's `attention_output_gate`);
- with `layernorm_zero_centered_gamma` every other norm (input, pre-MLP, q/k, final) is
  `gemma_layers.OffsetRMSNorm`, transformers' `(1 + weight)` norm, computed in float32.

Packed sequences (`PackedSeqParams`, `thd`), which megatron-core 0.16's `GatedDeltaNet` refuses, are run sequence by
sequence (`packed_gated_delta_net`): the convolution and the recurrent state start afresh at every boundary of
`cu_seqlens`, as for separate sequences; one call per sequence, no varlen kernel.

On machines without flash-linear-attention, `cpu_patches.apply_fla_absent_workarounds` gives `GatedDeltaNet` torch
kernels. Assumes no sequence parallelism (refused where the model is built) and no context parallelism.
"""

from __future__ import annotations

import copy
import functools
import itertools
from collections.abc import Sequence
from typing import Any

import torch

from hf_mcore_bridge.models.mapping_types import LINEAR_ATTENTION

__all__ = ["PlainRMSNorm", "hybrid_block_spec", "linear_attention_pattern"]


class PlainRMSNorm(torch.nn.Module):
    """`weight * (x * rsqrt(mean(x^2) + eps))`, the normalisation in float32 rounded to x's dtype before the
    weight scales it (transformers' `Qwen3NextRMSNormGated` / `Qwen3_5RMSNormGated` before their gate). Built with
    a megatron-core norm's arguments; the weight starts at one.

    Gated DeltaNet's output norm normalises each value head, and under tensor parallelism each rank holds its own
    heads: the weight is replicated but each rank's gradient covers only its heads. megatron-core sums such partial
    gradients over the TP group only for sequence-parallel norms and q/k norms (`finalize_model_grads`), so the
    weight enters through `copy_to_tensor_model_parallel_region` (identity forward, all-reduce of its gradient)."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-6, **unused: Any) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.float()
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return _tp_summed_gradient(self.weight) * normed.to(x.dtype)


def _tp_summed_gradient(weight: torch.Tensor) -> torch.Tensor:
    """`weight`, its gradient summed over the tensor-parallel group in the backward pass (TP > 1)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

    if not parallel_state.model_parallel_is_initialized() or parallel_state.get_tensor_model_parallel_world_size() == 1:
        return weight
    return copy_to_tensor_model_parallel_region(weight)


def linear_attention_pattern(layer_types: Sequence[str]) -> list[int]:
    """megatron-core's `linear_attention_freq` as a list: 1 for a Gated DeltaNet layer, 0 for full attention."""
    return [int(kind == LINEAR_ATTENTION) for kind in layer_types]


@functools.cache
def packed_gated_delta_net() -> type:
    """megatron-core's `GatedDeltaNet`, taking packed sequences: with `packed_seq_params` (`thd`, hidden states
    `[t, 1, h]`), each sequence of `cu_seqlens_q` (and any padding after the last) through the layer on its own."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    class PackedGatedDeltaNet(GatedDeltaNet):
        def forward(self, hidden_states: torch.Tensor, attention_mask: Any, *args: Any, **kwargs: Any) -> Any:
            packed = kwargs.pop("packed_seq_params", None)
            if packed is None:
                return super().forward(hidden_states, attention_mask, *args, **kwargs)
            if packed.qkv_format != "thd" or hidden_states.shape[1] != 1:
                raise ValueError("packed sequences reach Gated DeltaNet as one thd row ([t, 1, h])")
            bounds = [int(b) for b in packed.cu_seqlens_q.tolist()]
            if bounds[-1] < hidden_states.shape[0]:  # padding after the last sequence: a sequence of its own
                bounds.append(hidden_states.shape[0])
            outputs, bias = [], None
            for start, stop in itertools.pairwise(bounds):
                if stop > start:
                    out, bias = super().forward(hidden_states[start:stop], attention_mask, *args, **kwargs)
                    outputs.append(out)
            return torch.cat(outputs), bias

    return PackedGatedDeltaNet


def _gated_delta_net_spec() -> Any:
    from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec

    return ModuleSpec(
        module=packed_gated_delta_net(),
        submodules=GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear, out_norm=PlainRMSNorm, out_proj=RowParallelLinear
        ),
    )


def hybrid_block_spec(config: Any, layer_types: Sequence[str], *, vp_stage: int | None = None) -> Any:
    """The local block spec of this pipeline stage (and virtual stage) for a decoder whose global layers are of
    `layer_types`: Gated DeltaNet where `linear_attention`, the local spec's attention elsewhere, with SDPA core
    attention (`sdpa_attention`) and zero-centred norms where the config says."""
    import warnings

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from hf_mcore_bridge.megatron.sdpa_attention import use_sdpa

    if len(layer_types) != config.num_layers:
        raise ValueError(f"{len(layer_types)} layer types for {config.num_layers} layers")
    zero_centred = bool(config.layernorm_zero_centered_gamma)
    config.layernorm_zero_centered_gamma = False  # the local spec's norms refuse it; OffsetRMSNorm computes it
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            block = get_gpt_decoder_block_spec(
                config, use_transformer_engine=False, normalization="RMSNorm", vp_stage=vp_stage
            )
    finally:
        config.layernorm_zero_centered_gamma = zero_centred
    use_sdpa(block)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    layers = []
    for index, layer in enumerate(block.layer_specs):
        layer = copy.copy(layer)
        layer.submodules = copy.copy(layer.submodules)
        sub = layer.submodules
        keys = dict(sub.sharded_state_dict_keys_map or {})
        if layer_types[offset + index] == LINEAR_ATTENTION:
            sub.self_attention = _gated_delta_net_spec()
            keys["input_layernorm."] = "self_attention.in_proj.layer_norm_"
        sub.sharded_state_dict_keys_map = keys
        if zero_centred:
            _use_offset_norms(sub)
        layers.append(layer)
    block.layer_specs = layers
    if zero_centred:
        from hf_mcore_bridge.megatron.gemma_layers import OffsetRMSNorm

        block.layer_norm = OffsetRMSNorm
    return block


def _use_offset_norms(sub: Any) -> None:
    """The layer's input, pre-MLP and q/k norms as `(1 + weight)` norms (a copy of the attention's spec)."""
    from megatron.core.transformer.identity_op import IdentityOp

    from hf_mcore_bridge.megatron.gemma_layers import OffsetRMSNorm, _HeadNorm

    for name in ("input_layernorm", "pre_mlp_layernorm"):
        if getattr(sub, name, None) not in (None, IdentityOp):
            setattr(sub, name, OffsetRMSNorm)
    attention = sub.self_attention
    if not hasattr(attention.submodules, "q_layernorm"):
        return
    sub.self_attention = attention = copy.copy(attention)
    attention.submodules = copy.copy(attention.submodules)
    for name in ("q_layernorm", "k_layernorm"):
        if getattr(attention.submodules, name, None) not in (None, IdentityOp):
            setattr(attention.submodules, name, _HeadNorm)
