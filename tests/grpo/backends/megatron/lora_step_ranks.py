"""The rank function of the LoRA GRPO step test: the run's own megatron-core policy with `policy.lora` enabled,
its refit stream before and after one training step, the adapters' gradients as the optimizer receives them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def lora_step_rank(config: Any, prepared: Any, rollouts: list[Any], out: str) -> None:
    """`build_backend` (with adapters), the refit stream of the initial weights, `_train_step` on `rollouts` with the
    adapters' gradients taken at the optimizer step (`main_grad`, gathered whole by HF module name), then the refit
    stream again and the adapters after the step. Rank 0 saves `<out>`: `initial` and `trained` adapters (A, B),
    `grads`, `metrics`, `before` and `after` (HF-named streams), `frozen_unchanged` (every base parameter bit for
    bit as built) and `trainable` (elements the optimizer holds on this rank)."""
    from hf_mcore_bridge.grpo.run.ranks import build_backend
    from hf_mcore_bridge.grpo.run.trainer import _train_step
    from hf_mcore_bridge.megatron.lora import adapter_modules, full_adapters

    torch.manual_seed(config.grpo.seed)
    backend = build_backend(config, prepared)
    module, optimizer = backend.policy.module, backend.policy.optimizer
    adapters = adapter_modules(module)
    initial = full_adapters(adapters)
    base = {n: p.detach().clone() for n, p in module.named_parameters() if not p.requires_grad}
    before = {name: tensor.detach().cpu().clone() for name, tensor in backend.hf_weights()}
    grads: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    step = optimizer.step

    def step_after_snapshot() -> Any:
        for holder in adapters:
            for p in (*holder.lora_a, *holder.lora_b):
                p.grad = p.main_grad.detach().clone()
        grads.update(full_adapters(adapters, grad=True))
        return step()

    optimizer.step = step_after_snapshot
    metrics = _train_step(backend, config, rollouts)
    after = {name: tensor.detach().cpu().clone() for name, tensor in backend.hf_weights()}
    trained = full_adapters(adapters)
    unchanged = all(torch.equal(base[n], p) for n, p in module.named_parameters() if n in base)
    held = sum(p.numel() for group in optimizer.param_groups for p in group["params"])
    if dist.get_rank() == 0:
        result = {"initial": initial, "trained": trained, "grads": grads, "metrics": metrics, "before": before}
        result |= {"after": after, "frozen_unchanged": unchanged, "trainable": held}
        torch.save(result, Path(out))
