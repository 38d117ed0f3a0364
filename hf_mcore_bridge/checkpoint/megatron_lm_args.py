"""Megatron-LM's default values for the `args` attributes that checkpoint loaders read.

A checkpoint's `args` is the argparse Namespace of the run that saved it, so a Megatron-LM checkpoint carries all
of Megatron-LM's ~650 arguments. Loaders read some of them as plain attributes and fail on a Namespace that lacks
one (Megatron-Bridge's `load_model_config`: `'Namespace' object has no attribute 'multi_latent_attention'`). The
`args` written here carry every attribute these loaders read, each with Megatron-LM's default unless the model
sets it:

- Megatron-LM `megatron/training/checkpointing.py`, `load_args_from_checkpoint` (what `--use-checkpoint-args`
  copies; every `_set_arg` name, union over tags core_v0.16.1, core_v0.17.0, core_v0.18.0, core_v0.19.0) and
  `check_checkpoint_args` (every `_compare` name, same tags);
- Megatron-Bridge `src/megatron/bridge/training/mlm_compat/arguments.py`, `_transformer_config_from_args` (the
  attributes it reads without `hasattr`, tags v0.3.1 to v0.6.0), called by `load_model_config`.

Defaults are those of Megatron-LM core_v0.16.1's `add_megatron_arguments` on an empty command line; attributes
that release does not define take theirs from core_v0.19.0 (`TransformerConfig` fields, `--hybrid-layer-pattern`),
from `validate_args` (derived ones) or from the older argument they replace (`norm_epsilon`, `apply_layernorm_1p`).
The other ~580 arguments (data paths, optimizer, logging) are not written: no loader reads them from a checkpoint.
"""

from __future__ import annotations

import copy
from typing import Any

LOADER_DEFAULTS: dict[str, Any] = {
    # load_args_from_checkpoint, model arguments
    "num_layers": None,
    "hidden_size": None,
    "ffn_hidden_size": None,
    "seq_length": None,
    "num_attention_heads": None,
    "num_query_groups": 1,
    "group_query_attention": False,
    "kv_channels": None,
    "max_position_embeddings": None,
    "position_embedding_type": "learned_absolute",
    "add_position_embedding": True,
    "use_rotary_position_embeddings": False,
    "rotary_base": 10000,
    "rotary_percent": 1.0,
    "rotary_interleaved": False,
    "add_bias_linear": True,
    "add_qkv_bias": False,
    "squared_relu": False,
    "swiglu": False,
    "untie_embeddings_and_output_weights": False,
    "apply_layernorm_1p": False,  # older name of layernorm_zero_centered_gamma; read by Megatron-Bridge v0.3.1
    "normalization": "LayerNorm",
    "apply_query_key_layer_scaling": False,
    "attention_dropout": 0.1,
    "hidden_dropout": 0.1,
    "mtp_hybrid_override_pattern": None,  # core_v0.19.0 TransformerConfig
    "mtp_num_layers": None,
    "mtp_use_repeated_layer": False,  # core_v0.19.0 TransformerConfig
    "spec": None,
    # load_args_from_checkpoint, MoE, Mamba, hybrid and heterogeneous models
    "num_experts": None,
    "moe_layer_freq": 1,
    "moe_ffn_hidden_size": None,
    "moe_router_topk": 2,
    "moe_token_dispatcher_type": "allgather",
    "moe_router_pre_softmax": False,
    "moe_grouped_gemm": False,
    "moe_single_grouped_weight": False,  # core_v0.19.0 TransformerConfig
    "moe_single_grouped_bias": False,  # core_v0.19.0 TransformerConfig
    "moe_shared_expert_intermediate_size": None,
    "moe_router_score_function": "softmax",
    "moe_router_enable_expert_bias": False,
    "moe_router_topk_scaling_factor": None,
    "moe_latent_size": None,
    "mamba_state_dim": 128,
    "mamba_head_dim": 64,
    "mamba_num_groups": 8,
    "mamba_num_heads": None,
    "hybrid_attention_ratio": 0.0,  # read up to core_v0.17.0
    "hybrid_mlp_ratio": 0.0,  # read up to core_v0.17.0
    "hybrid_override_pattern": None,
    "hybrid_layer_pattern": None,  # core_v0.19.0 --hybrid-layer-pattern
    "is_hybrid_model": False,
    "heterogeneous_layers_config_path": None,
    "heterogeneous_layers_config_encoded_json": None,
    # load_args_from_checkpoint, tokenizer, checkpoint and parallelism arguments
    "tokenizer_model": None,
    "tokenizer_type": None,
    "tiktoken_pattern": None,
    "padded_vocab_size": None,
    "ckpt_format": "torch_dist",
    "tensor_model_parallel_size": 1,
    "pipeline_model_parallel_size": 1,
    "virtual_pipeline_model_parallel_size": None,  # derived by validate_args
    "num_layers_per_virtual_pipeline_stage": None,
    "expert_model_parallel_size": 1,
    # check_checkpoint_args
    "make_vocab_size_divisible_by": 128,
    "data_parallel_random_init": False,
    "global_batch_size": None,
    # Megatron-Bridge _transformer_config_from_args
    "multi_latent_attention": False,
    "no_persist_layer_norm": False,
    "params_dtype": None,  # derived by validate_args from --bf16 / --fp16
    "overlap_p2p_comm": True,
    "decoder_first_pipeline_num_layers": None,
    "decoder_last_pipeline_num_layers": None,
    "fp8_param_gather": False,
    "bias_swiglu_fusion": True,
    "bias_gelu_fusion": True,
    "init_method_xavier_uniform": False,
    "config_logger_dir": "",
    "cp_comm_type": ["p2p"],
    "norm_epsilon": 1e-5,  # older name of layernorm_epsilon; read by Megatron-Bridge v0.3.1
    # the names megatron-core's TransformerConfig (and so Megatron-LM >= core_v0.16.1) gives the two above
    "layernorm_epsilon": 1e-5,
    "layernorm_zero_centered_gamma": False,
}
"""Attribute -> Megatron-LM's default, for every attribute the loaders above read."""


def loader_defaults() -> dict[str, Any]:
    """A fresh copy of `LOADER_DEFAULTS` (its list values are not shared between namespaces)."""
    return copy.deepcopy(LOADER_DEFAULTS)
