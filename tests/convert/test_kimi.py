"""Kimi-K2 (`model_type` `kimi_k2`, a DeepSeek-V3) and Kimi-K2.5's language model: their published configs against
megatron-core's own `MLATransformerConfig`, what the DeepSeek-V3 path refuses of them (by name), and a tiny Kimi-K2
through conversion, export and the engine against transformers' DeepSeek-V3 (which is how transformers reads
`kimi_k2`). Kimi-K2.5's wrapper itself: `test_vision_language`.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from cli_errors import run
from hf_weights import assert_same_weights
from transformers import AutoConfig, AutoModelForCausalLM

from hf_mcore_bridge.convert import config_bridge
from hf_mcore_bridge.convert.fp8_checkpoint import is_fp8_config
from hf_mcore_bridge.convert.layout import Layout, validate_layout
from hf_mcore_bridge.convert.to_hf import convert_mcore_to_hf
from hf_mcore_bridge.convert.to_mcore import convert_hf_to_mcore
from hf_mcore_bridge.engine import Engine, EngineConfig, SamplingParams
from hf_mcore_bridge.engine.arch import read_spec
from hf_mcore_bridge.models.config_errors import ConfigError
from hf_mcore_bridge.models.spec import ModelSpec

KIMI_K2 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "kimi_k2",
    "auto_map": {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModel": "modeling_deepseek.DeepseekV3Model",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
    },
    "attention_bias": False,
    "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "bos_token_id": 163584,
    "eos_token_id": 163585,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 131072,
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 1,
    "n_routed_experts": 384,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 64,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 64,
    "num_nextn_predict_layers": 0,
    "pretraining_tp": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 50000.0,
    "routed_scaling_factor": 2.827,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 163840,
}
"""moonshotai/Kimi-K2-Instruct's config.json (architecture fields as released)."""

KIMI_K25_TEXT = {
    **{k: v for k, v in KIMI_K2.items() if k not in ("quantization_config", "auto_map")},
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {**KIMI_K2["rope_scaling"], "beta_fast": 32.0, "factor": 64.0},
    "quantization_config": {
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"group_size": 32, "num_bits": 4, "strategy": "group", "symmetric": True, "type": "int"},
            }
        },
        "format": "pack-quantized",
        "quant_method": "compressed-tensors",
    },
}
"""moonshotai/Kimi-K2.5's `text_config` (architecture fields as released): Kimi-K2-Thinking's language model, its
routed experts' weights int4 (compressed-tensors, groups of 32)."""

KIMI_K25 = {
    "architectures": ["KimiK25ForConditionalGeneration"],
    "model_type": "kimi_k25",
    "text_config": KIMI_K25_TEXT,
    "vision_config": {"mm_hidden_size": 1152, "patch_size": 14, "vt_hidden_size": 1152, "vt_num_hidden_layers": 27},
    "tie_word_embeddings": False,
}
"""moonshotai/Kimi-K2.5's config.json, its vision tower's fields shortened."""


def test_kimi_k2s_published_config_is_deepseek_v3s_and_builds_megatron_cores_mla_config():
    from megatron.core.transformer import MLATransformerConfig

    model = config_bridge.megatron_spec(KIMI_K2)
    as_deepseek = {**KIMI_K2, "model_type": "deepseek_v3"}  # what transformers is given for `kimi_k2`
    assert model == config_bridge.megatron_spec(as_deepseek)
    assert ModelSpec.from_hf({k: v for k, v in KIMI_K2.items() if k != "architectures"}) == model  # by model_type
    layout = Layout(tp=8, ep=8, pp=1)
    validate_layout(layout, model)
    config = MLATransformerConfig(**config_bridge.transformer_config_kwargs(model, layout, torch.bfloat16))
    assert (config.num_attention_heads, config.q_lora_rank, config.kv_lora_rank) == (64, 1536, 512)
    assert config.num_moe_experts == 384 and config.moe_router_topk == 8 and config.moe_router_num_groups is None
    assert config.moe_router_topk_scaling_factor == 2.827 and config.moe_layer_freq == [0] + [1] * 60
    assert (config.rotary_scaling_factor, config.beta_fast, config.beta_slow) == (32.0, 1.0, 1.0)
    assert is_fp8_config(KIMI_K2)  # read as DeepSeek-V3's FP8 blocks
    back = AutoConfig.for_model("deepseek_v3", **{k: v for k, v in model.to_hf().items() if k != "model_type"})
    hf = AutoConfig.for_model("deepseek_v3", **{k: v for k, v in as_deepseek.items() if k != "model_type"})
    for field in ("rope_parameters", "n_routed_experts", "routed_scaling_factor", "q_lora_rank", "topk_group"):
        assert getattr(back, field) == getattr(hf, field), field
    args = config_bridge.megatron_args(model, layout, torch.bfloat16)
    assert config_bridge.from_megatron_args(args) == model


def test_what_the_deepseek_path_refuses_of_kimi_k25s_language_model_is_named():
    """Kimi-K2.5's language model holds int4 experts (compressed-tensors): conversion refuses them by name. Its
    `rms_norm_eps: 1e-5`, beside transformers' latent norms at 1e-6, converts with a note (the layer spec builds
    the latent norms at 1e-6: `megatron.latent_norm`). The engine, which keeps transformers' latent epsilon, runs
    the description."""
    model = config_bridge.megatron_spec(KIMI_K25)
    assert (model.norm_epsilon, model.latent_norm_eps, model.num_layers) == (1e-5, 1e-6, 61)
    assert "use epsilon 1e-06 as transformers does, not rms_norm_eps=1e-05" in config_bridge.latent_norm_note(model)
    with pytest.raises(ConfigError, match="compressed-tensors"):
        is_fp8_config(KIMI_K25_TEXT)
    spec = read_spec(KIMI_K25)
    assert spec.architecture == "DeepseekV3ForCausalLM" and spec.norm_epsilon == 1e-5
    assert spec.rope.rope_type == "yarn" and spec.max_position_embeddings == 262144
    refused = {"quantization_config"}  # nothing else: without it, it converts
    text = {k: v for k, v in KIMI_K25_TEXT.items() if k not in refused}
    assert config_bridge.megatron_spec({**KIMI_K25, "text_config": text}).num_layers == 61


@pytest.fixture(scope="module")
def kimi_k2(tiny_moe_models, tmp_path_factory):
    """The tiny DeepSeek-V3 as Kimi-K2 publishes its config: `model_type` `kimi_k2`."""
    directory = tmp_path_factory.mktemp("kimi_k2") / "hf"
    shutil.copytree(tiny_moe_models["deepseek_v3"], directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "model_type": "kimi_k2"}, indent=1))
    return directory


def test_a_kimi_k2_checkpoint_converts_exports_and_runs_as_deepseek_v3(kimi_k2, tiny_moe_models, tmp_path):
    convert_hf_to_mcore(kimi_k2, tmp_path / "m", show_progress=False)  # layouts: DeepSeek-V3's own tests
    convert_mcore_to_hf(tmp_path / "m", tmp_path / "hf", show_progress=False)
    assert_same_weights(kimi_k2, tmp_path / "hf")
    assert (tmp_path / "hf" / "config.json").read_bytes() == (kimi_k2 / "config.json").read_bytes()  # kimi_k2 kept
    reference = AutoModelForCausalLM.from_pretrained(tiny_moe_models["deepseek_v3"], dtype=torch.float32).eval()
    config = EngineConfig(device="cpu", dtype=torch.float32, max_model_len=64, kv_cache_memory_bytes=1 << 22)
    engine = Engine.from_pretrained(tmp_path / "hf", config)
    prompt = torch.randint(0, 211, (9,), generator=torch.Generator().manual_seed(1)).tolist()
    (output,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4))
    sample = output.samples[0]
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + sample.token_ids])).logits[0]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    expected = [logprobs[len(prompt) - 1 + i, t].item() for i, t in enumerate(sample.token_ids)]
    assert sample.logprobs == pytest.approx(expected, abs=1e-5)


def test_a_kimi_k25_with_its_rms_norm_eps_converts_with_one_line_notes(tmp_path):
    """The tiny Kimi-K2.5 of `test_vision_language` with K2.5's `rms_norm_eps`: converted, with the wrapper's
    notice and the latent norms' one line each; export gives the whole class back, its epsilon kept."""
    from test_vision_language import _kimi_k25

    model = _kimi_k25()
    model.config.text_config.rms_norm_eps = KIMI_K25_TEXT["rms_norm_eps"]
    model.save_pretrained(tmp_path / "hf")
    result = run("convert", "--to", "mcore", tmp_path / "hf", tmp_path / "out", "--no-progress")
    assert result.exit_code == 0, result.output
    notes = [line for line in result.output.splitlines() if line.startswith("note: ")]
    assert len(notes) == 2 and "Kimi_K25ForConditionalGeneration: its language model" in notes[0]
    assert "not rms_norm_eps=1e-05" in notes[1] and "Megatron-LM's own layer spec would use rms_norm_eps" in notes[1]
    convert_mcore_to_hf(tmp_path / "out", tmp_path / "back", show_progress=False)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["text_config"]["rms_norm_eps"] == 1e-5
