"""Building a megatron-core `GPTModel` for one pipeline stage and loading a distributed checkpoint into it.

Uses megatron-core's own pieces only: `TransformerConfig`, a layer spec (the local one, or Transformer Engine's
where it is installed: `transformer_impl`), `GPTModel`, and `dist_checkpointing.load`. The caller has
initialised the process group and `parallel_state`.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from hf_mcore_bridge.convert.config_bridge import gpt_model_kwargs, transformer_config_kwargs, yarn_config_attributes
from hf_mcore_bridge.convert.layout import Layout
from hf_mcore_bridge.convert.placement import LOCAL_MLA_SPEC_KEYS, LOCAL_SPEC_MOE_NORM, MOE_PRE_MLP_NORM
from hf_mcore_bridge.convert.transformer_impl import check_transformer_impl
from hf_mcore_bridge.models.spec import ModelSpec

SPEC_NAME_PAIRS = tuple(dict.fromkeys(((LOCAL_SPEC_MOE_NORM, MOE_PRE_MLP_NORM), *LOCAL_MLA_SPEC_KEYS.items())))
"""Names one tensor has in the two layer specs' checkpoints (local spec, Transformer Engine's, with and without
multi-latent attention): a checkpoint key missing under one is looked up under the other."""


def transformer_config(kwargs: dict[str, Any]) -> Any:
    """megatron-core's `TransformerConfig`, or its `MLATransformerConfig` where `kwargs` ask for multi-latent
    attention."""
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    return (MLATransformerConfig if kwargs.get("multi_latent_attention") else TransformerConfig)(**kwargs)


def build_gpt_model(
    model: ModelSpec,
    layout: Layout,
    dtype: torch.dtype,
    padded_vocab: int,
    *,
    device: torch.device,
    vp_stage: int | None = None,
    initialize: bool = True,
    core_attention: str = "sdpa",
    mtp: bool = False,
) -> torch.nn.Module:
    """A `GPTModel` for this rank's pipeline stage (and virtual stage), parameters on `device`.

    `initialize=False` skips megatron-core's random initialisation (the weights are about to be loaded); on a GPU
    the parameters are then allocated there directly. `core_attention` is `sdpa` (torch's fused attention, which
    also takes packed sequences; see `sdpa_attention`) or `local` (megatron-core's unfused attention). `mtp`
    builds the model's multi-token-prediction layers too; megatron-core's forward then needs `labels` (it computes
    their loss), so logits-only uses leave them out (a checkpoint holding them loads all the same).
    """
    kwargs = transformer_config_kwargs(model, layout, dtype)
    kwargs["use_cpu_initialization"] = initialize or device.type == "cpu"
    kwargs["perform_initialization"] = initialize
    if mtp and model.mtp_layers:
        kwargs["mtp_num_layers"] = model.mtp_layers
    config = transformer_config(kwargs)
    gpt = gpt_model(config, model, padded_vocab, vp_stage=vp_stage, core_attention=core_attention)
    return gpt.to(device)


def layer_spec(model: ModelSpec, config: object, *, vp_stage: int | None = None, core_attention: str = "sdpa"):
    """The layer spec of `config.transformer_impl` (`transformer_impl`): Transformer Engine's, or the local spec
    with SDPA core attention (unless `core_attention="local"`, megatron-core's unfused attention) and norms that
    take sequence parallelism where the config asks for it (`sequence_parallel_norm`; multi-latent attention's
    down-projected latents then as `mla_sequence_parallel` hands them on), and with `moe_grouped_gemm` the experts
    as grouped GEMMs through torch (`grouped_experts`; same parameters as `SequentialMLP`); either way with
    multi-latent attention's latent norms at the model's `latent_norm_eps` (`latent_norm`), and Gemma's offset
    norms, post-norms, sliding-layer RoPE and embedding scale (`gemma_layers`)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec

    impl = getattr(config, "transformer_impl", "local")
    check_transformer_impl(impl)
    if model.linear_attention is not None:
        return _hybrid_spec(model, config, impl, vp_stage, core_attention)
    if impl == "transformer_engine":
        return _with_gemma_layers(
            model, _with_latent_norm_eps(model, _transformer_engine_spec(model, config, vp_stage))
        )
    sequence_parallel = bool(getattr(config, "sequence_parallel", False))
    mla = model.mla is not None
    if model.moe is None and not sequence_parallel and not _has_gemma_layers(model):
        spec = get_gpt_layer_local_spec(
            qk_layernorm=model.qk_norm or mla, multi_latent_attention=mla, normalization="RMSNorm"
        )
    else:  # per-layer specs: dense and MoE layers may be mixed (moe_layer_freq); the final norm is in the spec
        with warnings.catch_warnings():  # moe_grouped_gemm: the legacy GroupedMLP's deprecation, replaced below
            warnings.simplefilter("ignore", UserWarning)
            spec = get_gpt_decoder_block_spec(
                config, use_transformer_engine=False, normalization="RMSNorm", vp_stage=vp_stage
            )
        if model.moe is not None and getattr(config, "moe_grouped_gemm", False):
            from hf_mcore_bridge.megatron.grouped_experts import use_grouped_experts

            use_grouped_experts(spec)
    if sequence_parallel:
        from hf_mcore_bridge.megatron.sequence_parallel_norm import use_sequence_parallel_norms

        use_sequence_parallel_norms(spec)
        if mla:
            from hf_mcore_bridge.megatron.mla_sequence_parallel import use_sequence_sharded_latents

            use_sequence_sharded_latents(spec)
    if core_attention == "sdpa":
        from hf_mcore_bridge.megatron.sdpa_attention import use_sdpa

        use_sdpa(spec)
    if mla:
        use_te_names_for_mla(spec)
    return _with_gemma_layers(model, _with_latent_norm_eps(model, spec))


def _hybrid_spec(model: ModelSpec, config: Any, impl: str, vp_stage: int | None, core_attention: str) -> Any:
    """Gated DeltaNet and gated full attention (`gated_delta_net_layers`), under the local spec with SDPA core
    attention; what it does not cover is refused naming the model."""
    from hf_mcore_bridge.megatron.gated_delta_net_layers import hybrid_block_spec

    name = model.architecture
    if impl == "transformer_engine":
        raise ValueError(f"{name}: Gated DeltaNet layers are built with the local spec only (transformer_impl=local)")
    if getattr(config, "sequence_parallel", False):
        raise ValueError(f"{name}: sequence parallelism is not supported with Gated DeltaNet layers")
    if getattr(config, "context_parallel_size", 1) > 1:
        raise ValueError(f"{name}: context parallelism is not supported with Gated DeltaNet layers")
    if core_attention != "sdpa":
        raise ValueError(f"{name}: Gated DeltaNet models are built with SDPA core attention")
    spec = hybrid_block_spec(config, model.layer_types, vp_stage=vp_stage)
    if model.moe is not None and getattr(config, "moe_grouped_gemm", False):
        from hf_mcore_bridge.megatron.grouped_experts import use_grouped_experts

        use_grouped_experts(spec)
    return spec


def _has_gemma_layers(model: ModelSpec) -> bool:
    return model.norm_offset or model.post_norms or model.sliding_rope is not None or model.embedding_scale


def _with_gemma_layers(model: ModelSpec, spec: Any) -> Any:
    """The spec with the offset norms, post-norms, the sliding layers' RoPE and the embedding scale where the model
    has them (`gemma_layers`); those need a block spec (its final norm)."""
    if not _has_gemma_layers(model):
        return spec
    from hf_mcore_bridge.megatron.gemma_layers import use_gemma_layers

    if getattr(spec, "layer_specs", None) is None:
        raise ValueError("the offset norms, post-norms and sliding-layer RoPE need a block spec")
    return use_gemma_layers(spec, model)


def _with_latent_norm_eps(model: ModelSpec, spec: Any) -> Any:
    """The spec with multi-latent attention's latent norms at transformers' epsilon where it is not
    `rms_norm_eps` (`latent_norm`); megatron-core's own specs build them at `config.layernorm_epsilon`."""
    if model.mla is None or model.latent_norm_eps == model.norm_epsilon:
        return spec
    from hf_mcore_bridge.megatron.latent_norm import use_latent_norm_eps

    return use_latent_norm_eps(spec, model.latent_norm_eps)


def use_te_names_for_mla(spec: object) -> object:
    """Give the local spec's multi-latent-attention layers Transformer Engine's checkpoint names.

    megatron-core's local MLA spec, unlike its plain one, maps no norm onto TE's fused names: its q/kv latent norms
    and a dense layer's pre-MLP norm would save under their module names. With this key map they save (and load,
    and refit) under the names of the mapping table, as the local spec's other layers do; checkpoints of
    Megatron-LM's local MLA spec still load (`load_distributed_checkpoint` looks their names up)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    layer_specs = getattr(spec, "layer_specs", None) or [spec]
    for layer in layer_specs:
        keys = {"self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_"}
        keys["self_attention.kv_layernorm."] = "self_attention.linear_kv_up_proj.layer_norm_"
        if layer.submodules.mlp.module is not MoELayer:
            keys["pre_mlp_layernorm."] = "mlp.linear_fc1.layer_norm_"
        layer.submodules.sharded_state_dict_keys_map = keys
    return spec


def _transformer_engine_spec(model: ModelSpec, config: object, vp_stage: int | None):
    """megatron-core's Transformer Engine spec: its own fused attention (packed rows as THD), norms fused into the
    following linear layers, sequence parallelism handled by its modules."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    if model.moe is None and not _has_gemma_layers(model):
        mla = model.mla is not None
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=model.qk_norm or mla, multi_latent_attention=mla)
    return get_gpt_decoder_block_spec(config, use_transformer_engine=True, normalization="RMSNorm", vp_stage=vp_stage)


def gpt_model(
    config: object, model: ModelSpec, padded_vocab: int, *, vp_stage: int | None = None, core_attention: str = "sdpa"
) -> torch.nn.Module:
    """A `GPTModel` of this rank's pipeline stage for a ready `TransformerConfig` (parameters where it says)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    pre = parallel_state.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    post = parallel_state.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    spec = layer_spec(model, config, vp_stage=vp_stage, core_attention=core_attention)
    for name, value in yarn_config_attributes(model).items():
        setattr(config, name, value)
    extra: dict[str, Any] = {}
    if getattr(config, "mtp_num_layers", None):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

        te = getattr(config, "transformer_impl", "local") == "transformer_engine"
        extra["mtp_block_spec"] = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=te, vp_stage=vp_stage)
    return GPTModel(
        config,
        spec,
        pre_process=pre,
        post_process=post,
        vp_stage=vp_stage,
        **gpt_model_kwargs(model, padded_vocab),
        **extra,
    )


def load_distributed_checkpoint(module: torch.nn.Module, checkpoint_dir: Path) -> None:
    """Load a `torch_dist` checkpoint into `module` through megatron-core's `dist_checkpointing.load`."""
    from megatron.core import dist_checkpointing
    from megatron.core.safe_globals import register_safe_globals

    register_safe_globals()  # common.pt holds an argparse Namespace; Megatron-LM registers these at start-up
    # Megatron-LM nests the model under "model" ("model0", "model1", ... with virtual pipeline stages); the
    # returned dict also holds common.pt's entries (args, iteration, ...).
    from hf_mcore_bridge.checkpoint.dcp_reader import DCPCheckpoint

    sharded = module.sharded_state_dict()
    match_spec_names(sharded, DCPCheckpoint(checkpoint_dir).tensor_keys())
    state = dist_checkpointing.load({"model": sharded}, str(checkpoint_dir))
    module.load_state_dict(state["model"])


def match_spec_names(sharded: dict, keys: set[str]) -> None:
    """Point every tensor whose key the checkpoint lacks at its name under the other layer spec, where the
    checkpoint holds that (`SPEC_NAME_PAIRS`).

    The specs name a few norms differently on disk: the local spec saves a MoE layer's pre-MLP norm as
    `mlp.linear_fc1.layer_norm_weight`, Transformer Engine as `pre_mlp_layernorm.weight`; with multi-latent
    attention, the local spec keeps every norm's module name (`q_layernorm`, `kv_layernorm`, a dense layer's
    `pre_mlp_layernorm`) where Transformer Engine fuses them into the following linear layers.
    """
    for item in sharded.values():
        key = getattr(item, "key", None)
        if key is None or key in keys:
            continue
        for first, second in SPEC_NAME_PAIRS:
            for old, new in ((first, second), (second, first)):
                if old in key and key.replace(old, new) in keys:
                    item.key = key.replace(old, new)


def causal_mask(seq_len: int, device: torch.device) -> torch.Tensor:
    """megatron-core's boolean attention mask `[1, 1, s, s]`: True where attention is masked out."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)[None, None]
