"""Rollout routing replay in megatron-core's MoE routers: every forward pass of a micro-batch that carries the
engine's routing (`MicroBatch.routed_experts`) sends each token to the experts the inference engine chose for it.

megatron-core 0.16 has the hook itself, so nothing is patched: with `TransformerConfig.moe_enable_routing_replay`
each `TopKRouter` owns a `RouterReplay`, and its action `REPLAY_FORWARD` makes `topk_routing_with_score_function`
take the given top-k indices in place of its own and gather the routing probabilities from the current scores at
them. The weights (and the router's gradient) therefore still come from the current router; only the choice is the
engine's (the score bias and group limits, which only choose, play no part). This module lays the engine's ids out
as each router sees its tokens and hands each router its layer's, per micro-batch, before the forward.

Layout: the micro-batch's `[moe_layers, k, B, S]` (id + 1, see `algorithm.batching`) -> this context-parallel rank's
positions (those `cp_inputs` feeds the model) -> under sequence parallelism this tensor-parallel rank's contiguous
slice of them (megatron-core scatters the embeddings `[s, B, H]` along s) -> `[s * B, k]` in the router's token
order (sequence-major: it flattens `[s, B, E]`). Expert parallelism routes before dispatching, on each rank's own
tokens, with global expert ids: nothing changes. Tokens without a recorded choice (padding; each rollout's last
token, which the engine never ran and whose MoE output reaches no log-prob under causal attention) go to experts
0..k-1.

Assumes the routers' `layer_number` (1-based over the whole model, pipeline stages included) to find each one's MoE
layer, no activation recomputation (a recomputed forward takes `REPLAY_BACKWARD`'s queue) and the unfused top-k
(`moe_router_fusion` calls Transformer Engine's kernel without the hook): both are refused where replay is asked for
(`grpo.run.config`).
"""

from __future__ import annotations

from typing import Any

import torch

from hf_mcore_bridge.models.mapping_types import LayerKind
from hf_mcore_bridge.models.spec import ModelSpec

__all__ = ["local_routing", "moe_layer_numbers", "replay_routing"]


def moe_layer_numbers(model_cfg: ModelSpec) -> tuple[int, ...]:
    """The 1-based numbers of the model's MoE layers, in order: index i of a recorded `[moe_layers, ...]` tensor is
    the choice of layer `moe_layer_numbers(...)[i]`."""
    return tuple(layer + 1 for layer in range(model_cfg.num_layers) if model_cfg.layer_kind(layer) is LayerKind.MOE)


def local_routing(
    routed: torch.Tensor, positions: torch.Tensor | None, tp_size: int, tp_rank: int, sequence_parallel: bool
) -> torch.Tensor:
    """The expert ids `[moe_layers, s * B, k]` int64 this rank's routers see, from a micro-batch's `routed`
    `[moe_layers, k, B, S]` (id + 1; 0: none recorded): the context-parallel `positions` (None: all), then under
    sequence parallelism tensor-parallel rank `tp_rank`'s slice of `tp_size`, tokens sequence-major."""
    if positions is not None:
        routed = routed[..., positions.to(routed.device)]
    if sequence_parallel and tp_size > 1:
        routed = routed.chunk(tp_size, dim=-1)[tp_rank]
    layers, k, rows, length = routed.shape
    ids = routed.permute(0, 3, 2, 1).reshape(layers, length * rows, k).long() - 1
    unrecorded = (ids < 0).any(dim=-1, keepdim=True)
    return torch.where(unrecorded, torch.arange(k, device=ids.device), ids)


def _routers(model: torch.nn.Module) -> list[Any]:
    """The model's megatron-core top-k routers, in module order."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


def replay_routing(model: torch.nn.Module, ids: torch.Tensor | None, moe_layers: tuple[int, ...]) -> int:
    """Set every router of `model` (this pipeline stage's) to replay its layer's `ids` (`local_routing`'s
    `[moe_layers, tokens, k]`) in the forward passes that follow, or, with `ids` None, to route by itself again.
    Returns the number of routers set."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    routers = _routers(model)
    if ids is not None and any(router.router_replay is None for router in routers):
        raise RuntimeError("routing replay needs the routers built with moe_enable_routing_replay=True")
    for router in routers:
        replay = router.router_replay
        if replay is None:
            continue
        replay.clear_indices()  # also empties the backward queue `set_target_indices` appends to
        if ids is None:
            replay.clear_router_replay_action()
            continue
        if router.layer_number not in moe_layers:
            raise ValueError(f"router of layer {router.layer_number} is not one of the MoE layers {moe_layers}")
        replay.set_target_indices(ids[moe_layers.index(router.layer_number)])
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    return len(routers)
