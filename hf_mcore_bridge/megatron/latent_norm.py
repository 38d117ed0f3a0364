"""Multi-latent attention's latent norms at the epsilon transformers gives them, in megatron-core's layer specs.

transformers' DeepSeek-V3 family (`deepseek_v3`, `glm4_moe_lite`, Kimi-K2.5's language model) builds the query and
key/value latents' RMSNorms (`q_a_layernorm`, `kv_a_layernorm`) with a fixed epsilon (`ModelSpec.latent_norm_eps`,
1e-6) whatever `rms_norm_eps` says; megatron-core's `MLASelfAttention` builds them with `config.layernorm_epsilon`
(its `rms_norm_eps`). `use_latent_norm_eps` puts `LatentEpsilon` in their place in a layer spec: it builds the
module the spec named, the same class with the same parameters (checkpoints are unchanged), with the latent
epsilon instead. Where the norm is a module of its own (the local spec, `q_layernorm` / `kv_layernorm`) it gets
that `eps`; where Transformer Engine fuses it into the following linear layer (`linear_q_up_proj` /
`linear_kv_up_proj`, which read `config.layernorm_epsilon` when built) that layer is built from a copy of the
config holding the latent epsilon, then given the model's own config back (the epsilon is taken at construction;
the config's other fields may be read or changed later).

Megatron-LM's own layer specs do not do this: a model it builds from the same config runs its latent norms at
`rms_norm_eps` (conversion says so in a note, `config_bridge.latent_norm_note`).
"""

from __future__ import annotations

import copy
from typing import Any

__all__ = ["LatentEpsilon", "use_latent_norm_eps"]

NORMS = ("q_layernorm", "kv_layernorm")
"""The local spec's latent norms (`MLASelfAttentionSubmodules`)."""
FUSED_NORM_LINEARS = ("linear_q_up_proj", "linear_kv_up_proj")
"""Transformer Engine's: the latent norms fused into the up-projections (`TELayerNormColumnParallelLinear`)."""


class LatentEpsilon:
    """Builds `base` (a norm, or a norm fused into a linear layer) as megatron-core would, at `latent_eps`.

    Like megatron-core's `WrappedTorchNorm`, a class whose construction returns the module built: a layer spec
    names it in a `ModuleSpec` whose `params` give `base` and `latent_eps`."""

    def __new__(cls, *args: Any, base: Any, latent_eps: float, config: Any, **kwargs: Any) -> Any:
        from megatron.core.transformer.spec_utils import build_module

        if "eps" in kwargs:  # a norm of its own: megatron-core passes `config.layernorm_epsilon` as `eps`
            kwargs["eps"] = latent_eps
        latent_config = copy.copy(config)
        latent_config.layernorm_epsilon = latent_eps
        module = build_module(base, *args, config=latent_config, **kwargs)
        if getattr(module, "config", None) is latent_config:
            module.config = config
        return module


def use_latent_norm_eps(spec: Any, latent_eps: float) -> Any:
    """Give the latent norms of every multi-latent-attention layer of `spec` (a layer's `ModuleSpec` or a
    `TransformerBlockSubmodules`) the epsilon `latent_eps`: their own modules where the spec builds them, else
    the up-projections Transformer Engine fuses them into."""
    from megatron.core.transformer.identity_op import IdentityOp

    for layer in getattr(spec, "layer_specs", None) or [spec]:
        attention = getattr(layer.submodules.self_attention, "submodules", None)
        if attention is None or not hasattr(attention, "kv_layernorm"):
            continue  # not multi-latent attention
        fused = attention.kv_layernorm is IdentityOp
        for name in FUSED_NORM_LINEARS if fused else NORMS:
            setattr(attention, name, _latent(getattr(attention, name), latent_eps))
    return spec


def _latent(base: Any, latent_eps: float) -> Any:
    """`base` built at `latent_eps`; a spec already wrapped (dense and MoE layers share their submodules) as is."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(base, ModuleSpec) and base.module is LatentEpsilon:
        return base
    return ModuleSpec(module=LatentEpsilon, params={"base": base, "latent_eps": latent_eps})
