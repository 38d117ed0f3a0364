"""The HF config's `router_aux_loss_coef` (a pre-training setting) does not become a load-balancing loss in the
GRPO trainer's megatron-core `TransformerConfig`; `policy.megatron_cfg.transformer.moe_aux_loss_coeff` turns it on.
Conversion still records the HF value in the checkpoint's `args`, from which export writes it back. Likewise
megatron-core's updates of a sigmoid router's expert bias (GLM-4.5) are off unless
`policy.megatron_cfg.moe_router_bias_update_rate` asks for them (the effect on a trained model:
`tests/grpo/run/test_layouts.py::test_glm_first_step_matches_hf_reference`)."""

from __future__ import annotations

import pytest
import torch

from hf_mcore_bridge.convert import config_bridge
from hf_mcore_bridge.convert.layout import Layout
from hf_mcore_bridge.grpo.backends.megatron.config import MegatronConfig, megatron_layout
from hf_mcore_bridge.grpo.backends.megatron.policy import _transformer_config
from hf_mcore_bridge.models.spec import ModelSpec
from hf_mcore_bridge.models.tiny_models import tiny_config

TINY_MOE = {
    "MixtralForCausalLM": {"model_type": "mixtral", "num_local_experts": 4, "intermediate_size": 32},
    "Qwen3MoeForCausalLM": {
        "model_type": "qwen3_moe",
        "num_experts": 4,
        "moe_intermediate_size": 32,
        "intermediate_size": 48,
        "head_dim": 16,
        "norm_topk_prob": True,
    },
}


def _model(architecture: str) -> ModelSpec:
    hf = {
        "architectures": [architecture],
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_experts_per_tok": 2,
        "vocab_size": 211,
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "router_aux_loss_coef": 0.01,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        **TINY_MOE[architecture],
    }
    return config_bridge.megatron_spec(hf)


@pytest.mark.parametrize("architecture", sorted(TINY_MOE))
def test_hf_router_aux_loss_coef_adds_no_loss_unless_asked(architecture: str) -> None:
    model = _model(architecture)
    assert model.moe is not None and model.moe.aux_loss_coeff == 0.01
    default = MegatronConfig()
    config = _transformer_config(model, megatron_layout(default), torch.float32, default)
    assert config.moe_aux_loss_coeff == 0.0
    asked = MegatronConfig(transformer={"moe_aux_loss_coeff": 0.02})
    config = _transformer_config(model, megatron_layout(asked), torch.float32, asked)
    assert config.moe_aux_loss_coeff == 0.02
    assert config.moe_router_load_balancing_type == "aux_loss"  # megatron-core's default: the coefficient acts


def test_conversion_args_keep_the_hf_coefficient_for_export() -> None:
    model = _model("Qwen3MoeForCausalLM")
    args = config_bridge.megatron_args(model, Layout(), torch.float32)
    assert args.moe_aux_loss_coeff == 0.01
    back = config_bridge.from_megatron_args(args)
    assert back.to_hf()["router_aux_loss_coef"] == 0.01


def test_expert_bias_updates_are_off_unless_asked() -> None:
    from megatron.core.transformer import TransformerConfig

    model = config_bridge.megatron_spec(tiny_config("Glm4MoeForCausalLM"))
    default = MegatronConfig()
    config = _transformer_config(model, megatron_layout(default), torch.float32, default)
    assert config.moe_router_enable_expert_bias and config.moe_router_bias_update_rate == 0.0
    asked = MegatronConfig(moe_router_bias_update_rate=1e-3)
    assert _transformer_config(model, megatron_layout(asked), torch.float32, asked).moe_router_bias_update_rate == 1e-3
    # what megatron-core would do on its own: move the biases after every step
    assert TransformerConfig.__dataclass_fields__["moe_router_bias_update_rate"].default == 1e-3
    # the conversion's args record the router, not a training rate
    args = config_bridge.megatron_args(model, Layout(), torch.float32)
    assert args.moe_router_enable_expert_bias and not hasattr(args, "moe_router_bias_update_rate")
