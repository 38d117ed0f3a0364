"""Mixture-of-experts: Mixtral, Qwen3-MoE (with dense layers), Qwen2-MoE (shared expert) and DeepSeek-V3 (multi-latent
attention, sigmoid group-limited router; two variants) at EP2, TP2EP2 and PP2EP2: logit parity through real
megatron-core, bit-exact round trips in both formats, checkpoints saved by megatron-core, fused HF expert layouts,
and the router configuration."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from megatron_ranks import legacy_load_rank, random_save_rank
from safetensors.torch import load_file, save_file
from test_bad_input import assert_one_line_error, run
from test_roundtrip import assert_same_weights

from hf_mcore_bridge.checkpoint.dcp_reader import DCPCheckpoint
from hf_mcore_bridge.checkpoint.hf_dir import read_json
from hf_mcore_bridge.convert import config_bridge
from hf_mcore_bridge.convert.config_errors import ConfigError
from hf_mcore_bridge.convert.layout import Layout
from hf_mcore_bridge.convert.to_hf import convert_mcore_to_hf
from hf_mcore_bridge.convert.to_mcore import convert_hf_to_mcore
from hf_mcore_bridge.mappings import get_architecture
from hf_mcore_bridge.megatron.verify import VerifyJob, _hf_logits, verify
from hf_mcore_bridge.megatron.world import run_world

LAYOUTS = {"ep2": Layout(ep=2), "tp2ep2": Layout(tp=2, ep=2), "pp2ep2": Layout(pp=2, ep=2)}


@pytest.mark.slow
@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_moe_logit_parity_through_megatron_core(layout_name, tiny_moe_models, tmp_path):
    layout = LAYOUTS[layout_name]
    jobs = []
    for name, hf_dir in tiny_moe_models.items():
        spec = "local" if name in ("qwen3_moe", "moonlight") else "te"  # both namings of the layers' norms
        convert_hf_to_mcore(hf_dir, tmp_path / name, layout=layout, spec=spec, show_progress=False)
        jobs.append(VerifyJob(hf_dir, tmp_path / name))
    for result in verify(jobs, layout, seq_len=20):
        assert result.max_abs_diff <= 1e-4, result.summary()
        assert result.top1_agreement == 1.0, result.summary()


@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_moe_round_trips_are_bit_exact(layout_name, tiny_moe_models, tmp_path):
    for name, hf_dir in tiny_moe_models.items():
        for fmt, spec in (("torch_dist", "te"), ("torch_dist", "local"), ("torch", "local")):
            out = tmp_path / f"{name}-{fmt}-{spec}"
            convert_hf_to_mcore(
                hf_dir, out, layout=LAYOUTS[layout_name], spec=spec, checkpoint_format=fmt, show_progress=False
            )
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


@pytest.mark.slow
def test_moe_checkpoint_saved_by_megatron_core_exports_to_matching_hf(tiny_moe_models, tmp_path):
    hf_dir = tiny_moe_models["qwen2_moe"]
    config = read_json(hf_dir / "config.json")
    model_cfg = config_bridge.from_hf(config, get_architecture(config["architectures"][0]))
    layout = Layout(ep=2)
    tokens = torch.randint(0, model_cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(4))
    run_world(random_save_rank, layout, model_cfg, layout, str(tmp_path / "saved"), tokens, str(tmp_path / "l.pt"))
    convert_mcore_to_hf(tmp_path / "saved", tmp_path / "hf", hf_config=hf_dir, show_progress=False)
    megatron_logits = torch.load(tmp_path / "l.pt", weights_only=True)
    assert (megatron_logits - _hf_logits(tmp_path / "hf", tokens, "fp32")).abs().max() <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["mixtral", "deepseek_v3"])
def test_megatron_core_loads_legacy_moe_files_strictly(variant, tiny_moe_models, tmp_path):
    hf_dir = tiny_moe_models[variant]
    layout = Layout(ep=2)
    convert_hf_to_mcore(
        hf_dir, tmp_path / "m", layout=layout, checkpoint_format="torch", spec="local", show_progress=False
    )
    tokens = torch.randint(0, 211, (2, 10), generator=torch.Generator().manual_seed(6))
    run_world(legacy_load_rank, layout, str(tmp_path / "m"), layout, tokens, str(tmp_path / "logits.pt"))
    megatron_logits = torch.load(tmp_path / "logits.pt", weights_only=True)
    assert (megatron_logits - _hf_logits(hf_dir, tokens, "fp32")).abs().max() <= 1e-4


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
MOE_FIELDS = (
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
    model = config_bridge.from_hf(original, arch)
    back = config_bridge.to_hf(model, arch)
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
    model.validate(layout)
    config = TransformerConfig(**config_bridge.transformer_config_kwargs(model, layout, torch.bfloat16))
    assert config.num_moe_experts == model.moe.num_experts and config.moe_router_topk == original["num_experts_per_tok"]
    assert config.moe_router_pre_softmax is (not original.get("norm_topk_prob", True))


def test_router_mapping():
    q3 = dict(PUBLISHED_MOE["Qwen/Qwen3-30B-A3B"])
    arch = get_architecture("Qwen3MoeForCausalLM")
    assert config_bridge.from_hf(q3, arch).moe.pre_softmax is False  # renormalised top-k: megatron's default
    assert config_bridge.from_hf({**q3, "norm_topk_prob": False}, arch).moe.pre_softmax is True
    layers = config_bridge.from_hf({**q3, "num_hidden_layers": 4, "mlp_only_layers": [0, 3]}, arch).moe.moe_layers
    assert layers == (False, True, True, False)
    q2 = config_bridge.from_hf(PUBLISHED_MOE["Qwen/Qwen1.5-MoE-A2.7B"], get_architecture("Qwen2MoeForCausalLM"))
    assert q2.moe.shared_expert_size == 5632 and q2.moe.shared_expert_gate and q2.moe.pre_softmax
    mixtral = dict(PUBLISHED_MOE["mistralai/Mixtral-8x7B-v0.1"], router_jitter_noise=0.01)
    with pytest.raises(ConfigError, match="router_jitter_noise"):
        config_bridge.from_hf(mixtral, get_architecture("MixtralForCausalLM"))


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
