"""The engine's view of a model: what its shared decoder runs, and which engine parameter each HF tensor fills.

The model is the description every part of the project reads (`models.spec.ModelSpec`, read once from the HF
config); `read_spec` reads it and refuses what the engine's decoder cannot run (`require_runnable`). Every
supported architecture is the same pre-norm decoder (RMSNorm, rotary attention with grouped KV heads or
multi-latent attention, on a hybrid model Gated DeltaNet linear attention on most layers, SiLU-gated MLP or a
mixture of SiLU-gated or clamped-SwiGLU experts); what differs lives in the architecture's file in `mappings/` and
reaches the engine through the spec (its biases, q/k norms, router) and the architecture's table.

The engine loads the architecture's mapping table itself: each entry's HF names are the names the engine loads,
and the engine's parameters carry HF's names, so no second name table exists. An entry's parameter follows from
its type (`engine_param`): a `Direct` or `RotaryRows` entry fills the parameter of its HF name; a `FusedQKV` entry
fills `qkv_proj` beside its q/k/v sources (HF's q, k, v order, unlike megatron-core's interleaving), a dense
`FusedGateUp` entry `gate_up_proj` beside gate and up (vLLM's names for both); a routed expert's tensors fill slice
`[expert]` of a parameter stacked over a leading expert axis, named as transformers 5 holds it in memory
(`Architecture.fused_experts`: `mlp.experts.gate_up_proj` [E, 2F, H], gate rows then up rows;
`mlp.experts.down_proj` [E, H, F]). Each keeps the entry's tensor-parallel style (`parallel_style.Parallel`).
Biases the model has where the table has none (Llama's `attention_bias`, which conversion refuses) get names
derived from their weights' (`layer_entries`).

Simplifications and how to extend:
- Mixture of experts: softmax routing over all experts, then top-k (Mixtral, Qwen2-MoE, Qwen3-MoE), or sigmoid
  scores with a per-expert score bias, group-limited top-k and a scaling factor (GLM-4.5, DeepSeek-V3): one routing
  function, `model.route`, driven by `MoeSpec`. `router_jitter_noise` and the auxiliary load-balancing loss are
  training-only and ignored.
- Multi-token-prediction layers (`num_nextn_predict_layers`) are not used: their tensors are skipped on load
  (`ignored_prefixes`); the trainer's policy is built without them too (`convert.mtp`).
- Experts load from HF's per-expert names (the layout saved on the Hub) and from the fused in-memory names of a
  transformers-5 model: `fused_expert_pieces` splits those into the per-expert names with the architecture's own
  rules (`Architecture.fused_experts`), so there is one name table.
- RoPE types: default, linear, llama3 and YaRN (its correction range truncated or not, `truncate`), each also
  partial (`partial_rotary_factor`: the first `int(head_dim * factor)` dimensions of each head rotate); one set for
  every layer. Others (dynamic, longrope) are refused, not approximated.
- Sliding windows are per layer (`layer_window`: the layers `layer_types` marks `sliding_attention` get the
  config's window) and attention sinks per query head (GPT-OSS's `self_attn.sinks`); the attention kernels take
  any window per layer. A window over layers `layer_types` does not mark (Mistral v0.1's) is refused within
  `max_model_len` (`engine.Engine`), and so are layer types other than full and sliding attention.
- Hybrid models (Qwen3.5): the layers `layer_types` marks `linear_attention` run Gated DeltaNet
  (`gated_delta.GatedDeltaNet`, its parameters under HF's names: each HF tensor of a linear layer fills the
  parameter of its own name, split under tensor parallelism by `gated_delta.linear_attn_shards`, sectioned for
  `in_proj_qkv` and `conv1d`), and the table entries marked for the other layer type are left out of each layer
  (`layer_entries`). A `GatedQKV` entry fills `qkv_proj` as `FusedQKV` does, its q rows each head's query then
  gate. Qwen3-Next's input projections fused per key head (`GroupedLinearInProj`) load as they are and are split
  in the layer (`gated_delta.split_fused`).
- A biased router (GPT-OSS's `mlp.router.bias`) adds its bias to the logits; top-k of the softmax over all experts,
  renormalised, picks the experts and weights of transformers' top-k-then-softmax (equal to rounding).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from hf_mcore_bridge.checkpoint.names import fill
from hf_mcore_bridge.errors import UnsupportedArchitectureError
from hf_mcore_bridge.models.architecture import Architecture
from hf_mcore_bridge.models.config_errors import ConfigError
from hf_mcore_bridge.models.mapping_types import (
    Direct,
    Entry,
    FusedGateUp,
    FusedQKV,
    GatedQKV,
    GroupedLinearInProj,
    LayerKind,
    LinearInProj,
    Size,
    is_expert,
)
from hf_mcore_bridge.models.parallel_style import Parallel
from hf_mcore_bridge.models.registry import REGISTRY
from hf_mcore_bridge.models.spec import FULL_ATTENTION, LINEAR_ATTENTION, SLIDING_ATTENTION, ModelSpec

ARCHITECTURES: Mapping[str, Architecture] = REGISTRY
"""The registry the engine serves: every architecture in `mappings/`."""

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
"""The RoPE types the engine computes (`model.rope_inv_freq`)."""


def read_spec(hf_config: Any) -> ModelSpec:
    """The description of an HF config (a `PretrainedConfig` or its dict) that the engine runs.

    Raises `NotImplementedError` for an architecture or a feature the decoder does not implement, `ValueError` for
    a config the description cannot be read from (the engine's errors, as vLLM's are)."""
    try:
        spec = ModelSpec.from_hf(hf_config)
    except UnsupportedArchitectureError as err:
        raise NotImplementedError(str(err)) from None
    except ConfigError as err:
        raise ValueError(str(err)) from None
    require_runnable(spec)
    return spec


HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")
"""The gated MLP activations the engine computes (`gelu_pytorch_tanh`: Gemma's GeGLU)."""


def require_runnable(spec: ModelSpec) -> None:
    """Refuse (`NotImplementedError`) what the shared decoder would compute otherwise than transformers."""
    if spec.linear_attention is not None and spec.hidden_act != "silu":
        raise NotImplementedError(f"{spec.architecture}: Gated DeltaNet is implemented with hidden_act 'silu' only")
    if spec.hidden_act not in HIDDEN_ACTS:
        raise NotImplementedError(f"hidden_act={spec.hidden_act!r}: only {', '.join(HIDDEN_ACTS)} are implemented")
    if spec.moe is not None and spec.hidden_act != "silu":
        raise NotImplementedError(f"hidden_act={spec.hidden_act!r}: experts are implemented with 'silu' only")
    if spec.mlp_bias:
        raise NotImplementedError("mlp_bias=True is not implemented")
    kinds = {FULL_ATTENTION, SLIDING_ATTENTION} | ({LINEAR_ATTENTION} if spec.linear_attention is not None else set())
    unknown = sorted(set(spec.layer_types) - kinds)
    if unknown:
        raise NotImplementedError(
            f"layer_types {unknown}: only full, sliding and (with Gated DeltaNet) linear attention layers are "
            "implemented"
        )
    rope = spec.rope
    if rope.rope_type not in ROPE_TYPES:
        raise NotImplementedError(f"rope_type={rope.rope_type!r}: only {', '.join(ROPE_TYPES)} are implemented")
    if rope.rope_type in ("llama3", "yarn") and rope.original_max_position_embeddings is None:
        raise ValueError(f"rope_type={rope.rope_type!r} needs rope_scaling.original_max_position_embeddings")
    if spec.mla is not None and (spec.qkv_bias or spec.o_bias):
        raise NotImplementedError("attention_bias=True is not implemented for multi-latent attention")


QKV_PROJ = "qkv_proj"
"""The engine's fused q/k/v projection, beside HF's `q_proj`, `k_proj`, `v_proj`."""
GATE_UP_PROJ = "gate_up_proj"
"""The engine's fused gate/up projection of a dense MLP, beside HF's `gate_proj` and `up_proj`."""
LAYER = "model.layers.{layer}"
O_PROJ = ".self_attention.linear_proj.weight"
"""megatron-core's name of the attention's output projection (the end of its table entry's `mcore`)."""


def _beside(name: str, module: str) -> str:
    """`name` with its module (the component before the parameter's) replaced: `...q_proj.weight` ->
    `...qkv_proj.weight`."""
    *path, _, leaf = name.split(".")
    return ".".join((*path, module, leaf))


def fused_linear_projections(spec: ModelSpec) -> bool:
    """Whether a hybrid model's Gated DeltaNet input projections are Qwen3-Next's, fused per key head."""
    return any(isinstance(entry, GroupedLinearInProj) for entry in spec.table())


def in_memory_name(arch: Architecture, name: str) -> str:
    """transformers 5's in-memory name of a checkpoint tensor (`Architecture.fused_experts`), else the name."""
    fused = (arch.fused_experts or {}).get(name)
    return name if fused is None else fused[0]


def engine_param(arch: Architecture, entry: Entry) -> str:
    """The engine parameter that a table entry's HF tensors fill (with the entry's placeholders)."""
    if isinstance(entry, FusedQKV | GatedQKV):
        return _beside(entry.q, QKV_PROJ)
    if isinstance(entry, LinearInProj | GroupedLinearInProj):
        raise AssertionError(f"{entry.mcore}: each HF projection of Gated DeltaNet fills its own parameter")
    if isinstance(entry, FusedGateUp):
        return in_memory_name(arch, entry.gate) if is_expert(entry.gate) else _beside(entry.gate, GATE_UP_PROJ)
    param = in_memory_name(arch, entry.hf)
    if is_expert(param):
        raise NotImplementedError(f"{arch.hf_name} declares no stacked in-memory name for {entry.hf} (fused_experts)")
    return param


def layer_window(spec: ModelSpec, layer: int) -> int | None:
    """The attention window of decoder layer `layer`: a query at position p sees keys at p - window + 1 .. p
    (transformers' `sliding_window_overlay`); None: every earlier position. One window for the layers `layer_types`
    marks sliding (`ModelSpec.sliding_window`); the attention kernels take any window per layer."""
    if spec.sliding_window is None or spec.layer_types[layer] != SLIDING_ATTENTION:
        return None
    return spec.sliding_window


def router_module(spec: ModelSpec) -> str:
    """The name of a MoE layer's router module, as the table names it (`gate`; GPT-OSS's `router`)."""
    for entry in spec.table():
        if isinstance(entry, Direct) and entry.mcore.endswith(".mlp.router.weight"):
            return entry.hf.split(".")[-2]
    raise AssertionError(f"{spec.architecture}'s table names no router weight")


def shared_expert_module(spec: ModelSpec) -> str | None:
    """The name of a MoE layer's shared expert module, as the table names it (`shared_expert`, GLM-4.5's and
    DeepSeek-V3's `shared_experts`); None without one."""
    for entry in spec.table():
        if isinstance(entry, FusedGateUp) and entry.width is Size.SHARED_FFN:
            return entry.gate.split(".")[-3]
    return None


def layer_entries(spec: ModelSpec, kind: LayerKind, attention: str = FULL_ATTENTION) -> tuple[Entry, ...]:
    """Every table entry of a model whose decoder layers have `kind` MLPs (DENSE or MOE) and `attention` layer type
    (entries marked for another layer type left out), with the model's own (embedding, final norm, output layer),
    plus the biases the model has where the table has none: the q/k/v
    biases beside the q/k/v weights' entry, the o_proj bias beside its weight (whole on every rank: it is added
    after the row-parallel sum)."""
    table = [e for e in spec.table() if e.layers in (LayerKind.ALL, kind) and _in_layer(e, attention)]
    qkv = next((e for e in table if isinstance(e, FusedQKV)), None)
    biased = any(isinstance(e, FusedQKV) and e.q.endswith(".bias") for e in table)
    if qkv is not None and spec.qkv_bias and not biased:
        names = {field: _bias_of(getattr(qkv, field)) for field in ("mcore", "q", "k", "v")}
        table.append(replace(qkv, **names, tail=()))
    if spec.o_bias and not any(e.hf_sources[0].endswith("o_proj.bias") for e in table):
        o_proj = next(e for e in table if isinstance(e, Direct) and e.mcore.endswith(O_PROJ))
        names = {"mcore": _bias_of(o_proj.mcore), "hf": _bias_of(o_proj.hf)}
        table.append(replace(o_proj, **names, shape=(Size.HIDDEN,), parallel=Parallel.REPLICATED))
    return tuple(table)


def _in_layer(entry: Entry, attention: str) -> bool:
    """Whether a layer of `layer_types` kind `attention` has the entry (a sliding layer has a full one's)."""
    only = getattr(entry, "attention", None)
    return only is None or only == (LINEAR_ATTENTION if attention == LINEAR_ATTENTION else FULL_ATTENTION)


def _bias_of(weight_name: str) -> str:
    return weight_name.removesuffix(".weight") + ".bias"


def ignored_prefixes(spec: ModelSpec) -> tuple[str, ...]:
    """HF name prefixes accepted and dropped: the multi-token-prediction layers after the decoder layers."""
    return tuple(f"model.layers.{spec.num_layers + k}." for k in range(spec.mtp_layers))


def ignored_names(spec: ModelSpec) -> tuple[str, ...]:
    """HF names accepted and dropped: a tied output layer, and rotary buffers that old checkpoints saved."""
    names = [f"{LAYER}.self_attn.rotary_emb.inv_freq"]
    if spec.tie_word_embeddings:
        names.append("lm_head.weight")
    return tuple(names)


@dataclass(frozen=True)
class FusedPiece:
    """One per-expert HF tensor inside a fused transformers-5 tensor."""

    name: str
    """The per-expert HF name it stands for (a name the engine loads)."""
    expert: int | None
    """Index on the fused tensor's leading expert axis; None: the fused tensor is the piece (a renamed router)."""
    part: str
    """`gate` / `up`: the first / second half of the rows (after the expert index); `all`: every row."""


def fused_expert_pieces(spec: ModelSpec) -> dict[str, tuple[FusedPiece, ...]]:
    """transformers-5 in-memory name -> the per-expert tensors it holds, for every MoE layer of `spec`.

    Derived from the architecture's `fused_experts` rules (per-expert template -> fused template, part); {} for a
    dense model or an architecture without such rules.
    """
    if spec.moe is None:
        return {}
    rules = spec.arch.fused_experts or {}
    pieces: dict[str, list[FusedPiece]] = {}
    for layer in (index for index, routed in enumerate(spec.moe.moe_layers) if routed):
        for template, (fused_template, part) in rules.items():
            experts = range(spec.moe.num_experts) if is_expert(template) else (None,)
            for expert in experts:
                fused = fill(fused_template, layer, expert)
                pieces.setdefault(fused, []).append(FusedPiece(fill(template, layer, expert), expert, part))
    return {name: tuple(found) for name, found in pieces.items()}
