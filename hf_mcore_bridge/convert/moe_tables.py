"""Table entries and config helpers shared by the mixture-of-experts architectures in `mappings/`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from hf_mcore_bridge.convert.config_errors import ConfigError, require
from hf_mcore_bridge.convert.mapping_types import Direct, Entry, FusedGateUp, LayerKind, Size
from hf_mcore_bridge.convert.parallel_style import Parallel

MC_LAYER = "decoder.layers.{layer}"
MC_EXPERT = "decoder.layers.{layer}.mlp.experts.local_experts.{expert}"


def dense_only(entries: tuple[Entry, ...]) -> tuple[Entry, ...]:
    """The same entries, present only on dense-MLP layers."""
    return tuple(replace(e, layers=LayerKind.DENSE) for e in entries)


def routed_experts(norm: str, router: str, gate: str, up: str, down: str) -> tuple[Entry, ...]:
    """Pre-MLP norm, router and routed experts of a MoE layer, from their HF name templates."""
    moe = LayerKind.MOE
    return (
        Direct(f"{MC_LAYER}.pre_mlp_layernorm.weight", norm, Parallel.REPLICATED, (Size.HIDDEN,), layers=moe),
        Direct(f"{MC_LAYER}.mlp.router.weight", router, Parallel.REPLICATED, (Size.EXPERTS, Size.HIDDEN), layers=moe),
        FusedGateUp(f"{MC_EXPERT}.linear_fc1.weight", gate=gate, up=up, width=Size.EXPERT_FFN, layers=moe),
        Direct(f"{MC_EXPERT}.linear_fc2.weight", down, Parallel.ROW, (Size.HIDDEN, Size.EXPERT_FFN), layers=moe),
    )


def moe_layer_pattern(config: Mapping[str, Any], num_layers: int) -> tuple[bool, ...]:
    """Qwen-MoE layer placement: MoE unless in `mlp_only_layers`, every `decoder_sparse_step`-th layer."""
    step = config.get("decoder_sparse_step", 1) or 1
    dense = set(config.get("mlp_only_layers") or [])
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))


def layer_pattern_to_hf(moe_layers: tuple[bool, ...]) -> dict[str, Any]:
    """The simplest `decoder_sparse_step` / `mlp_only_layers` pair that reproduces a layer pattern."""
    count = len(moe_layers)
    for step in range(1, count + 1):
        if moe_layer_pattern({"decoder_sparse_step": step}, count) == moe_layers:
            return {"decoder_sparse_step": step, "mlp_only_layers": []}
    return {"decoder_sparse_step": 1, "mlp_only_layers": [i for i, moe in enumerate(moe_layers) if not moe]}


def topk(config: Mapping[str, Any], experts: int) -> int:
    k = require(config, "num_experts_per_tok")
    if not 0 < k <= experts:
        raise ConfigError(f"config field num_experts_per_tok={k} must be between 1 and the {experts} experts")
    return k
