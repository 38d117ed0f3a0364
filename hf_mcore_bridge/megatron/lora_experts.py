"""Which mixture-of-experts table entries LoRA's expert targets adapt, and how their adapters are named.

`LoraConfig`'s `experts.gate_up_proj` adapts each routed expert's `linear_fc1` (the table's expert `FusedGateUp`),
`experts.down_proj` its `linear_fc2`: PEFT's `target_parameters` adapters of transformers 5's fused expert tensors
(`fused_expert_template`, from the architecture's `fused_experts` rules), one rank-r adapter per expert, named
`<fused tensor>[<global expert>]` (`expert_name`). Assumes the fused tensors are plain [experts, out, in] stacks
(`gate_up_proj` = [gate; up] rows); other layouts (GPT-OSS's) are refused by name. No torch.
"""

from __future__ import annotations

import re

from hf_mcore_bridge.megatron.lora_config import EXPERT_PROJECTIONS
from hf_mcore_bridge.models.mapping_types import Entry
from hf_mcore_bridge.models.spec import ModelSpec

__all__ = ["EXPERT_NAME", "expert_name", "expert_target", "fused_expert_template", "is_expert"]

EXPERT_NAME = re.compile(r"(.+)\[(\d+)\]")
"""An expert adapter's name (`expert_name`): groups the fused tensor and the expert."""


def is_expert(entry: Entry) -> bool:
    """Whether a table entry is a routed expert's (one tensor per expert)."""
    return "{expert}" in entry.mcore or "{expert}" in entry.hf_sources[0]


def expert_target(entry: Entry) -> str | None:
    """The `EXPERT_PROJECTIONS` name of a routed expert's linear entry (`linear_fc1`: `experts.gate_up_proj`,
    `linear_fc2`: `experts.down_proj`); None for any other entry."""
    if not is_expert(entry):
        return None
    if entry.mcore.endswith(".linear_fc1.weight"):
        return EXPERT_PROJECTIONS[0]
    if entry.mcore.endswith(".linear_fc2.weight"):
        return EXPERT_PROJECTIONS[1]
    return None


def fused_expert_template(entry: Entry, model_cfg: ModelSpec) -> str:
    """The transformers-5 fused tensor (template with `{layer}`) an expert entry's HF tensors are parts of, which
    PEFT's `target_parameters` adapter sits on. ValueError: an architecture whose fused experts are not plain
    `[experts, out, in]` tensors (`gate_up_proj` = [gate; up] rows, `down_proj` whole)."""
    target = expert_target(entry)
    rules = model_cfg.arch.fused_experts or {}
    parts = ("gate", "up") if target == EXPERT_PROJECTIONS[0] else ("all",)
    fused = {rules.get(source, (None, None))[0] for source in entry.hf_sources}
    found = tuple(rules.get(source, (None, None))[1] for source in entry.hf_sources)
    (template,) = fused if len(fused) == 1 else (None,)
    if template is None or found != parts or not template.endswith(f".{target}"):
        raise ValueError(
            f"LoRA on {target} of {model_cfg.architecture}: its experts are not plain fused [experts, out, in]"
            f" tensors (transformers' {template} as {found}); adapters on them are not implemented"
        )
    return template


def expert_name(fused: str, expert: int) -> str:
    """The name of one expert's adapter: the fused HF tensor and the global expert, `...experts.gate_up_proj[3]`."""
    return f"{fused}[{expert}]"
