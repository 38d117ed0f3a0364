"""A PEFT LoRA model on a tiny HF model, with every adapter non-zero, and its adapters as the engine loads them."""

from __future__ import annotations

import copy

import torch
from transformers import PreTrainedModel

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RANK, ALPHA = 4, 8.0


def peft_model(base: PreTrainedModel, seed: int = 0) -> torch.nn.Module:
    """A copy of `base` (left as it is) with PEFT's LoRA on every projection, A and B drawn at random (B is zero at
    PEFT's own init, which would hide a misplaced B), in eval mode."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(TARGETS), lora_dropout=0.0)
    model = get_peft_model(copy.deepcopy(base), config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
    return model.eval()


def adapter_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The PEFT model's A and B under PEFT's saved names without their `base_model.model.` prefix."""
    from peft import get_peft_model_state_dict

    return [
        (name.removeprefix("base_model.model."), tensor.detach().clone())
        for name, tensor in get_peft_model_state_dict(model).items()
    ]
