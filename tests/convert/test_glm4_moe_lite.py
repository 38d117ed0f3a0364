"""GLM-4.7-Flash (`Glm4MoeLiteForCausalLM`): DeepSeek-V3's multi-latent attention with GLM's mixture of experts.

Logit parity through megatron-core runs in the shared worlds of `test_moe` (EP2, TP2 x EP2, PP2 x EP2) and
`test_parity` (TP2, PP2), the bit-exact round trips in `test_moe`'s and `test_every_architecture`'s, for the tiny
model of `tiny_variants.MOE_VARIANTS` (dense layers 0 and 2 by `mlp_layer_types`). Here: the published config as
transformers reads it, through megatron-core's own `MLATransformerConfig` and back; its `rms_norm_eps` 1e-5 beside the
latent norms' 1e-6, converted with a note (in process and at the command line; `test_parity`'s TP2 world checks the
logits of a model whose latents make that epsilon matter, and here by how much it does); the layer types as
transformers' model builds them from an exported config; the reader's refusals.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from cli_errors import run
from published_configs import GLM_47_FLASH
from transformers import AutoConfig, AutoModelForCausalLM

from hf_mcore_bridge.convert import config_bridge
from hf_mcore_bridge.convert.layout import Layout, validate_layout
from hf_mcore_bridge.engine.arch import require_runnable
from hf_mcore_bridge.models.config_errors import ConfigError
from hf_mcore_bridge.models.spec import ModelSpec
from hf_mcore_bridge.models.tiny_models import tiny_config

LATENT_EPS = 1e-6
"""The epsilon of transformers' `q_a_layernorm` / `kv_a_layernorm` in this model (their default)."""


def _with(config: dict, **changes: object) -> dict:
    changed = copy.deepcopy(config)
    for key, value in changes.items():
        if value is ...:
            changed.pop(key, None)
        else:
            changed[key] = value
    return changed


def _auto(config: dict) -> object:
    return AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items() if k != "model_type"})


def test_published_config_reads_as_transformers_runs_it() -> None:
    model = ModelSpec.from_hf(GLM_47_FLASH)
    assert ModelSpec.from_hf(_auto(GLM_47_FLASH)) == model
    # what transformers' model of it builds
    hf = _auto(GLM_47_FLASH)
    assert model.moe is not None and model.mla is not None
    assert model.moe.moe_layers == tuple(kind == "sparse" for kind in hf.mlp_layer_types)
    assert model.moe.moe_layers == (False,) + (True,) * 46
    assert (model.moe.num_experts, model.moe.topk, model.moe.shared_expert_size) == (64, 4, 1536)
    assert (model.moe.topk_scaling_factor, model.moe.num_groups, model.moe.score_function) == (1.8, None, "sigmoid")
    mla = model.mla
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim) == (
        768,
        512,
        192,
        64,
        256,
    )
    assert mla.rope_interleave and model.rope.rope_type == "default" and model.rope.theta == 1e6
    assert (model.norm_epsilon, model.latent_norm_eps, model.mtp_layers) == (1e-5, LATENT_EPS, 1)
    require_runnable(model)  # the engine runs it (its latent norms at 1e-6)


def test_a_first_k_dense_replace_transformers_would_ignore_is_refused() -> None:
    """Without `mlp_layer_types` transformers' model has one dense layer, whatever `first_k_dense_replace` says."""
    assert len(_auto(_with(GLM_47_FLASH, first_k_dense_replace=3)).mlp_layer_types) == 47
    assert _auto(_with(GLM_47_FLASH, first_k_dense_replace=3)).mlp_layer_types[:2] == ["dense", "sparse"]
    with pytest.raises(
        ConfigError, match=r"first_k_dense_replace=3 disagrees with mlp_layer_types \['dense', 'sparse'"
    ):
        ModelSpec.from_hf(_with(GLM_47_FLASH, first_k_dense_replace=3))
    with pytest.raises(ConfigError, match="first_k_dense_replace='1' disagrees"):
        ModelSpec.from_hf(_with(GLM_47_FLASH, first_k_dense_replace="1"))


def test_the_published_rms_norm_eps_converts_with_a_note() -> None:
    model = config_bridge.megatron_spec(GLM_47_FLASH)
    assert (model.norm_epsilon, model.latent_norm_eps) == (1e-5, LATENT_EPS)
    note = config_bridge.latent_norm_note(model)
    assert note is not None and "\n" not in note
    assert "q_a_layernorm, kv_a_layernorm) use epsilon 1e-06" in note and "not rms_norm_eps=1e-05" in note
    assert "Megatron-LM's own layer spec would use rms_norm_eps for those two norms" in note
    assert config_bridge.latent_norm_note(config_bridge.megatron_spec(_with(GLM_47_FLASH, rms_norm_eps=1e-6))) is None


def test_latent_norms_at_rms_norm_eps_move_small_latents_logits_beyond_the_parity_tolerance(small_latent_glm) -> None:
    """What `test_parity`'s TP2 world would see of a megatron-core model with its own spec's latent norms
    (`rms_norm_eps`) on the purpose-built model: transformers' logits with those norms at 1e-5 against as published."""
    model = AutoModelForCausalLM.from_pretrained(small_latent_glm, dtype=torch.float32).eval()
    tokens = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    norms = [m for layer in model.model.layers for m in (layer.self_attn.q_a_layernorm, layer.self_attn.kv_a_layernorm)]
    assert {norm.variance_epsilon for norm in norms} == {LATENT_EPS} and model.config.rms_norm_eps == 1e-5
    with torch.no_grad():
        published = model(tokens).logits
        for norm in norms:
            norm.variance_epsilon = model.config.rms_norm_eps
        at_rms_norm_eps = model(tokens).logits
    assert (published - at_rms_norm_eps).abs().max() > 100 * 1e-4  # test_parity's tolerance


def test_its_shape_builds_megatron_mla_config_and_round_trips() -> None:
    """The published model (its latent norms' epsilon is the layer spec's: `megatron.latent_norm`)."""
    from megatron.core.transformer import MLATransformerConfig

    original = GLM_47_FLASH
    model = config_bridge.megatron_spec(original)
    layout = Layout(tp=2, ep=4)
    validate_layout(layout, model)
    config = MLATransformerConfig(**config_bridge.transformer_config_kwargs(model, layout, torch.bfloat16))
    assert (config.q_lora_rank, config.kv_lora_rank) == (768, 512)
    assert (config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim) == (192, 64, 256)
    assert (config.num_attention_heads, config.rope_type, config.rotary_base) == (20, "rope", 1000000)
    assert config.moe_layer_freq == [0] + [1] * 46 and config.num_moe_experts == 64 and config.moe_router_topk == 4
    assert config.moe_router_score_function == "sigmoid" and config.moe_router_enable_expert_bias
    assert config.moe_router_topk_scaling_factor == 1.8 and config.moe_router_num_groups is None
    assert config.moe_shared_expert_intermediate_size == 1536 and config.layernorm_epsilon == 1e-5
    back = model.to_hf()
    assert back["mlp_layer_types"] == _auto(original).mlp_layer_types and back["first_k_dense_replace"] == 1
    a, b = _auto(original), _auto(back)
    for field in (
        "q_lora_rank",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "n_routed_experts",
        "n_shared_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "mlp_layer_types",
        "n_group",
        "topk_group",
        "routed_scaling_factor",
        "norm_topk_prob",
        "rope_interleave",
        "rms_norm_eps",
    ):
        assert getattr(b, field) == getattr(a, field), field
    full = {"partial_rotary_factor": 1.0}  # written where it is not 1
    assert {**full, **b.rope_parameters} == {**full, **a.rope_parameters}
    args = config_bridge.megatron_args(model, layout, torch.bfloat16)
    assert config_bridge.from_megatron_args(args) == model


def test_exported_layer_types_build_transformers_dense_and_moe_layers() -> None:
    """The tiny model's MoE layers (1 and 3) around dense ones: transformers builds what the export writes."""
    exported = ModelSpec.from_hf(tiny_config("Glm4MoeLiteForCausalLM")).to_hf()
    assert "first_k_dense_replace" not in exported  # no leading dense count states [dense, sparse, dense, sparse]
    model = AutoModelForCausalLM.from_config(_auto(exported))
    routed = [hasattr(layer.mlp, "experts") for layer in model.model.layers]
    assert routed == [False, True, False, True]


TINY = tiny_config("Glm4MoeLiteForCausalLM")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"first_k_dense_replace": 2}, r"first_k_dense_replace=2 disagrees with mlp_layer_types \['dense', 'sparse'"),
        ({"mlp_layer_types": ["dense", "sparse"]}, r"mlp_layer_types=\['dense', 'sparse'\] .* num_hidden_layers=4"),
        ({"mlp_layer_types": ["dense", "moe", "dense", "moe"]}, r"must list 'dense' or 'sparse'"),
        ({"mlp_layer_types": ["dense"] * 4}, "mlp_layer_types has no 'sparse' layer"),
        ({"n_shared_experts": 0}, r"n_shared_experts=0 is not supported \(at least 1 shared expert\)"),
        ({"topk_method": "greedy"}, "topk_method='greedy' is not supported"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5 cannot be represented in megatron-core's MLA"),
        (
            {"mlp_layer_types": ["dense", "sparse", "sparse", "dense"], "num_nextn_predict_layers": 1},
            "num_nextn_predict_layers=1 cannot be represented in megatron-core with a dense last layer",
        ),
    ],
    ids=["dense_count", "layer_count", "layer_kind", "all_dense", "shared", "topk_method", "rotary", "mtp"],
)
def test_what_cannot_be_read_or_represented_is_refused_by_name(change: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config_bridge.megatron_spec(_with(TINY, **change))


def test_a_first_k_dense_replace_that_agrees_is_read(tmp_path: Path) -> None:
    """Published configs carry both fields; agreeing, the layer types place the layers."""
    config = _with(TINY, mlp_layer_types=["dense", "dense", "sparse", "sparse"], first_k_dense_replace=2)
    assert ModelSpec.from_hf(config).moe.moe_layers == (False, False, True, True)


def test_the_published_epsilon_converts_with_a_one_line_note_at_the_command_line(tiny_moe_models, tmp_path) -> None:
    source = tiny_moe_models["glm4_moe_lite"]
    assert json.loads((source / "config.json").read_text())["rms_norm_eps"] == 1e-5  # GLM-4.7-Flash's
    result = run("convert", "--to", "mcore", source, tmp_path / "out", "--no-progress")
    assert result.exit_code == 0, result.output
    notes = [line for line in result.output.splitlines() if line.startswith("note: ")]
    assert len(notes) == 1 and "use epsilon 1e-06 as transformers does, not rms_norm_eps=1e-05" in notes[0]
    assert "Megatron-LM's own layer spec would use rms_norm_eps" in notes[0]
    assert (tmp_path / "out" / "release").is_dir()
