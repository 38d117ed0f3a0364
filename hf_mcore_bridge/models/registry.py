"""The explicit registry of architectures: one file per architecture in `mappings/`, looked up by the HF
`architectures` entry (or, where a config has none, its `model_type`); and the vision-language wrappers whose
language model is one of them (`WRAPPERS`, `models.vision_language`).

Conversion, export, verify, the engine, the DTensor path and the trainer all find an architecture here; nothing
registers itself by being imported. Adding an architecture: its file in `mappings/` and one line in `REGISTRY`
(`docs/adding-an-architecture.md`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hf_mcore_bridge.errors import UnsupportedArchitectureError
from hf_mcore_bridge.mappings import (
    deepseek_v3,
    gemma3,
    glm4_moe,
    glm4_moe_lite,
    gpt_oss,
    kimi_k25,
    llama,
    mistral,
    mixtral,
    qwen2,
    qwen2_moe,
    qwen3,
    qwen3_5,
    qwen3_5_moe,
    qwen3_moe,
    qwen3_next,
)
from hf_mcore_bridge.models.architecture import Architecture, Switch
from hf_mcore_bridge.models.config_errors import ConfigError
from hf_mcore_bridge.models.mapping_types import Feature
from hf_mcore_bridge.models.moe import MoeSpec
from hf_mcore_bridge.models.vision_language import VisionLanguage

REGISTRY: dict[str, Architecture] = {
    arch.hf_name: arch
    for arch in (
        llama.ARCHITECTURE,
        mistral.ARCHITECTURE,
        qwen2.ARCHITECTURE,
        qwen3.ARCHITECTURE,
        mixtral.ARCHITECTURE,
        qwen3_moe.ARCHITECTURE,
        qwen2_moe.ARCHITECTURE,
        glm4_moe.ARCHITECTURE,
        deepseek_v3.ARCHITECTURE,
        glm4_moe_lite.ARCHITECTURE,
        gpt_oss.ARCHITECTURE,
        gemma3.ARCHITECTURE,
        qwen3_5.ARCHITECTURE,
        qwen3_5_moe.ARCHITECTURE,
        qwen3_next.ARCHITECTURE,
    )
}

WRAPPERS: dict[str, VisionLanguage] = {
    name: wrapper
    for wrapper in (kimi_k25.WRAPPER, gemma3.WRAPPER, qwen3_5.WRAPPER, qwen3_5_moe.WRAPPER)
    for name in wrapper.names()
}
"""Vision-language classes (every `architectures` name of each) whose language model converts."""


def wrapper_for(config: Mapping[str, Any]) -> VisionLanguage | None:
    """The vision-language wrapper a config (dict) is of: by its `architectures` entry, else its `model_type`."""
    names = config.get("architectures") or []
    for name in names:
        if name in WRAPPERS:
            return WRAPPERS[name]
    if not names:
        return next((w for w in WRAPPERS.values() if w.model_type == config.get("model_type")), None)
    return None


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The config of the language model: a wrapper's `text_config`, or the config itself."""
    wrapper = wrapper_for(config)
    return config if wrapper is None else wrapper.text_config(config)


def supported() -> list[str]:
    """The HF `architectures` names that can be converted (vision-language ones: their language model)."""
    return sorted({*REGISTRY, *WRAPPERS})


def get_architecture(hf_name: str) -> Architecture:
    """The architecture registered for an HF `architectures` entry."""
    try:
        return REGISTRY[hf_name]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"unsupported architecture {hf_name!r}; supported: {', '.join(supported())}"
        ) from None


def for_config(config: Mapping[str, Any]) -> Architecture:
    """The architecture of an HF config (dict): by its `architectures` entry, else (no such list) its
    `model_type`."""
    names = config.get("architectures") or []
    for name in names:
        if name in REGISTRY:
            return REGISTRY[name]
    by_type = {kind: arch for arch in REGISTRY.values() for kind in (arch.model_type, *arch.other_model_types)}
    if not names and config.get("model_type") in by_type:
        return by_type[config["model_type"]]
    named = ", ".join(repr(name) for name in names) if names else repr(config.get("model_type"))
    raise UnsupportedArchitectureError(f"unsupported architecture {named}; supported: {', '.join(supported())}")


def _writes(arch: Architecture, experts: MoeSpec) -> bool:
    """Whether the architecture's config can state this mixture of experts."""
    if arch.moe_to_hf is None:
        return False
    try:
        arch.moe_to_hf(experts)
    except ConfigError:
        return False
    return True


def with_features(
    *,
    moe: bool,
    shared_expert: bool,
    qk_norm: bool,
    qkv_bias: bool,
    score_function: str = "softmax",
    mla: bool = False,
    experts: MoeSpec | None = None,
    post_norms: bool = False,
    linear_attention: bool = False,
) -> Architecture:
    """The first registered architecture with these features, for Megatron `args` that name none (a checkpoint
    Megatron-LM wrote): plain dense is Llama, plain MoE Mixtral, multi-latent attention DeepSeek-V3. An optional
    part counts where the architecture's table has its tensors; one its config switches (`Switch`, GLM-4.5's q/k
    norms) matches either value. `experts`: the first of them whose config can state this mixture of experts
    (`moe_to_hf`) comes first: MoE layers around a dense one are GLM-4.7-Flash's `mlp_layer_types`, which
    DeepSeek-V3's `first_k_dense_replace` cannot say. `post_norms`: Gemma 3's norms after attention and MLP must
    match the architecture's, and so must Gated DeltaNet layers (`linear_attention`)."""

    def matches(arch: Architecture, switch: Switch, feature: Feature, wanted: bool) -> bool:
        if wanted:
            return switch is not False and arch.table_has(feature)
        return switch is not True

    found = [
        arch
        for arch in REGISTRY.values()
        if (arch.is_moe, arch.has_shared_expert, arch.multi_latent) == (moe, shared_expert, mla)
        and matches(arch, arch.qk_norm, Feature.QK_NORM, qk_norm)
        and matches(arch, arch.qkv_bias, Feature.QKV_BIAS, qkv_bias)
        and (not moe or arch.score_function == score_function)
        and arch.post_norms == post_norms
        and arch.linear_attention == linear_attention
    ]
    writers = [arch for arch in found if experts is None or _writes(arch, experts)]
    if writers or found:  # where none can state the experts, the first: its export refuses them by field name
        return (writers or found)[0]
    raise UnsupportedArchitectureError(
        f"no supported architecture has moe={moe}, shared expert={shared_expert}, qk_norm={qk_norm}, "
        f"qkv_bias={qkv_bias}"
        + (f", {score_function} router" if moe else "")
        + (", multi-latent attention" if mla else "")
        + (", post-norms" if post_norms else "")
        + (", Gated DeltaNet layers" if linear_attention else "")
        + "; pass --hf-config"
    )
