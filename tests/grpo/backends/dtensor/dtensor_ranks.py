"""Rank functions the DTensor tests run inside `hf_mcore_bridge.megatron.world.run_torch_world` (gloo on CPU)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hf_mcore_bridge.grpo.algorithm.batching import Rollout, make_microbatches, pack_microbatches
from hf_mcore_bridge.grpo.algorithm.losses import LossConfig
from hf_mcore_bridge.grpo.backends.dtensor.config import DTensorConfig
from hf_mcore_bridge.grpo.backends.dtensor.policy import build_dtensor_policy


def logprobs_and_step_rank(
    hf_dir: str,
    settings: DTensorConfig,
    rollouts: list[Rollout],
    micro_batch_size: int,
    loss_config: LossConfig,
    temperature: float,
    out: str,
) -> None:
    """Log-probs of all `rollouts` (padded and packed micro-batches, rebuilt the same way by the test), then one
    `train_minibatch` on this data-parallel rank's share (every dp-th rollout, as the trainer splits; packed rows
    when `settings.sequence_packing`); rank 0 saves
    the log-probs, the step's metrics and the full updated weights (tensors and floats only). After the step the
    log-probs are taken again, of the updated policy and of the KL reference (the initial weights swapped in)."""
    policy = build_dtensor_policy(Path(hf_dir), settings, torch.float32, total_optimizer_steps=1, keep_reference=True)
    padded = make_microbatches(rollouts, micro_batch_size)
    packed = pack_microbatches(rollouts, max_tokens=64)
    results = {
        "padded": policy.compute_logprobs(padded, temperature),
        "packed": policy.compute_logprobs(packed, temperature),
    }
    share = rollouts[policy.dp_rank :: policy.dp_size]
    mine = pack_microbatches(share, 32) if settings.sequence_packing else make_microbatches(share, micro_batch_size)
    old = policy.compute_logprobs(mine, temperature)
    ref = policy.compute_logprobs(mine, temperature, reference=True)
    metrics = policy.train_minibatch(mine, old, ref, loss_config, temperature)
    results["padded_after_step"] = policy.compute_logprobs(padded, temperature)
    results["padded_reference_after_step"] = policy.compute_logprobs(padded, temperature, reference=True)
    weights = {name: tensor.cpu() for name, tensor in policy.hf_weights()}
    if dist.get_rank() == 0:
        torch.save({**results, "metrics": metrics, "weights": weights}, out)


def lora_step_rank(
    hf_dir: str,
    settings: DTensorConfig,
    lora: object,
    rollouts: list[Rollout],
    micro_batch_size: int,
    loss_config: LossConfig,
    temperature: float,
    out: str,
    dropout_lora: object = None,
) -> None:
    """The DTensor policy with `policy.lora` (PEFT's LoRA layers, FSDP2): the initial adapters, one
    `train_minibatch` on this data-parallel rank's share (old and reference log-probs computed first), the adapters
    after it, the merged and the base HF streams, the HF names `trained_names` would give and the elements the
    optimizer holds; a checkpoint round trip (`_checkpoint_round_trip`) and, given `dropout_lora`, a policy with
    adapter dropout (`_dropout_forwards`). Rank 0 saves them."""
    from hf_mcore_bridge.grpo.backends.dtensor.lora import full_adapters

    policy, initial, metrics, mine = _one_lora_step(
        hf_dir, settings, lora, rollouts, micro_batch_size, loss_config, temperature
    )
    trained = dict(full_adapters(policy.model))
    merged = {name: tensor.cpu() for name, tensor in policy.hf_weights()}
    base = {name: tensor.cpu() for name, tensor in policy.hf_weights(merged=False)}
    adapted = policy.adapted_names()
    only = {name: tensor.cpu() for name, tensor in policy.hf_weights(names=adapted)}
    held = sum(p.numel() for group in policy.optimizer.param_groups for p in group["params"])
    second = _checkpoint_round_trip(hf_dir, settings, lora, policy, mine, loss_config, temperature, Path(out).parent)
    dropout = (
        None
        if dropout_lora is None
        else _dropout_forwards(hf_dir, settings, dropout_lora, mine, loss_config, temperature)
    )
    if dist.get_rank() == 0:
        result = {"initial": initial, "trained": trained, "metrics": metrics, "merged": merged, "base": base}
        torch.save(result | {"adapted": adapted, "only": only, "held": held, "dropout": dropout} | second, out)


def _one_lora_step(
    hf_dir: str,
    settings: DTensorConfig,
    lora: object,
    rollouts: list[Rollout],
    micro_batch_size: int,
    loss_config: LossConfig,
    temperature: float,
) -> tuple[Any, dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, float], list[Any]]:
    """The DTensor policy with `lora`, its initial adapters (whole), and one `train_minibatch` on this
    data-parallel rank's share of `rollouts` (old and reference log-probs computed first): (policy, initial
    adapters, the step's metrics, the micro-batches it trained on)."""
    from hf_mcore_bridge.grpo.backends.dtensor.lora import full_adapters

    policy = build_dtensor_policy(
        Path(hf_dir), settings, torch.float32, total_optimizer_steps=1, keep_reference=True, lora=lora
    )
    initial = {name: (a.clone(), b.clone()) for name, (a, b) in full_adapters(policy.model)}
    mine = make_microbatches(rollouts[policy.dp_rank :: policy.dp_size], micro_batch_size)
    old = policy.compute_logprobs(mine, temperature)
    ref = policy.compute_logprobs(mine, temperature, reference=True)
    metrics = policy.train_minibatch(mine, old, ref, loss_config, temperature)
    return policy, initial, metrics, mine


def _dropout_forwards(
    hf_dir: str, settings: DTensorConfig, lora: object, mine: list, loss_config: LossConfig, temperature: float
) -> dict:
    """A policy with adapter dropout (`lora`) and activation checkpointing: per adapted module, its input x, its
    output, its base layer's output and its `lora_dropout`'s output in the first forward of `compute_logprobs`
    (`eval`) and of `train_minibatch` (`train`); and the `lora_dropout` outputs of that training forward and of its
    recomputation in the backward (`recomputed`)."""
    from hf_mcore_bridge.grpo.backends.dtensor.lora import ADAPTER, lora_modules

    recompute = dataclasses.replace(settings, activation_checkpointing=True)
    policy = build_dtensor_policy(
        Path(hf_dir), recompute, torch.float32, total_optimizer_steps=1, keep_reference=True, lora=lora
    )
    phase: list[str | None] = [None]
    records: dict[str, dict[str, dict[str, torch.Tensor]]] = {"eval": {}, "train": {}}
    recomputed: dict[str, list[torch.Tensor]] = {}

    def hook(name: str, what: str):
        def record(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
            if phase[0] == "train" and what == "dropped" and len(recomputed.setdefault(name, [])) < 2:
                recomputed[name].append(output.detach().clone())
            if phase[0] is not None and what not in records[phase[0]].setdefault(name, {}):
                records[phase[0]][name][what] = output.detach().clone()
                if what == "output":
                    records[phase[0]][name]["x"] = args[0].detach().clone()

        return record

    for name, module in lora_modules(policy.model).items():
        module.register_forward_hook(hook(name, "output"))
        module.base_layer.register_forward_hook(hook(name, "base"))
        module.lora_dropout[ADAPTER].register_forward_hook(hook(name, "dropped"))
    phase[0] = "eval"
    old = policy.compute_logprobs(mine, temperature)
    phase[0] = None
    ref = policy.compute_logprobs(mine, temperature, reference=True)
    phase[0] = "train"
    policy.train_minibatch(mine, old, ref, loss_config, temperature)
    return records | {"recomputed": recomputed}


def _checkpoint_round_trip(
    hf_dir: str,
    settings: DTensorConfig,
    lora: object,
    policy: object,
    mine: list,
    loss_config: LossConfig,
    temperature: float,
    directory: Path,
) -> dict:
    """`policy` (one step done) saved as a LoRA checkpoint in `directory/ckpt` and loaded into a new policy; then
    one more step on each, and on a new policy given the trained adapters alone (no optimizer state): the adapters
    and metrics after that step, per policy."""
    from hf_mcore_bridge.grpo.backends.dtensor.checkpoint import load_dtensor_checkpoint, save_dtensor_checkpoint
    from hf_mcore_bridge.grpo.backends.dtensor.lora import full_adapters

    root = directory / "ckpt"
    assets = {"config.json": (Path(hf_dir) / "config.json").read_text()}
    save_dtensor_checkpoint(policy, root, 1, {"optimizer_steps": policy.optimizer_steps}, assets, hf_dir)

    def build() -> object:
        return build_dtensor_policy(
            Path(hf_dir), settings, torch.float32, total_optimizer_steps=2, keep_reference=True, lora=lora
        )

    resumed = build()
    load_dtensor_checkpoint(resumed, root, 1)
    adapters_alone = build()
    with torch.no_grad():
        for p, q in zip(adapters_alone.model.parameters(), policy.model.parameters(), strict=True):
            if q.requires_grad:
                p.copy_(q)
    result = {}
    for key, each in (("continued", policy), ("resumed", resumed), ("adapters_alone", adapters_alone)):
        old = each.compute_logprobs(mine, temperature)
        ref = each.compute_logprobs(mine, temperature, reference=True)
        metrics = each.train_minibatch(mine, old, ref, loss_config, temperature)
        result[key] = {"metrics": metrics, "adapters": dict(full_adapters(each.model))}
    return result


def lora_tp_step_rank(
    hf_dir: str,
    settings: DTensorConfig,
    lora: object,
    rollouts: list[Rollout],
    micro_batch_size: int,
    loss_config: LossConfig,
    temperature: float,
    out: str,
    fault: str | None = None,
) -> None:
    """The DTensor policy with `policy.lora` under tensor parallelism (`settings.tensor_parallel_size`): the initial
    adapters, one `train_minibatch` on this data-parallel rank's share, the adapters' gradients (clipped, as the
    optimizer used them) and values after it, the merged stream, and how the factors are laid out (placements of
    q_proj's and o_proj's A and B in layer 0, `_tp_placement`). Rank 0 saves them. `fault="no_allreduce"`: a
    broken plan whose row-parallel projections' A x is not all-reduced over TP (each rank adds B A x of its own
    half of x)."""
    from unittest import mock

    from torch.distributed.tensor import DTensor

    from hf_mcore_bridge.grpo.backends.dtensor import parallel
    from hf_mcore_bridge.grpo.backends.dtensor.lora import ADAPTER, full_adapters, lora_modules

    if fault == "no_allreduce":
        from torch.distributed.tensor import Partial
        from torch.distributed.tensor.parallel import RowwiseParallel

        plan = parallel.lora_plan

        def broken(name: str, module: torch.nn.Module, style: type) -> dict:
            result = plan(name, module, style)
            if style is RowwiseParallel:
                result = {
                    k: RowwiseParallel(output_layouts=Partial()) if ".lora_A." in k else v for k, v in result.items()
                }
            return result

        with mock.patch.object(parallel, "lora_plan", broken):
            return lora_tp_step_rank(hf_dir, settings, lora, rollouts, micro_batch_size, loss_config, temperature, out)

    policy, initial, metrics, _ = _one_lora_step(
        hf_dir, settings, lora, rollouts, micro_batch_size, loss_config, temperature
    )

    def whole(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor

    grads, layout = {}, {}
    for name, module in lora_modules(policy.model).items():
        a, b = module.lora_A[ADAPTER].weight, module.lora_B[ADAPTER].weight
        grads[name] = (whole(a.grad).clone(), whole(b.grad).clone())
        if name.startswith("model.layers.0.self_attn."):
            layout[name] = tuple(_tp_placement(p) for p in (a, b))
    trained = dict(full_adapters(policy.model))
    merged = {name: tensor.cpu() for name, tensor in policy.hf_weights()}
    if dist.get_rank() == 0:
        result = {"initial": initial, "trained": trained, "metrics": metrics, "merged": merged, "grads": grads}
        torch.save(result | {"layout": layout}, out)


def _tp_placement(parameter: torch.Tensor) -> str:
    """How a parameter lies over the "tp" mesh dimension: its placement there, or `whole` (not on that mesh)."""
    from torch.distributed.tensor import DTensor

    names = (parameter.device_mesh.mesh_dim_names or ()) if isinstance(parameter, DTensor) else ()
    return str(parameter.placements[names.index("tp")]) if "tp" in names else "whole"
