"""Multi-latent attention of megatron-core's local layer spec under sequence parallelism, with whole gradients.

In the local spec the key/value down-projection (`linear_kv_down_proj`) is a `ColumnParallelLinear`: each TP rank
computes its columns of `[kv latent; shared rotary key]` for the whole sequence, and megatron-core 0.16's
`MLASelfAttention.get_query_key_value_tensors` gathers the columns, scatters the latent back to this rank's slice
of the sequence and keeps the rotary key (`k_pos_emb`) whole. Each rank's attention heads use that rotary key, so
its gradient on a rank holds only that rank's heads' share; the backward of the column gather then keeps each
rank's own columns of it, and the other ranks' shares of the rotary key's gradient are lost (the rotary rows of
`kv_a_proj_with_mqa` and everything before the layer get wrong gradients; the forward pass is right).

`SequenceShardedLatentsMLA` is `MLASelfAttention` whose down-projection hands on its output as a sequence-parallel
linear layer would (megatron-core's `Linear` or Transformer Engine's duplicated `TELinear`): every column, this
rank's slice of the sequence (`[s / TP, b, n]`, a column gather then a sequence scatter, megatron-core's own
mappings). `get_query_key_value_tensors` then takes its path for such layers, which gathers the rotary key over
the sequence and sums its gradient over the TP ranks. The module, its parameters and their TP sharding (hence
checkpoints and the refit) are unchanged. The query's down-projection needs nothing: its output is scattered back
to the sequence whole.

Assumes megatron-core 0.16's `MLASelfAttention` (the branch on the down-projection's output width). Used under
sequence parallelism only (`megatron.model.layer_spec`). Without it, at TP > 1, the local spec's gradients are
wrong the same way (and the query latent norm's, whole on every rank, is summed over TP by its name): the trainer
never trains so, every multi-latent architecture here being a mixture of experts, which TP > 1 trains only with
sequence parallelism.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.tensor_parallel.mappings import (
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.utils import get_pg_size

__all__ = ["SequenceShardedLatentsMLA", "use_sequence_sharded_latents"]


class SequenceShardedLatentsMLA(MLASelfAttention):
    """`MLASelfAttention` whose column-parallel key/value down-projection gives this rank's slice of the sequence
    with every column (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        down = self.linear_kv_down_proj
        if self.config.sequence_parallel and get_pg_size(self.tp_group) > 1 and type(down) is ColumnParallelLinear:
            down.register_forward_hook(_sequence_sharded)


def _sequence_sharded(module: torch.nn.Module, args: Any, output: tuple[torch.Tensor, Any]) -> tuple[Any, Any]:
    """A forward hook of a column-parallel down-projection: its output `[s, b, n / TP]` as `[s / TP, b, n]`."""
    latents, bias = output
    group = module.tp_group
    return scatter_to_sequence_parallel_region(gather_from_tensor_model_parallel_region(latents, group), group), bias


def use_sequence_sharded_latents(spec: Any) -> Any:
    """Make every multi-latent-attention layer of `spec` (a layer's `ModuleSpec` or a `TransformerBlockSubmodules`)
    build `SequenceShardedLatentsMLA`."""
    for layer in getattr(spec, "layer_specs", None) or [spec]:
        attention = layer.submodules.self_attention
        if getattr(attention, "module", None) is MLASelfAttention:
            attention.module = SequenceShardedLatentsMLA
    return spec
