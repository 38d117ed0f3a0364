"""The `args` in the checkpoints written here carry every attribute Megatron-LM's and Megatron-Bridge's loaders read.

The attribute lists below are taken from the loaders' source, not from the code under test:

- `SET_ARG`: Megatron-LM `megatron/training/checkpointing.py`, `load_args_from_checkpoint` (what
  `--use-checkpoint-args` copies), every `_set_arg(...)` name in tags core_v0.16.1, core_v0.17.0, core_v0.18.0 and
  core_v0.19.0 (the union: core_v0.16.1/0.17.0 also read the hybrid ratios, 0.18.0+ the single grouped MoE
  weights);
- `COMPARE`: same file, `check_checkpoint_args`, every `_compare(...)` name (same tags);
- `BRIDGE_DIRECT`: Megatron-Bridge `src/megatron/bridge/training/mlm_compat/arguments.py`,
  `_transformer_config_from_args` (called by `training/model_load_save.py::load_model_config`), the attributes it
  reads as `args.<name>` without `hasattr`, tags v0.3.1 (which also reads `norm_epsilon`, `apply_layernorm_1p`)
  to v0.6.0.

`MEGATRON_LM_DEFAULTS` holds Megatron-LM's defaults (core_v0.16.1's parser on an empty command line) for the
attributes a dense model does not set. `_bridge_transformer_config` re-implements what `load_model_config` does
with a Megatron-LM checkpoint's args, against the installed megatron-core's `TransformerConfig`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from hf_mcore_bridge.convert.layout import Layout
from hf_mcore_bridge.convert.to_mcore import convert_hf_to_mcore

SET_ARG = [
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "seq_length",
    "num_attention_heads",
    "num_query_groups",
    "group_query_attention",
    "kv_channels",
    "max_position_embeddings",
    "position_embedding_type",
    "add_position_embedding",
    "use_rotary_position_embeddings",
    "rotary_base",
    "rotary_percent",
    "rotary_interleaved",
    "add_bias_linear",
    "add_qkv_bias",
    "squared_relu",
    "swiglu",
    "untie_embeddings_and_output_weights",
    "apply_layernorm_1p",
    "normalization",
    "apply_query_key_layer_scaling",
    "attention_dropout",
    "hidden_dropout",
    "mtp_hybrid_override_pattern",
    "mtp_num_layers",
    "mtp_use_repeated_layer",
    "spec",
    "num_experts",
    "moe_layer_freq",
    "moe_ffn_hidden_size",
    "moe_router_topk",
    "moe_token_dispatcher_type",
    "moe_router_pre_softmax",
    "moe_grouped_gemm",
    "moe_single_grouped_weight",
    "moe_single_grouped_bias",
    "moe_shared_expert_intermediate_size",
    "moe_router_score_function",
    "moe_router_enable_expert_bias",
    "moe_router_topk_scaling_factor",
    "mamba_state_dim",
    "mamba_head_dim",
    "mamba_num_groups",
    "mamba_num_heads",
    "hybrid_attention_ratio",
    "hybrid_mlp_ratio",
    "hybrid_override_pattern",
    "hybrid_layer_pattern",
    "is_hybrid_model",
    "heterogeneous_layers_config_path",
    "heterogeneous_layers_config_encoded_json",
    "moe_latent_size",
    "tokenizer_model",
    "tokenizer_type",
    "tiktoken_pattern",
    "padded_vocab_size",
    "ckpt_format",
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "num_layers_per_virtual_pipeline_stage",
    "expert_model_parallel_size",
]

COMPARE = [
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "add_position_embedding",
    "max_position_embeddings",
    "make_vocab_size_divisible_by",
    "padded_vocab_size",
    "tokenizer_type",
    "data_parallel_random_init",
    "global_batch_size",
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
]

BRIDGE_DIRECT = [
    "multi_latent_attention",
    "heterogeneous_layers_config_path",
    "no_persist_layer_norm",
    "params_dtype",
    "overlap_p2p_comm",
    "num_experts",
    "rotary_interleaved",
    "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers",
    "fp8_param_gather",
    "swiglu",
    "bias_swiglu_fusion",
    "bias_gelu_fusion",
    "squared_relu",
    "init_method_xavier_uniform",
    "group_query_attention",
    "num_query_groups",
    "config_logger_dir",
    "cp_comm_type",
    "is_hybrid_model",
    "norm_epsilon",
    "apply_layernorm_1p",
]

LOADER_ATTRIBUTES = sorted(set(SET_ARG) | set(COMPARE) | set(BRIDGE_DIRECT))

MEGATRON_LM_DEFAULTS = {
    "multi_latent_attention": False,
    "heterogeneous_layers_config_path": None,
    "heterogeneous_layers_config_encoded_json": None,
    "no_persist_layer_norm": False,
    "overlap_p2p_comm": True,
    "fp8_param_gather": False,
    "bias_swiglu_fusion": True,
    "bias_gelu_fusion": True,
    "squared_relu": False,
    "init_method_xavier_uniform": False,
    "config_logger_dir": "",
    "cp_comm_type": ["p2p"],
    "is_hybrid_model": False,
    "apply_query_key_layer_scaling": False,
    "spec": None,
    "mamba_state_dim": 128,
    "mamba_head_dim": 64,
    "mamba_num_groups": 8,
    "mamba_num_heads": None,
    "hybrid_attention_ratio": 0.0,
    "hybrid_mlp_ratio": 0.0,
    "hybrid_override_pattern": None,
    "moe_latent_size": None,
    "mtp_num_layers": None,
    "tokenizer_model": None,
    "tiktoken_pattern": None,
    "data_parallel_random_init": False,
    "global_batch_size": None,
    "moe_router_score_function": "softmax",
    "moe_router_enable_expert_bias": False,
    "moe_router_topk_scaling_factor": None,
}


def _load_args(path: Path) -> argparse.Namespace:
    """`args` of a `common.pt` or `model_optim_rng.pt`, read with torch alone (Namespace allow-listed)."""
    with torch.serialization.safe_globals([argparse.Namespace]):
        return torch.load(path, map_location="cpu", weights_only=True)["args"]


def _bridge_transformer_config(args: argparse.Namespace):
    """What Megatron-Bridge v0.6.0 `_transformer_config_from_args` builds from a Megatron-LM checkpoint's args
    (without MLA, heterogeneous layers or Kitchen, which these checkpoints do not use)."""
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    config_class = MLATransformerConfig if args.multi_latent_attention else TransformerConfig
    assert args.heterogeneous_layers_config_path is None
    kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(config_class) if hasattr(args, f.name)}
    kw["persist_layer_norm"] = not args.no_persist_layer_norm
    kw["layernorm_zero_centered_gamma"] = getattr(
        args, "layernorm_zero_centered_gamma", getattr(args, "apply_layernorm_1p", False)
    )
    kw["layernorm_epsilon"] = getattr(args, "layernorm_epsilon", getattr(args, "norm_epsilon", 1e-5))
    kw["deallocate_pipeline_outputs"] = True
    kw["pipeline_dtype"] = args.params_dtype
    kw["batch_p2p_comm"] = not args.overlap_p2p_comm
    kw["num_moe_experts"] = args.num_experts
    kw["rotary_interleaved"] = args.rotary_interleaved
    kw["num_layers_in_first_pipeline_stage"] = args.decoder_first_pipeline_num_layers
    kw["num_layers_in_last_pipeline_stage"] = args.decoder_last_pipeline_num_layers
    kw["fp8_param"] = args.fp8_param_gather
    if args.swiglu:
        kw["activation_func"] = torch.nn.functional.silu
        kw["gated_linear_unit"] = True
        kw["bias_activation_fusion"] = args.bias_swiglu_fusion
    else:
        kw["bias_activation_fusion"] = args.bias_gelu_fusion
    assert not args.squared_relu
    assert not args.init_method_xavier_uniform
    kw["num_query_groups"] = args.num_query_groups if args.group_query_attention else None
    kw["config_logger_dir"] = args.config_logger_dir
    if len(args.cp_comm_type) == 1:
        kw["cp_comm_type"] = args.cp_comm_type[0]
    if args.is_hybrid_model:
        kw["is_hybrid_model"] = args.is_hybrid_model
    return config_class(**kw)


def _written_args(hf_dir: Path, out: Path, fmt: str, layout: Layout) -> list[argparse.Namespace]:
    convert_hf_to_mcore(hf_dir, out, layout=layout, checkpoint_format=fmt, spec="local", show_progress=False)
    release = out / "release"
    files = [release / "common.pt"] if fmt == "torch_dist" else sorted(release.glob("mp_rank_*/model_optim_rng.pt"))
    assert files
    return [_load_args(f) for f in files]


def _check_model_fields(args: argparse.Namespace, hf: dict, layout: Layout) -> None:
    """The model's own fields, against its HF config.json."""
    heads = hf["num_attention_heads"]
    assert args.num_layers == hf["num_hidden_layers"]
    assert args.hidden_size == hf["hidden_size"]
    assert args.num_attention_heads == heads
    assert args.num_query_groups == hf["num_key_value_heads"]
    assert args.group_query_attention is (hf["num_key_value_heads"] != heads)
    assert args.kv_channels == (hf.get("head_dim") or hf["hidden_size"] // heads)
    assert args.max_position_embeddings == hf["max_position_embeddings"]
    theta = hf.get("rope_theta") or hf["rope_parameters"]["rope_theta"]
    assert args.rotary_base == theta
    assert args.norm_epsilon == args.layernorm_epsilon == hf["rms_norm_eps"]
    assert args.untie_embeddings_and_output_weights is (not hf.get("tie_word_embeddings", False))
    assert args.swiglu is True and args.normalization == "RMSNorm" and args.add_bias_linear is False
    assert args.position_embedding_type == "rope" and args.add_position_embedding is False
    assert args.vocab_size == hf["vocab_size"]
    assert args.padded_vocab_size % (128 * layout.tp) == 0 and args.padded_vocab_size >= hf["vocab_size"]
    assert args.tensor_model_parallel_size == layout.tp
    assert args.pipeline_model_parallel_size == layout.pp
    assert args.expert_model_parallel_size == layout.ep
    if "num_local_experts" in hf or "num_experts" in hf:
        assert args.num_experts == hf.get("num_local_experts", hf.get("num_experts"))
        assert args.moe_router_topk == hf["num_experts_per_tok"]
        assert args.moe_ffn_hidden_size == hf.get("moe_intermediate_size", hf["intermediate_size"])
    else:
        assert args.num_experts is None
        assert args.ffn_hidden_size == hf["intermediate_size"]


def _check_bridge_config(args: argparse.Namespace, hf: dict) -> None:
    config = _bridge_transformer_config(args)
    assert config.num_layers == hf["num_hidden_layers"]
    assert config.hidden_size == hf["hidden_size"]
    assert config.num_attention_heads == hf["num_attention_heads"]
    assert config.num_query_groups == hf["num_key_value_heads"]
    assert config.layernorm_epsilon == hf["rms_norm_eps"]
    assert config.normalization == "RMSNorm" and config.gated_linear_unit
    assert config.activation_func is torch.nn.functional.silu
    assert config.add_bias_linear is False
    assert config.add_qkv_bias is bool(hf.get("attention_bias") or hf["model_type"] in ("qwen2", "qwen2_moe"))
    assert config.qk_layernorm is (hf["model_type"] in ("qwen3", "qwen3_moe"))
    assert config.num_moe_experts == hf.get("num_local_experts", hf.get("num_experts"))


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_args_carry_every_loader_attribute(fmt, tiny_models, tiny_moe_models, tmp_path):
    cases = [
        ("llama", tiny_models["llama"], Layout(tp=2, pp=2)),
        ("qwen3", tiny_models["qwen3"], Layout()),
        ("mixtral", tiny_moe_models["mixtral"], Layout(ep=2)),
        ("qwen3_moe", tiny_moe_models["qwen3_moe"], Layout(tp=2)),
    ]
    for name, hf_dir, layout in cases:
        hf = json.loads((hf_dir / "config.json").read_text())
        for args in _written_args(hf_dir, tmp_path / name, fmt, layout):
            missing = [a for a in LOADER_ATTRIBUTES if not hasattr(args, a)]
            assert not missing, f"{name}: args lack {missing}"
            for attr, default in MEGATRON_LM_DEFAULTS.items():
                assert getattr(args, attr) == default, (name, attr)
            _check_model_fields(args, hf, layout)
            _check_bridge_config(args, hf)


def test_bridge_reference_fails_without_an_attribute(tiny_models, tmp_path):
    """The reference above is not vacuous: the args an earlier writer produced (no `multi_latent_attention`) fail
    in it as they do in Megatron-Bridge."""
    (args,) = _written_args(tiny_models["llama"], tmp_path / "m", "torch_dist", Layout())
    del args.multi_latent_attention
    with pytest.raises(AttributeError, match="multi_latent_attention"):
        _bridge_transformer_config(args)
    assert any(not hasattr(args, a) for a in LOADER_ATTRIBUTES)


def test_megatron_lm_epsilon_name_is_read(tiny_models, tmp_path):
    """Megatron-LM's own args name the norm epsilon `layernorm_epsilon` (no `norm_epsilon`): reading them must not
    fall back to a default epsilon."""
    from hf_mcore_bridge.convert.config_bridge import from_megatron_args

    (args,) = _written_args(tiny_models["llama"], tmp_path / "m", "torch_dist", Layout())
    del args.norm_epsilon
    args.layernorm_epsilon = 3e-6
    assert from_megatron_args(args).norm_epsilon == 3e-6
