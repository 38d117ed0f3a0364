"""The run's plan: computed once in the parent from the config and the prepared model, handed to every rank.

Two parts, as torchtitan computes its `ParallelDims` once and hands them down:

- `ParallelDims` (`parallel_dims(config)`, from the config alone): which backend trains, the layout (megatron-core's
  TP / PP / CP / EP / ETP; the DTensor mesh's TP), the ranks the run starts, its data-parallel size and the
  rollout engine's tensor-parallel size; a world that cannot hold them is refused. Config validation calls it too,
  so this module imports no torch at load.
- `RunPlan` (`plan_run(config, dims, model)`, once the model is known): the dimensions, the refit path (each rank
  its own tensor-parallel shards into its engine's part, or full tensors) and the engine's config, derived once
  from the generation section.

The ranks read the plan (`PreparedRun.plan`); nothing else derives these from the config.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from hf_mcore_bridge.convert.layout import Layout, check_world, world_size
from hf_mcore_bridge.errors import BridgeError
from hf_mcore_bridge.grpo.backends.dtensor.config import dtensor_sizes
from hf_mcore_bridge.grpo.backends.megatron.config import megatron_layout
from hf_mcore_bridge.grpo.errors import GRPOConfigError, require

if TYPE_CHECKING:
    from hf_mcore_bridge.engine import EngineConfig
    from hf_mcore_bridge.grpo.run.config import GRPOConfig
    from hf_mcore_bridge.models.spec import ModelSpec

__all__ = [
    "Backend",
    "ParallelDims",
    "RefitPath",
    "RunPlan",
    "cluster_ranks",
    "engine_config",
    "parallel_dims",
    "plan_run",
    "refit_path",
]


class Backend(StrEnum):
    """The training backend a run uses (exactly one section enabled)."""

    MEGATRON = "megatron"
    """megatron-core (`policy.megatron_cfg`)."""
    DTENSOR = "dtensor"
    """The HF model under FSDP2 and DTensor TP (`policy.dtensor_cfg`)."""


@dataclass(frozen=True)
class ParallelDims:
    """How the run's ranks are laid out."""

    backend: Backend
    """Which backend trains."""
    layout: Layout
    """megatron-core's parallel layout; for DTensor, its tensor-parallel size alone (no PP, CP or EP)."""
    world: int
    """Ranks the run starts: `cluster.gpus_per_node x num_nodes`, else the layout's TP x PP x CP x EP (megatron-core)
    or `data_parallel_shard_size x tensor_parallel_size` (DTensor)."""
    dp: int
    """Data-parallel ranks the rollouts are split over: world / (TP x PP x CP), or DTensor's FSDP2 shards."""
    engine_tp: int
    """Ranks one rollout engine replica spans (`generation.tensor_parallel_size`, else the policy's TP)."""

    @property
    def tp(self) -> int:
        """The trainer's tensor-parallel size."""
        return self.layout.tp

    @property
    def pp(self) -> int:
        """Pipeline stages (1 for DTensor)."""
        return self.layout.pp

    @property
    def cp(self) -> int:
        """Context-parallel size (1 for DTensor)."""
        return self.layout.cp

    @property
    def ep(self) -> int:
        """Expert-parallel size (1 for DTensor)."""
        return self.layout.ep

    @property
    def engine_replicas(self) -> int:
        """Rollout engine replicas: every `engine_tp` consecutive ranks form one."""
        return self.world // self.engine_tp


def cluster_ranks(config: GRPOConfig) -> int | None:
    """`cluster.gpus_per_node x cluster.num_nodes`, or None where `gpus_per_node` is not given."""
    given = config.cluster.gpus_per_node
    return None if given is None else given * config.cluster.num_nodes


def parallel_dims(config: GRPOConfig) -> ParallelDims:
    """The run's dimensions; raises `GRPOConfigError` where the world cannot hold the layout or the engine's TP
    does not divide it. Expects the backend sections' own checks passed (`GRPOConfig.validate` runs them first)."""
    policy, given = config.policy, cluster_ranks(config)
    if policy.dtensor_cfg.enabled:
        backend = Backend.DTENSOR
        dp, tp = dtensor_sizes(policy.dtensor_cfg, given)
        layout, world = Layout(tp=tp), dp * tp
    else:
        backend = Backend.MEGATRON
        layout = megatron_layout(policy.megatron_cfg)
        world = world_size(layout) if given is None else given
        try:
            check_world(layout, world)
        except BridgeError as err:
            raise GRPOConfigError(f"cluster.gpus_per_node x num_nodes: {err}") from None
        dp = world // (layout.tp * layout.pp * layout.cp)
    engine_tp = config.generation.tensor_parallel_size
    engine_tp = layout.tp if engine_tp is None else engine_tp
    require(engine_tp >= 1, f"generation.tensor_parallel_size={engine_tp} must be >= 1")
    require(
        world % engine_tp == 0,
        f"generation.tensor_parallel_size={engine_tp} must divide the run's {world} ranks (each engine replica spans "
        f"{engine_tp} of them)",
    )
    return ParallelDims(backend, layout, world, dp, engine_tp)


class RefitPath(StrEnum):
    """How the trainer's weights reach the engine after each step."""

    SHARD_LOCAL = "shard_local"
    """Each rank converts its own tensor-parallel shards into its engine's part (no all-gather but the
    vocabulary's): the engine replica is the trainer's tensor-parallel group (megatron-core, dense model, embedded
    engine at the policy's TP > 1)."""
    FULL = "full"
    """Full tensors are gathered and each engine rank keeps its part of them."""


@dataclass(frozen=True)
class RunPlan:
    """What every rank of the run is handed: its dimensions, the refit path and the engine's config."""

    dims: ParallelDims
    """The run's parallel dimensions."""
    refit: RefitPath
    """The refit path (`refit_path`)."""
    engine: EngineConfig
    """The rollout engine's config (`engine_config`); its `device` is the device type, each rank's own device is
    put in by `engine_on`."""

    def engine_on(self, device: str) -> EngineConfig:
        """The engine's config on this rank's `device` (e.g. `cuda:3`)."""
        return dataclasses.replace(self.engine, device=device)

    def check_replicas(self, replicas: Any) -> None:
        """Raise `BridgeError` unless the engine replicas a rank formed (`generation.EngineReplicas`) are the
        planned ones: `dims.engine_replicas` replicas of `dims.engine_tp` ranks, and, for a shard-local refit, each
        replica sharing the trainer's tensor-parallel group (whose shards it then loads as its parts)."""
        found = (replicas.size, replicas.tp)
        planned = (self.dims.engine_replicas, self.dims.engine_tp)
        if found != planned:
            raise BridgeError(f"the engine formed {found[0]} replicas of {found[1]} ranks; the run planned {planned}")
        if self.refit is RefitPath.SHARD_LOCAL and not replicas.shared:
            raise BridgeError(
                "the run planned a shard-local refit, but this engine replica's ranks are not the trainer's"
                " tensor-parallel group"
            )


def refit_path(dims: ParallelDims, model: ModelSpec, generation_backend: str) -> RefitPath:
    """Shard-local where the trainer can stream each rank's own parts and the engine replica holds exactly the
    trainer's tensor-parallel group: megatron-core (whose TP groups, like the engine replicas, are consecutive
    ranks) with a dense model, the embedded engine (vLLM takes full tensors) at the policy's TP, above 1."""
    local = (
        dims.backend is Backend.MEGATRON
        and model.moe is None
        and generation_backend == "embedded"
        and dims.engine_tp == dims.tp > 1
    )
    return RefitPath.SHARD_LOCAL if local else RefitPath.FULL


MIN_BATCHED_TOKENS = 8192
"""Prompt tokens the engine may prefill in one step, at least (`max_num_batched_tokens`; never below
`max_model_len`)."""


def engine_config(config: GRPOConfig, device_type: str) -> EngineConfig:
    """The rollout engine's config: every generation key that is also an `EngineConfig` field (same name, same
    meaning: `max_model_len`, the KV cache's budget, dtype and scale, the decode kernel and its batch threshold,
    `torch_compile`), the policy's dtype, FP8 weights for `generation.precision: fp8`, room for every sequence of a
    step (and of a validation), CUDA graphs of the decode step, on `device_type`."""
    from hf_mcore_bridge.checkpoint import dtypes
    from hf_mcore_bridge.engine import EngineConfig

    gen, grpo = config.generation, config.grpo
    shared = {f.name for f in dataclasses.fields(gen)} & {f.name for f in dataclasses.fields(EngineConfig)}
    samples = grpo.num_prompts_per_step * grpo.num_generations_per_prompt
    return EngineConfig(
        **{name: getattr(gen, name) for name in sorted(shared)},
        dtype=dtypes.FLAGS[config.policy.dtype].torch,
        device=device_type,
        max_num_seqs=max(samples, grpo.val_num_prompts * grpo.val_num_generations),
        max_num_batched_tokens=max(gen.max_model_len, MIN_BATCHED_TOKENS),
        use_cuda_graphs=True,  # decode graphs survive refits: load_weights copies in place
        fp8_weights=gen.precision == "fp8",
        record_routing=config.policy.router_replay.enabled,
        **_engine_lora(config),
    )


def _engine_lora(config: GRPOConfig) -> dict[str, Any]:
    """The engine's adapters where the run's refits stream them (`LoraConfig.refits_adapters`); else none."""
    lora = config.policy.lora
    if not lora.refits_adapters:
        return {}
    return {"lora_rank": lora.rank, "lora_scale": lora.scale, "lora_targets": tuple(lora.target_modules)}


def plan_run(config: GRPOConfig, dims: ParallelDims, model: ModelSpec) -> RunPlan:
    """The run's plan from the validated config, its dimensions (`parallel_dims(config)`) and the model it trains;
    the engine's device type is where this process runs (CUDA where there is one)."""
    import torch

    if model.linear_attention is not None:
        _check_linear_attention(config, model)
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return RunPlan(dims, refit_path(dims, model, config.generation.backend), engine_config(config, device_type))


def _check_linear_attention(config: GRPOConfig, model: ModelSpec) -> None:
    """What the trainer does not compute for Gated DeltaNet layers, refused naming the model and the key: sequence
    parallelism (so a mixture-of-experts hybrid trains at TP 1, megatron-core taking experts under TP only with it);
    context parallelism is refused with the layout (`convert.layout`)."""
    section = config.policy.megatron_cfg
    if section.enabled:
        require(
            not section.sequence_parallel,
            f"policy.megatron_cfg.sequence_parallel: {model.architecture}'s Gated DeltaNet layers are not "
            "sequence-parallel",
        )
