"""LoRA adapters applied by the engine's own linears, so that a LoRA run's refit streams the adapters alone.

`add_adapters(model, targets, rank, scale)` gives each dense attention or MLP linear of a `CausalLM` that computes a
targeted HF projection (`q_proj`, `k_proj`, `v_proj` in the fused `qkv_proj`; `o_proj`; `gate_proj`, `up_proj` in
the fused `gate_up_proj`; `down_proj`) two more parameters, filled like every weight by `load_weights`, under
PEFT's tensor names without its `base_model.model.` prefix (`adapter_names`):

- `lora_a` [projections x rank, in]: the A (rank x in) of projection j in rows j * rank ...; whole on every
  tensor-parallel rank where the linear is column-parallel (its input is whole), the rank's input columns where it
  is row-parallel (`o_proj`, `down_proj`: the weight's own column shard);
- `lora_b` [out, projections x rank]: the B (out x rank) of projection j in the rows its weight fills
  (`Target.rows`, cut by the weight's row shard) and columns j * rank ...; zero elsewhere (a block-diagonal B in
  the linear's row order, `model.LORA_B`); whole on a row-parallel linear.

The linear then computes W x + scale * lora_b (lora_a x) (`layers.Linear.matmul`; the FP8 copy of W where set),
before a row-parallel layer's all-reduce, which sums the partial products with W's: the trainer's own
unmerged form (`megatron.lora`), so no merged weight is ever rounded to the engine's dtype. The parameters exist
from start-up, so captured decode graphs include them and a refit fills them in place.

Assumes: the projections of the model's dense `Attention` and `MLP` modules only. A target on anything else
(routed or shared experts, multi-latent attention, Gated DeltaNet, a model without such a projection) is a
ValueError naming it.
"""

from __future__ import annotations

import re
from collections.abc import Collection

import torch
from torch import nn

from hf_mcore_bridge.engine.layers import Linear, RowLinear
from hf_mcore_bridge.engine.model import LORA_B, MLP, Attention, CausalLM, Target

__all__ = ["adapter_names", "add_adapters"]

_WEIGHT = re.compile(r"^(?P<module>.+\.layers\.\d+\.(?:self_attn|mlp)\.(?P<projection>[a-z_]+))\.weight$")
"""An HF weight of a decoder layer's attention or MLP projection."""


def adapter_names(module: str) -> tuple[str, str]:
    """PEFT's names (without its prefix) of the A and B of HF module `module` (`model.layers.0.self_attn.q_proj`)."""
    return f"{module}.lora_A.weight", f"{module}.lora_B.weight"


def add_adapters(model: CausalLM, targets: Collection[str], rank: int, scale: float) -> list[str]:
    """Adapters of `rank` (product scaled by `scale`) on every projection of `model` whose HF name ends in one of
    `targets` (`q_proj`, ...), zero until loaded; returns their HF tensor names. ValueError: a target the engine
    cannot adapt, or none found."""
    if rank < 1:
        raise ValueError(f"LoRA rank {rank}: must be >= 1")
    per_linear: dict[str, list[tuple[str, Target]]] = {}
    for name, target in model.targets.items():
        match = _WEIGHT.match(name)
        if match is not None and match["projection"] in targets:
            per_linear.setdefault(target.param.removesuffix(".weight"), []).append((match["module"], target))
    if not per_linear:
        raise ValueError(f"LoRA: no projection of {model.cfg.architecture} matches {sorted(targets)} in the engine")
    added: dict[str, Target] = {}
    for path, projections in per_linear.items():
        linear = model.get_submodule(path)
        owner = model.get_submodule(path.rsplit(".", 1)[0])
        if not isinstance(linear, Linear) or not isinstance(owner, Attention | MLP):
            raise ValueError(
                f"LoRA on {projections[0][0]}: the engine applies adapters on dense attention and MLP projections only"
            )
        row = isinstance(linear, RowLinear)
        out_rows, columns = linear.weight.shape
        width = len(projections) * rank
        place = {"dtype": linear.weight.dtype, "device": linear.weight.device}
        linear.lora_a = nn.Parameter(torch.zeros(width, columns, **place), requires_grad=False)
        linear.lora_b = nn.Parameter(torch.zeros(out_rows, width, **place), requires_grad=False)
        linear.lora_scale = scale
        model._shapes[f"{path}.lora_a"] = (width, columns)
        model._shapes[f"{path}{LORA_B}"] = (out_rows, width)
        for j, (module, weight) in enumerate(projections):
            block = (j * rank, (j + 1) * rank)
            a_name, b_name = adapter_names(module)
            added[a_name] = Target(f"{path}.lora_a", block, shard=weight.shard if row else None)
            added[b_name] = Target(f"{path}{LORA_B}", weight.rows, shard=None if row else weight.shard, cols=block)
    model.targets.update(added)
    return list(added)
