"""Mixture-of-experts: Mixtral, Qwen3-MoE (with dense layers), Qwen2-MoE (shared expert), GLM-4.5 (sigmoid router
with score bias and groups, ungated shared expert, partial rotary) and DeepSeek-V3 (multi-latent attention, sigmoid
group-limited router; two variants) at EP2, TP2EP2 and PP2EP2: logit parity through real megatron-core, bit-exact
round trips in both formats, checkpoints saved by megatron-core, fused HF expert layouts, the router configuration
and its refusals, and GLM's multi-token-prediction layers."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from cli_errors import assert_one_line_error, run
from hf_weights import assert_same_weights
from megatron_ranks import legacy_load_ranks, random_save_ranks
from safetensors.torch import load_file, save_file

from hf_mcore_bridge.checkpoint.dcp_reader import DCPCheckpoint
from hf_mcore_bridge.checkpoint.hf_dir import read_json
from hf_mcore_bridge.convert import config_bridge
from hf_mcore_bridge.convert.layout import Layout, validate_layout
from hf_mcore_bridge.convert.to_hf import convert_mcore_to_hf
from hf_mcore_bridge.convert.to_mcore import convert_hf_to_mcore
from hf_mcore_bridge.errors import UnsupportedArchitectureError
from hf_mcore_bridge.megatron.verify import VerifyJob, _hf_logits, verify
from hf_mcore_bridge.megatron.world import run_world
from hf_mcore_bridge.models.config_errors import ConfigError
from hf_mcore_bridge.models.registry import get_architecture
from hf_mcore_bridge.models.tiny_models import build_tiny_model, tiny_config

LAYOUTS = {"ep2": Layout(ep=2), "tp2ep2": Layout(tp=2, ep=2), "pp2ep2": Layout(pp=2, ep=2)}
BIASED_EXPERTS = {"gpt_oss"}
"""Tiny models whose experts megatron-core holds only at expert tensor parallelism 1 (their parity worlds:
`tests/megatron/test_gpt_oss_parity.py`)."""


@pytest.mark.slow
@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_moe_logit_parity_through_megatron_core(layout_name, tiny_moe_models, tmp_path):
    layout = LAYOUTS[layout_name]
    jobs = []
    models = {name: d for name, d in tiny_moe_models.items() if name not in BIASED_EXPERTS}  # test_gpt_oss_parity
    for name, hf_dir in models.items():
        spec = "local" if name in ("qwen3_moe", "moonlight") else "te"  # both namings of the layers' norms
        convert_hf_to_mcore(hf_dir, tmp_path / name, layout=layout, spec=spec, show_progress=False)
        jobs.append(VerifyJob(hf_dir, tmp_path / name))
    # the check can fail: GLM's checkpoint against HF models that route or rotate otherwise (same weights)
    wrong = _glm_variants(tiny_moe_models["glm4_moe"], tmp_path) if layout_name == "ep2" else {}
    jobs += [VerifyJob(hf_dir, tmp_path / "glm4_moe") for hf_dir in wrong.values()]
    results = verify(jobs, layout, seq_len=20)
    for result in results[: len(models)]:
        assert result.max_abs_diff <= 1e-4, result.summary()
        assert result.top1_agreement == 1.0, result.summary()
    for name, result in zip(wrong, results[len(models) :], strict=True):
        assert result.max_abs_diff > 1e-3, f"{name}: {result.summary()}"


def _glm_variants(hf_dir: Path, root: Path) -> dict[str, Path]:
    """Copies of the tiny GLM with one routing or rotary setting changed (config), or its score bias zeroed."""
    config = read_json(hf_dir / "config.json")
    rope = dict(config["rope_parameters"], partial_rotary_factor=1.0)
    changes = {
        "no score bias": {},
        "no groups": {"topk_group": 4},
        "no scaling": {"routed_scaling_factor": 1.0},
        "full rotary": {"partial_rotary_factor": 1.0, "rope_parameters": rope},
    }
    out = {}
    for name, change in changes.items():
        directory = root / f"glm-{name.replace(' ', '-')}"
        shutil.copytree(hf_dir, directory)
        (directory / "config.json").write_text(json.dumps({**config, **change}))
        if name == "no score bias":
            tensors = load_file(directory / "model.safetensors")
            for key in [k for k in tensors if k.endswith("e_score_correction_bias")]:
                tensors[key] = torch.zeros_like(tensors[key])
            save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
        out[name] = directory
    return out


@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_moe_round_trips_are_bit_exact(layout_name, tiny_moe_models, tmp_path):
    for name, hf_dir in tiny_moe_models.items():
        for fmt, spec in (("torch_dist", "te"), ("torch_dist", "local"), ("torch", "local")):
            out = tmp_path / f"{name}-{fmt}-{spec}"
            layout = LAYOUTS[layout_name]
            if name in BIASED_EXPERTS:
                layout = replace(layout, etp=1)
                if fmt == "torch" and layout.tp > 1:  # the legacy format is written at etp = tp only
                    continue
            convert_hf_to_mcore(hf_dir, out, layout=layout, spec=spec, checkpoint_format=fmt, show_progress=False)
            convert_mcore_to_hf(out, tmp_path / f"{out.name}-hf", show_progress=False)
            assert_same_weights(hf_dir, tmp_path / f"{out.name}-hf")


def test_moe_checkpoint_keys_follow_megatron_core(tiny_moe_models, tmp_path):
    convert_hf_to_mcore(tiny_moe_models["mixtral"], tmp_path / "mixtral", layout=Layout(ep=2), show_progress=False)
    dcp = DCPCheckpoint(tmp_path / "mixtral" / "release")
    experts = dcp.tensor_meta("decoder.layers.mlp.experts.experts.linear_fc1.weight")
    assert experts.shape == (4, 8, 64, 64)  # (layers, experts, 2 x ffn, hidden): one chunk per (layer, expert)
    assert len(experts.chunks) == 4 * 8 * 2  # per (layer, expert): gate and up, as megatron's swiglu factory saves
    assert "decoder.layers.pre_mlp_layernorm.weight" in dcp.tensor_keys()  # Transformer-Engine spec naming
    assert "decoder.layers.mlp.experts.experts.linear_fc2._extra_state/shard_3.7_4.8" in dcp.object_keys()
    # a heterogeneous stack (Qwen3-MoE with a dense layer) keeps per-layer keys
    convert_hf_to_mcore(tiny_moe_models["qwen3_moe"], tmp_path / "q3", spec="local", show_progress=False)
    keys = DCPCheckpoint(tmp_path / "q3" / "release").tensor_keys()
    assert "decoder.layers.1.mlp.linear_fc1.weight" in keys and "decoder.layers.0.mlp.router.weight" in keys
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in keys  # local spec: MoE norm, dense name


def test_glm_expert_bias_stays_float32_in_a_bf16_model(tmp_path):
    """Published GLM-4.5 checkpoints store `e_score_correction_bias` in float32 beside bf16 weights: that is not a
    mixed checkpoint to refuse; both sides hold the bias in float32 (megatron-core's `router.expert_bias`)."""
    hf_dir = build_tiny_model(tmp_path / "hf", "Glm4MoeForCausalLM", seed=5, dtype=torch.bfloat16)
    source = load_file(hf_dir / "model.safetensors")
    assert source["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    convert_hf_to_mcore(hf_dir, tmp_path / "m", layout=Layout(tp=2, ep=2), show_progress=False)
    dcp = DCPCheckpoint(tmp_path / "m" / "release")
    bias = dcp.tensor_meta("decoder.layers.1.mlp.router.expert_bias")  # layer 0 is dense: per-layer keys
    assert bias.dtype.torch == torch.float32 and bias.shape == (8,)
    assert dcp.tensor_meta("decoder.layers.1.mlp.router.weight").dtype.torch == torch.bfloat16
    assert "decoder.layers.0.mlp.router.expert_bias" not in dcp.tensor_keys()  # the dense layer
    experts = dcp.tensor_meta("decoder.layers.2.mlp.experts.experts.linear_fc1.weight")
    assert experts.shape == (8, 64, 64) and len(experts.chunks) == 8 * 2 * 2  # per expert: gate_r, up_r of 2 ranks
    convert_mcore_to_hf(tmp_path / "m", tmp_path / "back", show_progress=False)
    assert_same_weights(hf_dir, tmp_path / "back")


def _add_mtp_layer(hf_dir: Path, out: Path) -> None:
    """A copy of a tiny GLM with one multi-token-prediction layer, stored as GLM-4.5 stores it: a decoder layer's
    tensors at index num_hidden_layers (the last layer's, changed), enorm, hnorm, eh_proj, shared_head.norm, and
    copies of the embedding and output layer."""
    shutil.copytree(hf_dir, out)
    config = read_json(out / "config.json")
    last, mtp = config["num_hidden_layers"] - 1, config["num_hidden_layers"]
    tensors = load_file(out / "model.safetensors")
    generator = torch.Generator().manual_seed(3)
    added = {
        name.replace(f"model.layers.{last}.", f"model.layers.{mtp}."): tensor
        + 0.05 * torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype)
        for name, tensor in tensors.items()
        if name.startswith(f"model.layers.{last}.")
    }
    hidden = config["hidden_size"]
    for name, shape in (
        ("enorm.weight", (hidden,)),
        ("hnorm.weight", (hidden,)),
        ("eh_proj.weight", (hidden, 2 * hidden)),
    ):
        added[f"model.layers.{mtp}.{name}"] = torch.randn(shape, generator=generator)
    added[f"model.layers.{mtp}.shared_head.norm.weight"] = torch.ones(hidden)
    added[f"model.layers.{mtp}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    added[f"model.layers.{mtp}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file({**tensors, **added}, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))


MTP_ATTENTION = {
    "glm4_moe": "self_attention.linear_qkv.bias",
    "glm4_moe_lite": "self_attention.linear_kv_up_proj.layer_norm_weight",  # GLM-4.7-Flash: multi-latent
}
"""A tensor of each GLM's attention that its MTP layer must hold."""


@pytest.mark.parametrize("name", sorted(MTP_ATTENTION))
def test_glm_multi_token_prediction_layers_convert_to_megatron_cores_mtp_and_back(name, tiny_moe_models, tmp_path):
    _add_mtp_layer(tiny_moe_models[name], tmp_path / "mtp")
    result = convert_hf_to_mcore(tmp_path / "mtp", tmp_path / "m", layout=Layout(ep=2), show_progress=False)
    assert result.model.mtp_layers == 1
    # GLM-4.7-Flash's tiny model has its published rms_norm_eps (1e-5): only the latent norms' note, no MTP note
    assert [n for n in result.notes if "latent norms" not in n] == []
    assert len(result.notes) == (name == "glm4_moe_lite")
    keys = set(DCPCheckpoint(tmp_path / "m" / "release").tensor_keys())
    layer = "mtp.layers.0.transformer_layer"
    assert {"mtp.layers.0.eh_proj.weight", f"{layer}.{MTP_ATTENTION[name]}"} <= keys
    assert {f"{layer}.mlp.router.expert_bias", f"{layer}.mlp.shared_experts.linear_fc1.weight"} <= keys
    back = convert_mcore_to_hf(tmp_path / "m", tmp_path / "back", show_progress=False)
    assert not back.notes
    assert_same_weights(tmp_path / "mtp", tmp_path / "back")  # the copies written again from the shared tensors
    assert read_json(tmp_path / "back" / "config.json")["num_nextn_predict_layers"] == 1


@pytest.mark.slow
def test_moe_checkpoint_saved_by_megatron_core_exports_to_matching_hf(tiny_moe_models, tmp_path):
    """Random GPTModels saved by megatron-core itself (its own key names, stacking and expert bias buffer)."""
    layout = Layout(ep=2)
    tokens = torch.randint(0, 211, (2, 12), generator=torch.Generator().manual_seed(4))
    jobs, hf_dirs = [], {}
    for name in ("qwen2_moe", "glm4_moe"):
        hf_dirs[name] = tiny_moe_models[name]
        config = read_json(hf_dirs[name] / "config.json")
        model_cfg = config_bridge.megatron_spec(config)
        jobs.append((model_cfg, str(tmp_path / f"{name}-saved"), str(tmp_path / f"{name}.pt")))
    run_world(random_save_ranks, layout, jobs, layout, tokens)
    for name, hf_dir in hf_dirs.items():
        convert_mcore_to_hf(tmp_path / f"{name}-saved", tmp_path / f"{name}-hf", hf_config=hf_dir, show_progress=False)
        megatron_logits = torch.load(tmp_path / f"{name}.pt", weights_only=True)
        assert (megatron_logits - _hf_logits(tmp_path / f"{name}-hf", tokens, "fp32")).abs().max() <= 1e-4, name


@pytest.mark.slow
def test_megatron_core_loads_legacy_moe_files_strictly(tiny_moe_models, tmp_path):
    layout = Layout(ep=2)
    tokens = torch.randint(0, 211, (2, 10), generator=torch.Generator().manual_seed(6))
    names = ("mixtral", "glm4_moe", "deepseek_v3", "qwen3_5_moe", "qwen3_next")  # the last two: Gated DeltaNet
    for name in names:
        convert_hf_to_mcore(
            tiny_moe_models[name],
            tmp_path / name,
            layout=layout,
            checkpoint_format="torch",
            spec="local",
            show_progress=False,
        )
    jobs = [(str(tmp_path / name), str(tmp_path / f"{name}.pt")) for name in names]
    run_world(legacy_load_ranks, layout, jobs, layout, tokens)
    for name in names:
        megatron_logits = torch.load(tmp_path / f"{name}.pt", weights_only=True)
        assert (megatron_logits - _hf_logits(tiny_moe_models[name], tokens, "fp32")).abs().max() <= 1e-4, name


def _fuse_experts(hf_dir: Path, out: Path, num_layers: int, num_experts: int) -> None:
    """The transformers-5 in-memory layout: experts stacked as gate_up_proj [E, 2F, H] and down_proj [E, H, F]."""
    shutil.copytree(hf_dir, out)
    tensors = load_file(out / "model.safetensors")
    for layer in range(num_layers):
        prefix = f"model.layers.{layer}.mlp.experts"
        if f"{prefix}.0.gate_proj.weight" not in tensors:
            continue
        gate_up = [
            torch.cat((tensors.pop(f"{prefix}.{e}.gate_proj.weight"), tensors.pop(f"{prefix}.{e}.up_proj.weight")))
            for e in range(num_experts)
        ]
        tensors[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
        tensors[f"{prefix}.down_proj"] = torch.stack(
            [tensors.pop(f"{prefix}.{e}.down_proj.weight") for e in range(num_experts)]
        )
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})


def test_fused_expert_layout_is_read(tiny_moe_models, tmp_path):
    hf_dir = tiny_moe_models["qwen3_moe"]
    _fuse_experts(hf_dir, tmp_path / "fused", num_layers=4, num_experts=8)
    convert_hf_to_mcore(tmp_path / "fused", tmp_path / "m", layout=Layout(ep=2), show_progress=False)
    convert_mcore_to_hf(tmp_path / "m", tmp_path / "back", show_progress=False)
    assert_same_weights(hf_dir, tmp_path / "back")  # exported per expert, the Hub's layout


PUBLISHED_MOE = {
    "mistralai/Mixtral-8x7B-v0.1": {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "vocab_size": 32000,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.02,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    },
    "Qwen/Qwen3-30B-A3B": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "attention_bias": False,
        "hidden_act": "silu",
    },
    "Qwen/Qwen1.5-MoE-A2.7B": {
        "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": "qwen2_moe",
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "vocab_size": 151936,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "hidden_act": "silu",
    },
}
_GLM45 = {
    "architectures": ["Glm4MoeForCausalLM"],
    "model_type": "glm4_moe",
    "attention_bias": True,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 5120,
    "partial_rotary_factor": 0.5,
    "intermediate_size": 12288,
    "max_position_embeddings": 131072,
    "moe_intermediate_size": 1536,
    "norm_topk_prob": True,
    "num_attention_heads": 96,
    "n_group": 1,
    "topk_group": 1,
    "n_routed_experts": 160,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "num_hidden_layers": 92,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_qk_norm": True,
    "vocab_size": 151552,
}
PUBLISHED_MOE |= {
    "zai-org/GLM-4.5": _GLM45,
    "zai-org/GLM-4.5-Air": {
        **_GLM45,
        "hidden_size": 4096,
        "intermediate_size": 10944,
        "moe_intermediate_size": 1408,
        "n_routed_experts": 128,
        "routed_scaling_factor": 1.0,
        "first_k_dense_replace": 1,
        "num_hidden_layers": 46,
        "use_qk_norm": False,
    },
    "zai-org/GLM-4.6": {**_GLM45, "max_position_embeddings": 202752},
}
MOE_FIELDS = (
    "n_routed_experts",
    "n_shared_experts",
    "first_k_dense_replace",
    "n_group",
    "topk_group",
    "routed_scaling_factor",
    "use_qk_norm",
    "attention_bias",
    "num_experts_per_tok",
    "router_aux_loss_coef",
    "norm_topk_prob",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "decoder_sparse_step",
    "mlp_only_layers",
    "intermediate_size",
    "num_local_experts",
    "num_experts",
)


@pytest.mark.parametrize("name", sorted(PUBLISHED_MOE))
def test_published_moe_config_round_trips_and_builds_megatron_config(name):
    from megatron.core.transformer import TransformerConfig
    from transformers import AutoConfig

    original = PUBLISHED_MOE[name]
    arch = get_architecture(original["architectures"][0])
    model = config_bridge.megatron_spec(original)
    back = model.to_hf()
    a = AutoConfig.for_model(original["model_type"], **{k: v for k, v in original.items() if k != "model_type"})
    b = AutoConfig.for_model(back["model_type"], **{k: v for k, v in back.items() if k != "model_type"})
    for field in MOE_FIELDS:
        if hasattr(a, field) and not (
            field == "intermediate_size"
            and arch.model_type != "mixtral"
            and not any(not m for m in model.moe.moe_layers)
        ):
            assert getattr(b, field) == getattr(a, field), field
    layout = Layout(tp=2, ep=4)
    validate_layout(layout, model)
    config = TransformerConfig(**config_bridge.transformer_config_kwargs(model, layout, torch.bfloat16))
    assert config.num_moe_experts == model.moe.num_experts and config.moe_router_topk == original["num_experts_per_tok"]
    assert config.moe_router_pre_softmax is (not original.get("norm_topk_prob", True))


def test_router_mapping():
    q3 = dict(PUBLISHED_MOE["Qwen/Qwen3-30B-A3B"])
    assert config_bridge.megatron_spec(q3).moe.pre_softmax is False  # renormalised top-k: megatron's default
    assert config_bridge.megatron_spec({**q3, "norm_topk_prob": False}).moe.pre_softmax is True
    layers = config_bridge.megatron_spec({**q3, "num_hidden_layers": 4, "mlp_only_layers": [0, 3]}).moe.moe_layers
    assert layers == (False, True, True, False)
    q2 = config_bridge.megatron_spec(PUBLISHED_MOE["Qwen/Qwen1.5-MoE-A2.7B"])
    assert q2.moe.shared_expert_size == 5632 and q2.moe.shared_expert_gate and q2.moe.pre_softmax
    mixtral = dict(PUBLISHED_MOE["mistralai/Mixtral-8x7B-v0.1"], router_jitter_noise=0.01)
    with pytest.raises(ConfigError, match="router_jitter_noise"):
        config_bridge.megatron_spec(mixtral)


def test_biased_and_clamped_experts_are_refused_where_megatron_core_computes_them_otherwise():
    """megatron-core biases experts only with every linear layer's bias (`add_bias_linear`: GPT-OSS's attention
    biases too), clamps with `quick_gelu`'s fixed slope 1.702 and on every MLP: anything else is refused by name."""
    spec = config_bridge.megatron_spec(PUBLISHED_MOE["Qwen/Qwen3-30B-A3B"])
    config_bridge.require_megatron_representable(spec)
    mixed = replace(spec.moe, moe_layers=(False, *spec.moe.moe_layers[1:]))
    for moe, field in (
        (replace(spec.moe, expert_mlp_bias=True), "gate_up_proj_bias"),
        (replace(spec.moe, swiglu_limit=7.0, swiglu_alpha=1.5), "swiglu_alpha"),
        (replace(mixed, swiglu_limit=7.0), "swiglu_limit"),
    ):
        with pytest.raises(ConfigError, match=field):
            config_bridge.require_megatron_representable(replace(spec, moe=moe))


def test_glm_router_mapping():
    """GLM-4.5's router fields as megatron-core's `moe_router_*` options; dense layers as `moe_layer_freq`."""
    from megatron.core.transformer import TransformerConfig

    glm = config_bridge.megatron_spec(PUBLISHED_MOE["zai-org/GLM-4.5"])
    assert glm.moe.moe_layers == (False,) * 3 + (True,) * 89 and glm.moe.shared_expert_size == 1536
    assert (glm.moe.topk_scaling_factor, glm.moe.num_groups, glm.moe.group_topk) == (2.5, None, None)
    assert (glm.qk_norm, glm.qkv_bias, glm.rope.partial_rotary_factor) == (True, True, 0.5)
    air = config_bridge.megatron_spec(PUBLISHED_MOE["zai-org/GLM-4.5-Air"])
    assert (air.qk_norm, air.qkv_bias, air.moe.topk_scaling_factor) == (False, True, None)
    kwargs = config_bridge.transformer_config_kwargs(glm, Layout(tp=2, ep=4), torch.bfloat16)
    config = TransformerConfig(**kwargs)
    assert config.moe_router_score_function == "sigmoid" and config.moe_router_enable_expert_bias
    assert config.moe_router_topk_scaling_factor == 2.5 and config.moe_router_dtype == "fp32"
    assert config.moe_layer_freq == [0, 0, 0] + [1] * 89 and config.moe_shared_expert_intermediate_size == 1536
    assert not config.moe_shared_expert_gate and config.moe_router_bias_update_rate == 0.0
    assert config_bridge.gpt_model_kwargs(glm, 151552)["rotary_percent"] == 0.5
    grouped = config_bridge.megatron_spec(tiny_config("Glm4MoeForCausalLM"))
    assert (grouped.moe.num_groups, grouped.moe.group_topk) == (4, 2)
    # transformers' defaults for fields a config.json lacks (Glm4MoeConfig): half-rotary, one dense layer
    sparse = {
        k: v
        for k, v in PUBLISHED_MOE["zai-org/GLM-4.5"].items()
        if k not in ("partial_rotary_factor", "first_k_dense_replace")
    }
    assert config_bridge.megatron_spec(sparse).rope.partial_rotary_factor == 0.5
    assert config_bridge.megatron_spec(sparse).moe.moe_layers[:2] == (False, True)


@pytest.mark.parametrize("name", ["zai-org/GLM-4.5", "zai-org/GLM-4.5-Air"])
def test_glm_megatron_args_round_trip(name):
    """Megatron-LM `args` carry the partial rotary and the router; without `hf_architecture` (a checkpoint that
    Megatron-LM wrote) the sigmoid router alone finds GLM, not Qwen2-MoE (the other shared-expert MoE with biases)."""
    model = config_bridge.megatron_spec(PUBLISHED_MOE[name])
    args = config_bridge.megatron_args(model, Layout(tp=2, ep=4), torch.bfloat16)
    assert args.rotary_percent == 0.5 and args.moe_router_score_function == "sigmoid"
    assert config_bridge.from_megatron_args(args) == model
    del args.hf_architecture
    assert config_bridge.from_megatron_args(args).architecture == "Glm4MoeForCausalLM"
    args.moe_router_score_function = "softmax"
    if model.qk_norm:  # no softmax-routed shared-expert architecture normalises q and k
        with pytest.raises(UnsupportedArchitectureError, match="qk_norm=True, qkv_bias=True, softmax router"):
            config_bridge.from_megatron_args(args)
    else:
        assert config_bridge.from_megatron_args(args).architecture == "Qwen2MoeForCausalLM"
    with pytest.raises(ConfigError, match="routes with softmax scores; this model's router uses sigmoid"):
        replace(model, architecture="Qwen2MoeForCausalLM").to_hf()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"norm_topk_prob": False}, "norm_topk_prob=False .* renormalises the top-k weights"),
        ({"n_group": 4, "topk_group": 1}, "num_experts_per_tok=4, topk_group=1 .* top 4 scores .* top 2"),
        ({"n_group": 8, "topk_group": 2}, "n_group=8 leaves 1 expert per group"),
        ({"n_group": 3}, "n_group=3 does not divide the 8 routed experts"),
        ({"topk_group": 5}, "topk_group=5 must be between 1 and n_group=4"),
        ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
        ({"partial_rotary_factor": 0.2}, "partial_rotary_factor=0.2 .* it rotates 3"),
        ({"first_k_dense_replace": 4}, "first_k_dense_replace=4 must be between 0 and num_hidden_layers - 1 = 3"),
        ({"n_shared_experts": 0}, "n_shared_experts=0"),
    ],
    ids=[
        "norm_topk_prob",
        "group_score",
        "group_size",
        "group_split",
        "topk_group",
        "scoring",
        "rotary",
        "dense",
        "shared",
    ],
)
def test_glm_settings_megatron_core_cannot_represent_are_refused_by_name(change, message):
    config = {**tiny_config("Glm4MoeForCausalLM"), **change}  # head_dim 16
    with pytest.raises(ConfigError, match=message):
        config_bridge.megatron_spec(config)


def test_moe_bad_input(tiny_moe_models, tmp_path):
    hf_dir = tiny_moe_models["mixtral"]
    result = run("convert", "--to", "mcore", hf_dir, tmp_path / "out", "--ep", "3", "--no-progress")
    assert_one_line_error(result, "num_experts=8 is not divisible by ep=3")
    convert_hf_to_mcore(hf_dir, tmp_path / "m", layout=Layout(ep=2), show_progress=False)
    config = json.loads((tmp_path / "m" / "hf_assets" / "config.json").read_text())
    config["num_local_experts"] = 4
    (tmp_path / "four.json").write_text(json.dumps(config))
    result = run(
        "convert", "--to", "hf", tmp_path / "m", tmp_path / "hf", "--hf-config", tmp_path / "four.json", "--no-progress"
    )
    assert_one_line_error(result, "mlp.router.weight", "(4, 8, 64)", "(4, 4, 64)", "num_experts=4")
    jitter = dict(read_json(hf_dir / "config.json"), router_jitter_noise=0.1)
    shutil.copytree(hf_dir, tmp_path / "jitter")
    (tmp_path / "jitter" / "config.json").write_text(json.dumps(jitter))
    result = run("convert", "--to", "mcore", tmp_path / "jitter", tmp_path / "out2", "--no-progress")
    assert_one_line_error(result, "router_jitter_noise")
