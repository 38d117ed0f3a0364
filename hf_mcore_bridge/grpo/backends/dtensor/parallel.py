"""Sharding a HuggingFace causal LM with DTensor: tensor parallelism, then FSDP2 (`fully_shard`).

`make_mesh` builds the 2-D device mesh ("dp_shard", "tp"); `parallelize_hf_model` shards a transformers model over
it in place; `hf_state_entries` lists its tensors under their HF names (the policy gathers them whole); `clip_grad_norm`
clips gradients that live on more than one mesh.

Assumptions, checked where cheap:
- The model is a Llama-family transformers causal LM of a registered architecture (`mappings/`): decoder layers in
  `model.model.layers`; dense under TP (FSDP2 alone also shards a mixture-of-experts model, its fused experts as any
  parameter); the TP plan comes from the architecture's mapping table (`layer_tp_plan`). The attention
  reshapes its projections with `-1` heads, so it runs on the local heads of a TP shard unchanged; `tp` must divide the
  number of key/value heads and the MLP width.
- Under TP only the attention and MLP projections are sharded (column-wise q/k/v/gate/up, row-wise o/down, the
  Megatron pattern); embeddings, norms and the LM head stay replicated over "tp" and are sharded by FSDP over
  "dp_shard" only. The logits are therefore full-vocabulary on every rank. With PEFT's LoRA on a projection, its
  `base_layer` takes the projection's style and the adapter is split as PEFT splits it for Megatron (`lora_plan`).
- The model's parameters are the master weights (fp32 for bf16 training): FSDP2 casts them to `param_dtype` for
  compute and reduces gradients in `reduce_dtype`, while the optimizer steps on the sharded fp32 parameters.
- Activation checkpointing is transformers' own (`activation_checkpointing_enable`, before 5.24
  `gradient_checkpointing_enable`; non-reentrant), so parameter names stay HF names; FSDP2 skips its forward hooks
  during recomputation, which composes with it.
- The process group is initialised by the caller, with `dp_shard * tp` ranks. CPU worlds (gloo) need no
  workaround: `fully_shard`, `parallelize_module` and DTensor collectives run there as they are (torch 2.13).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from hf_mcore_bridge.errors import BridgeError
from hf_mcore_bridge.models.architecture import Architecture
from hf_mcore_bridge.models.parallel_style import Parallel
from hf_mcore_bridge.models.spec import ModelSpec

_STYLES = {Parallel.COLUMN: ColwiseParallel, Parallel.GATED_COLUMN: ColwiseParallel, Parallel.ROW: RowwiseParallel}
_HF_LAYER = "model.layers.{layer}."


def layer_tp_plan(arch: Architecture) -> dict[str, type[ParallelStyle]]:
    """Module (relative to a decoder layer) -> its DTensor style, from the architecture's mapping table: the
    q/k/v and gate/up projections column-wise, o and down row-wise, as megatron-core shards them (the Megatron
    pattern); norms stay replicated. Biases shard with their module."""
    if arch.linear_attention:
        raise BridgeError(f"tensor parallelism over DTensor is not planned for {arch.hf_name}'s Gated DeltaNet")
    plan: dict[str, type[ParallelStyle]] = {}
    for entry in arch.table:
        if entry.parallel not in _STYLES:
            continue
        for name in entry.hf_sources:
            if name.startswith(_HF_LAYER):
                plan[name.removeprefix(_HF_LAYER).rsplit(".", 1)[0]] = _STYLES[entry.parallel]
    return plan


def make_mesh(dp_shard: int, tp: int, device_type: str) -> DeviceMesh:
    """The ("dp_shard", "tp") mesh over an initialised world of `dp_shard * tp` ranks; TP ranks are adjacent."""
    return init_device_mesh(device_type, (dp_shard, tp), mesh_dim_names=("dp_shard", "tp"))


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers of a Llama-family causal LM (`model.model.layers`)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise BridgeError(f"{type(model).__name__} has no model.layers; DTensor sharding expects a Llama-family model")
    return layers


def _architecture(model: torch.nn.Module, tp: int) -> Architecture:
    """The architecture of a transformers model, refused unless its description (`ModelSpec`) is dense and its
    heads, key/value heads and MLP width divide by `tp`."""
    spec = ModelSpec.from_hf(model.config)
    if spec.moe is not None:
        raise BridgeError(
            f"tensor parallelism over DTensor is for dense models; {spec.architecture} has routed experts"
        )
    if spec.linear_attention is not None:
        raise BridgeError(f"tensor parallelism over DTensor is not planned for {spec.architecture}'s Gated DeltaNet")
    for field, value in (
        ("num_attention_heads", spec.num_attention_heads),
        ("num_key_value_heads", spec.num_query_groups),
        ("intermediate_size", spec.ffn_hidden_size),
    ):
        if value % tp:
            raise BridgeError(f"{field}={value} is not divisible by tensor_parallel_size={tp}")
    return spec.arch


def apply_tensor_parallel(model: torch.nn.Module, tp_mesh: DeviceMesh) -> None:
    """Shard each decoder layer's projections over `tp_mesh` (column-wise in, row-wise out); a projection that
    PEFT's LoRA wraps as `lora_plan` shards it."""
    plan = layer_tp_plan(_architecture(model, tp_mesh.size()))
    for layer in decoder_layers(model):
        styles: dict[str, ParallelStyle] = {}
        for name, style in plan.items():
            styles |= lora_plan(name, layer.get_submodule(name), style)
        parallelize_module(layer, tp_mesh, styles)


def lora_plan(name: str, module: torch.nn.Module, style: type[ParallelStyle]) -> dict[str, ParallelStyle]:
    """The TP plan of the projection `name` (relative to its layer): its own style, or for a PEFT LoRA layer
    (`base_layer`, `lora_A`, `lora_B`) the base layer's, with the adapter split as PEFT's Megatron LoRA
    (`LoraParallelLinear`) splits it: a column-parallel base takes B column-wise (its output rows, each rank the
    rows of its part of W) and A whole; a row-parallel base takes A row-wise (its input columns, the part of x this
    rank holds; the partial A x all-reduced) and B whole. The whole factors stay plain tensors on every TP rank
    (FSDP2 shards them over "dp_shard" only): their inputs and output gradients are the same on every TP rank
    (a column-parallel input's gradient all-reduced as the base's is), so are their gradients."""
    if not (hasattr(module, "base_layer") and hasattr(module, "lora_A") and hasattr(module, "lora_B")):
        return {name: style()}
    plan: dict[str, ParallelStyle] = {f"{name}.base_layer": style()}
    factor = "lora_B" if style is ColwiseParallel else "lora_A"
    for adapter in getattr(module, factor):
        plan[f"{name}.{factor}.{adapter}"] = style()
    return plan


def parallelize_hf_model(
    model: torch.nn.Module,
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype = torch.float32,
    activation_checkpointing: bool = False,
) -> None:
    """Shard `model` in place: TP over mesh["tp"] (if > 1), activation checkpointing, FSDP2 over mesh["dp_shard"].

    Each decoder layer is its own FSDP unit (all-gathered just before use, freed after); the root unit holds the
    embeddings, final norm and LM head and stays unsharded after forward since backward needs it first.
    """
    if mesh["tp"].size() > 1:
        apply_tensor_parallel(model, mesh["tp"])
    if activation_checkpointing:
        # transformers renamed gradient_checkpointing_enable (deprecated since 5.24) to activation_checkpointing_enable
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable({"use_reentrant": False})
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    dp_mesh = mesh["dp_shard"]
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=dp_mesh, mp_policy=policy)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=False)


def hf_state_entries(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The state dict's `(hf_name, value)` pairs, sharded values as they are, a tied tensor under its first name only
    (the state dict lists a shared parameter under each of its names)."""
    seen: set[int] = set()
    entries = []
    for name, value in model.state_dict().items():
        if id(value) not in seen:
            seen.add(id(value))
            entries.append((name, value))
    return entries


def clip_grad_norm(parameters: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Scale the gradients so that their global L2 norm is at most `max_norm`; returns the norm before clipping.

    `torch.nn.utils.clip_grad_norm_` stacks the per-tensor norms, which DTensor refuses across meshes: with TP the
    projections live on the 2-D mesh and the replicated tensors on mesh["dp_shard"]. So the norm is taken per mesh
    (each a `get_total_norm` over DTensors, made whole with `full_tensor`) and the parts combined.
    """
    groups: dict[object, list[torch.nn.Parameter]] = {}
    for param in parameters:
        if param.grad is not None:
            mesh = param.grad.device_mesh if isinstance(param.grad, DTensor) else None
            groups.setdefault(mesh, []).append(param)
    norms = []
    for params in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())
    for params in groups.values():  # one mesh per call: DTensor's foreach ops refuse mixed meshes too
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
