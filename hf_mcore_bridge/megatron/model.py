"""Building a megatron-core `GPTModel` for one pipeline stage and loading a distributed checkpoint into it.

Uses megatron-core's own pieces only: `TransformerConfig`, a layer spec (the local one, or Transformer Engine's
where it is installed: `transformer_impl`), `GPTModel`, and `dist_checkpointing.load`. The caller has
initialised the process group and `parallel_state`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hf_mcore_bridge.convert.config_bridge import ModelConfig, gpt_model_kwargs, transformer_config_kwargs
from hf_mcore_bridge.convert.layout import Layout
from hf_mcore_bridge.convert.mapping_types import LOCAL_SPEC_MOE_NORM, MOE_PRE_MLP_NORM
from hf_mcore_bridge.convert.transformer_impl import check_transformer_impl


def build_gpt_model(
    model: ModelConfig,
    layout: Layout,
    dtype: torch.dtype,
    padded_vocab: int,
    *,
    device: torch.device,
    vp_stage: int | None = None,
    initialize: bool = True,
    core_attention: str = "sdpa",
) -> torch.nn.Module:
    """A `GPTModel` for this rank's pipeline stage (and virtual stage), parameters on `device`.

    `initialize=False` skips megatron-core's random initialisation (the weights are about to be loaded); on a GPU
    the parameters are then allocated there directly. `core_attention` is `sdpa` (torch's fused attention, which
    also takes packed sequences; see `sdpa_attention`) or `local` (megatron-core's unfused attention).
    """
    from megatron.core.transformer import TransformerConfig

    kwargs = transformer_config_kwargs(model, layout, dtype)
    kwargs["use_cpu_initialization"] = initialize or device.type == "cpu"
    kwargs["perform_initialization"] = initialize
    gpt = gpt_model(TransformerConfig(**kwargs), model, padded_vocab, vp_stage=vp_stage, core_attention=core_attention)
    return gpt.to(device)


def layer_spec(model: ModelConfig, config: object, *, vp_stage: int | None = None, core_attention: str = "sdpa"):
    """The layer spec of `config.transformer_impl` (`transformer_impl`): Transformer Engine's, or the local spec
    with SDPA core attention (unless `core_attention="local"`, megatron-core's unfused attention) and norms that
    take sequence parallelism where the config asks for it (`sequence_parallel_norm`)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec

    impl = getattr(config, "transformer_impl", "local")
    check_transformer_impl(impl)
    if impl == "transformer_engine":
        return _transformer_engine_spec(model, config, vp_stage)
    sequence_parallel = bool(getattr(config, "sequence_parallel", False))
    if model.moe is None and not sequence_parallel:
        spec = get_gpt_layer_local_spec(qk_layernorm=model.qk_norm, normalization="RMSNorm")
    else:  # per-layer specs: dense and MoE layers may be mixed (moe_layer_freq); the final norm is in the spec
        spec = get_gpt_decoder_block_spec(
            config, use_transformer_engine=False, normalization="RMSNorm", vp_stage=vp_stage
        )
    if sequence_parallel:
        from hf_mcore_bridge.megatron.sequence_parallel_norm import use_sequence_parallel_norms

        use_sequence_parallel_norms(spec)
    if core_attention == "sdpa":
        from hf_mcore_bridge.megatron.sdpa_attention import use_sdpa

        use_sdpa(spec)
    return spec


def _transformer_engine_spec(model: ModelConfig, config: object, vp_stage: int | None):
    """megatron-core's Transformer Engine spec: its own fused attention (packed rows as THD), norms fused into the
    following linear layers, sequence parallelism handled by its modules."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    if model.moe is None:
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=model.qk_norm)
    return get_gpt_decoder_block_spec(config, use_transformer_engine=True, normalization="RMSNorm", vp_stage=vp_stage)


def gpt_model(
    config: object, model: ModelConfig, padded_vocab: int, *, vp_stage: int | None = None, core_attention: str = "sdpa"
) -> torch.nn.Module:
    """A `GPTModel` of this rank's pipeline stage for a ready `TransformerConfig` (parameters where it says)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    pre = parallel_state.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    post = parallel_state.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    spec = layer_spec(model, config, vp_stage=vp_stage, core_attention=core_attention)
    return GPTModel(
        config, spec, pre_process=pre, post_process=post, vp_stage=vp_stage, **gpt_model_kwargs(model, padded_vocab)
    )


def load_distributed_checkpoint(module: torch.nn.Module, checkpoint_dir: Path) -> None:
    """Load a `torch_dist` checkpoint into `module` through megatron-core's `dist_checkpointing.load`."""
    from megatron.core import dist_checkpointing
    from megatron.core.safe_globals import register_safe_globals

    register_safe_globals()  # common.pt holds an argparse Namespace; Megatron-LM registers these at start-up
    # Megatron-LM nests the model under "model" ("model0", "model1", ... with virtual pipeline stages); the
    # returned dict also holds common.pt's entries (args, iteration, ...).
    sharded = module.sharded_state_dict()
    if _has_te_moe_norms(checkpoint_dir):
        _use_te_moe_norm_keys(sharded)
    state = dist_checkpointing.load({"model": sharded}, str(checkpoint_dir))
    module.load_state_dict(state["model"])


def _has_te_moe_norms(checkpoint_dir: Path) -> bool:
    from hf_mcore_bridge.checkpoint.dcp_reader import DCPCheckpoint

    return any(MOE_PRE_MLP_NORM in key for key in DCPCheckpoint(checkpoint_dir).tensor_keys())


def _use_te_moe_norm_keys(sharded: dict) -> None:
    """Point the local spec's MoE pre-MLP norms at the Transformer-Engine spec's checkpoint key.

    The two specs name only this tensor differently on disk: the local spec saves a MoE layer's pre-MLP norm as
    `mlp.linear_fc1.layer_norm_weight`, Transformer Engine as `pre_mlp_layernorm.weight`.
    """
    moe_layers = {name.split(".mlp.router.")[0] for name in sharded if ".mlp.router." in name}
    for name, item in sharded.items():
        module = name.removesuffix(".pre_mlp_layernorm.weight")
        if module != name and module in moe_layers:
            item.key = item.key.replace(LOCAL_SPEC_MOE_NORM, MOE_PRE_MLP_NORM)


def causal_mask(seq_len: int, device: torch.device) -> torch.Tensor:
    """megatron-core's boolean attention mask `[1, 1, s, s]`: True where attention is masked out."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)[None, None]
