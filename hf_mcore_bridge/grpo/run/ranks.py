"""The run's ranks: starting them (`start_world`) and building each one's trained policy (`build_backend`).

Both read the run's plan (`run.plan`): the world is started at its dimensions (megatron-core's `parallel_state` for
its layout, or a bare world whose device mesh the DTensor policy lays out), and the policy of the enabled backend
is built at its layout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hf_mcore_bridge.checkpoint import dtypes
from hf_mcore_bridge.grpo.backends.base import TrainingBackend, checkpoint_assets
from hf_mcore_bridge.grpo.run.config import GRPOConfig
from hf_mcore_bridge.grpo.run.plan import Backend, ParallelDims

if TYPE_CHECKING:
    from hf_mcore_bridge.grpo.run.trainer import PreparedRun

__all__ = ["build_backend", "start_world"]


def build_backend(config: GRPOConfig, prepared: PreparedRun) -> TrainingBackend:
    """This rank's policy of the plan's backend (`prepared.plan`), loaded from `prepared.checkpoint_dir`
    (collective)."""
    dtype = dtypes.FLAGS[config.policy.dtype].torch
    total_steps = config.grpo.max_num_steps * config.grpo.num_minibatches
    keep_reference = config.loss_fn.kl_coef > 0
    assets = checkpoint_assets(prepared.hf_config, prepared.tokenizer_file)
    dims = prepared.plan.dims
    if dims.backend is Backend.DTENSOR:
        from hf_mcore_bridge.grpo.backends.dtensor.backend import DTensorBackend
        from hf_mcore_bridge.grpo.backends.dtensor.policy import build_dtensor_policy

        policy = build_dtensor_policy(
            prepared.checkpoint_dir,
            config.policy.dtensor_cfg,
            dtype,
            total_steps,
            keep_reference,
            lora=config.policy.lora,
        )
        return DTensorBackend(policy, assets, base_model=config.policy.model_path)
    from hf_mcore_bridge.grpo.backends.megatron.backend import MegatronBackend
    from hf_mcore_bridge.grpo.backends.megatron.policy import build_policy
    from hf_mcore_bridge.megatron.cpu_patches import apply_cpu_training_workarounds

    apply_cpu_training_workarounds()
    megatron = build_policy(
        prepared.model_cfg,
        config.policy.megatron_cfg,
        dims.layout,
        dtype,
        prepared.padded_vocab,
        prepared.checkpoint_dir,
        total_optimizer_steps=total_steps,
        keep_reference=keep_reference,
        router_replay=config.policy.router_replay.enabled,
        lora=config.policy.lora,
    )
    lora = config.policy.lora if config.policy.lora.enabled else None
    return MegatronBackend(megatron, config.policy.megatron_cfg, dims.layout, assets, lora)


def start_world(dims: ParallelDims, fn: Callable[..., None], *args: Any) -> None:
    """Run `fn(*args)` on every rank of a world of `dims.world` ranks laid out for its backend: spawned here, or
    the launcher's (torchrun) world this process is a rank of (see `megatron.world`)."""
    from hf_mcore_bridge.megatron.world import run_torch_world, run_world

    if dims.backend is Backend.DTENSOR:
        run_torch_world(fn, dims.world, *args)
        return
    run_world(fn, dims.layout, *args, world=dims.world)
