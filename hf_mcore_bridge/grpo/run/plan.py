"""The run's parallel dimensions, read from the config once and handed down (torchtitan's `ParallelDims`).

`parallel_dims(config)` reads the enabled backend's section and the cluster section: which backend trains, the
layout (megatron-core's TP / PP / CP / EP / ETP; the DTensor mesh's TP), the ranks the run starts, its
data-parallel size and the rollout engine's tensor-parallel size, and refuses a world that cannot hold them. Config
validation calls it, and so does everything that starts or lays out processes; nothing else derives these sizes
from the config. Standard library only (a config is validated without torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from hf_mcore_bridge.convert.layout import Layout, check_world, world_size
from hf_mcore_bridge.errors import BridgeError
from hf_mcore_bridge.grpo.backends.dtensor.config import dtensor_sizes
from hf_mcore_bridge.grpo.backends.megatron.config import megatron_layout
from hf_mcore_bridge.grpo.errors import GRPOConfigError, require

if TYPE_CHECKING:
    from hf_mcore_bridge.grpo.run.config import GRPOConfig

__all__ = ["Backend", "ParallelDims", "cluster_ranks", "parallel_dims"]


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
