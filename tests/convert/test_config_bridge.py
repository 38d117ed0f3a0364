"""Config bridge: published configs round trip through megatron-core's own config classes and back to
`transformers.AutoConfig`; values megatron-core cannot represent are refused by name."""

from __future__ import annotations

import copy

import pytest
import torch
from published_configs import LAYOUTS, PUBLISHED
from transformers import AutoConfig

from hf_mcore_bridge.convert import config_bridge
from hf_mcore_bridge.convert.layout import Layout, validate_layout
from hf_mcore_bridge.errors import UnsupportedArchitectureError
from hf_mcore_bridge.models.config_errors import ConfigError
from hf_mcore_bridge.models.registry import get_architecture, supported

ARCH_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
    "rms_norm_eps",
    "tie_word_embeddings",
    "hidden_act",
    "model_type",
    "architectures",
    "attention_bias",
    "mlp_bias",
    "sliding_window",
    "use_sliding_window",
)


def _auto(config: dict) -> object:
    config = dict(config)
    return AutoConfig.for_model(config.pop("model_type"), **config)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_config_round_trips(name):
    original = PUBLISHED[name]
    model = config_bridge.megatron_spec(original)
    back = model.to_hf()
    a, b = _auto(original), _auto(back)
    for field in ARCH_FIELDS:
        if hasattr(a, field):
            assert getattr(b, field) == getattr(a, field), field
    assert a.rope_parameters == b.rope_parameters


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_config_builds_megatron_transformer_config(name):
    from megatron.core.transformer import TransformerConfig

    original = PUBLISHED[name]
    arch = get_architecture(original["architectures"][0])
    model = config_bridge.megatron_spec(original)
    tp, pp = LAYOUTS[name]
    layout = Layout(tp=tp, pp=pp)
    validate_layout(layout, model)
    config = TransformerConfig(**config_bridge.transformer_config_kwargs(model, layout, torch.bfloat16))
    assert config.kv_channels == original.get("head_dim", original["hidden_size"] // original["num_attention_heads"])
    assert config.num_query_groups == original["num_key_value_heads"]
    assert config.add_qkv_bias is (arch.hf_name == "Qwen2ForCausalLM")
    assert config.qk_layernorm is (arch.hf_name in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"))
    kwargs = config_bridge.gpt_model_kwargs(model, config_bridge.padded_vocab(model, layout))
    assert kwargs["rotary_base"] == original["rope_theta"]
    assert kwargs["vocab_size"] % (128 * tp) == 0 and kwargs["vocab_size"] >= original["vocab_size"]
    assert kwargs["share_embeddings_and_output_weights"] is original["tie_word_embeddings"]
    scaling = original.get("rope_scaling")
    assert kwargs["rope_scaling"] is bool(scaling)
    if scaling:
        assert kwargs["rope_scaling_factor"] == scaling["factor"]


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_megatron_args_round_trip(name):
    original = PUBLISHED[name]
    model = config_bridge.megatron_spec(original)
    tp, pp = LAYOUTS[name]
    args = config_bridge.megatron_args(model, Layout(tp=tp, pp=pp), torch.bfloat16)
    assert args.tensor_model_parallel_size == tp and args.pipeline_model_parallel_size == pp
    assert config_bridge.from_megatron_args(args) == model


def _with(name: str, **changes) -> dict:
    config = copy.deepcopy(PUBLISHED[name])
    for key, value in changes.items():
        if value is ...:
            config.pop(key, None)
        else:
            config[key] = value
    return config


LLAMA = "meta-llama/Llama-3.1-8B"


@pytest.mark.parametrize(
    ("config", "field"),
    [
        (
            _with(
                LLAMA,
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 2.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192,
                },
            ),
            "low_freq_factor",
        ),
        (
            _with(
                LLAMA,
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 4096,
                },
            ),
            "original_max_position_embeddings",
        ),
        (_with(LLAMA, rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_type"),
        (_with(LLAMA, rope_theta=...), "rope_theta"),
        (_with(LLAMA, attention_bias=True), "attention_bias"),
        (_with(LLAMA, mlp_bias=True), "mlp_bias"),
        (_with(LLAMA, hidden_act="gelu"), "hidden_act"),
        (_with("mistralai/Mistral-7B-v0.3", sliding_window=4096), "sliding_window"),
        (_with("Qwen/Qwen2.5-7B", use_sliding_window=True), "use_sliding_window"),
        (_with("Qwen/Qwen3-8B", attention_bias=True), "attention_bias"),
        (_with(LLAMA, num_hidden_layers=...), "num_hidden_layers"),
    ],
)
def test_unrepresentable_values_are_refused_by_name(config, field):
    with pytest.raises(ConfigError, match=field):
        config_bridge.megatron_spec(config)


def test_transformers5_rope_parameters_are_read():
    config = _with(LLAMA, rope_theta=..., rope_scaling=...)
    config["rope_parameters"] = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        **{"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    }
    model = config_bridge.megatron_spec(config)
    assert model.rope.theta == 500000.0 and (model.rope.rope_type, model.rope.factor) == ("llama3", 8.0)


def test_unknown_architecture_lists_the_supported_ones():
    with pytest.raises(UnsupportedArchitectureError) as info:
        get_architecture("GPT2LMHeadModel")
    for name in supported():
        assert name in str(info.value)
