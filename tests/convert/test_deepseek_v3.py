"""DeepSeek-V3 (`DeepseekV3ForCausalLM`): multi-latent attention, YaRN and the sigmoid group-limited router.

Logit parity through megatron-core runs in the shared worlds of `test_moe` (EP2, TP2 x EP2, PP2 x EP2) and
`test_parity` (TP2, PP2), and the bit-exact round trips in `test_moe`'s, for the two tiny variants of
`tiny_variants.MOE_VARIANTS`: DeepSeek-V3-like (low-rank query, YaRN, 4 groups of 4 experts) and Moonlight-like
(full-rank `q_proj`, plain RoPE in rotate-half order, no groups). Here: the published config through
megatron-core's own `MLATransformerConfig` and back, the refusals, the rotary-row permutation against a layout
written out in the test, and what the checkpoint holds.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from cli_errors import assert_one_line_error, run
from hf_weights import assert_same_weights
from megatron_ranks import mtp_logits_rank
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from hf_mcore_bridge.checkpoint.dcp_reader import DCPCheckpoint
from hf_mcore_bridge.checkpoint.megatron_dirs import read_common
from hf_mcore_bridge.convert import config_bridge
from hf_mcore_bridge.convert.layout import Layout, validate_layout
from hf_mcore_bridge.convert.to_hf import convert_mcore_to_hf
from hf_mcore_bridge.convert.to_mcore import convert_hf_to_mcore
from hf_mcore_bridge.errors import CheckpointError
from hf_mcore_bridge.megatron.world import run_world
from hf_mcore_bridge.models.config_errors import ConfigError
from hf_mcore_bridge.models.registry import get_architecture
from hf_mcore_bridge.models.tensor_ops import deinterleave_rotary_rows, interleave_rotary_rows

ARCH = get_architecture("DeepseekV3ForCausalLM")

DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
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
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}
"""deepseek-ai/DeepSeek-V3's config.json (architecture fields as released)."""

FULL_RANK_Q = {"q_lora_rank": None, "n_group": 1, "topk_group": 1, "rope_scaling": None, "num_experts_per_tok": 6}
"""Moonlight's kind of model: a full-rank query projection, no expert groups, plain RoPE."""


def _with(**changes):
    config = copy.deepcopy(DEEPSEEK_V3)
    config.update(changes)
    return config


def _auto(config: dict) -> object:
    return AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items() if k != "model_type"})


@pytest.mark.parametrize("variant", ["as published", "full-rank query"])
def test_published_config_builds_megatron_mla_config_and_round_trips(variant):
    from megatron.core.transformer import MLATransformerConfig

    original = DEEPSEEK_V3 if variant == "as published" else _with(**FULL_RANK_Q)
    model = config_bridge.megatron_spec(original)
    layout = Layout(tp=8, ep=8, pp=1)
    validate_layout(layout, model)
    config = MLATransformerConfig(**config_bridge.transformer_config_kwargs(model, layout, torch.bfloat16))
    assert (config.q_lora_rank, config.kv_lora_rank) == (original["q_lora_rank"], 512)
    assert (config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim) == (128, 64, 128)
    assert config.moe_router_score_function == "sigmoid" and config.moe_router_enable_expert_bias
    assert config.moe_router_topk_scaling_factor == 2.5 and config.moe_router_dtype == "fp32"
    assert config.moe_shared_expert_intermediate_size == 2048 and config.moe_router_bias_update_rate == 0.0
    assert config.moe_layer_freq == [0, 0, 0] + [1] * 58
    if variant == "as published":
        assert (config.moe_router_num_groups, config.moe_router_group_topk) == (8, 4)
        assert (config.rope_type, config.rotary_scaling_factor, config.mscale, config.mscale_all_dim) == (
            "yarn",
            40,
            1.0,
            1.0,
        )
        assert config.original_max_position_embeddings == 4096 and (config.beta_fast, config.beta_slow) == (32, 1)
    else:
        assert config.moe_router_num_groups is None and config.rope_type == "rope"
    back = model.to_hf()
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
        "first_k_dense_replace",
        "n_group",
        "topk_group",
        "routed_scaling_factor",
        "norm_topk_prob",
        "rope_interleave",
        "head_dim",
        "rope_parameters",
    ):
        assert getattr(b, field) == getattr(a, field), field
    # megatron-core's args describe the same model (a checkpoint converted here rebuilds it without HF assets)
    args = config_bridge.megatron_args(model, layout, torch.bfloat16)
    assert config_bridge.from_megatron_args(args) == model


def test_published_fp8_configs_name_their_scale_formats():
    """DeepSeek-V3's published `quantization_config` has no `scale_fmt`: its `weight_scale_inv` are any float32
    (amax / 448), which `--fp8-scale-format source` keeps; DeepSeek-V3.1's says `scale_fmt: ue8m0` (powers of
    two). Both are written back field for field."""
    from hf_mcore_bridge.convert.fp8_checkpoint import quantization_config, source_scale_format

    v31 = _with(quantization_config={**DEEPSEEK_V3["quantization_config"], "scale_fmt": "ue8m0"})
    assert source_scale_format(DEEPSEEK_V3) == "float32" and source_scale_format(v31) == "ue8m0"
    assert quantization_config("float32", DEEPSEEK_V3) == DEEPSEEK_V3["quantization_config"]
    assert quantization_config("ue8m0", v31) == v31["quantization_config"]
    assert quantization_config("ue8m0", DEEPSEEK_V3) == v31["quantization_config"]  # V3.1's fields for pow2
    assert quantization_config("float32", v31) == DEEPSEEK_V3["quantization_config"]
    assert source_scale_format({k: v for k, v in DEEPSEEK_V3.items() if k != "quantization_config"}) is None


def test_megatron_yarn_and_softmax_scale_equal_hf(monkeypatch):
    """megatron-core's YaRN frequencies, rotary concentration and softmax scale from our config equal HF's."""
    if not torch.cuda.is_available():  # megatron-core moves the frequencies to the current CUDA device
        monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        YarnRotaryEmbedding,
        _yarn_get_mscale,
    )
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    for rope in (
        {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "mscale": 0.707, "mscale_all_dim": 1},
        {"type": "yarn", "factor": 8, "original_max_position_embeddings": 4096, "mscale": 1.0},
        {"type": "yarn", "factor": 32, "original_max_position_embeddings": 4096, "beta_fast": 1.0, "beta_slow": 1.0},
    ):
        original = _with(rope_scaling=rope)
        yarn = config_bridge.transformer_config_kwargs(config_bridge.megatron_spec(original), Layout(), torch.float32)
        rotary = YarnRotaryEmbedding(
            64,
            rotary_base=10000,
            scaling_factor=yarn["rotary_scaling_factor"],
            original_max_position_embeddings=yarn["original_max_position_embeddings"],
            beta_fast=yarn["beta_fast"],
            beta_slow=yarn["beta_slow"],
            mscale=yarn["mscale"],
            mscale_all_dim=yarn["mscale_all_dim"],
            use_cpu_initialization=True,
        )
        emb, concentration = rotary.get_emb(16)
        hf = _auto(original)
        inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
        assert torch.equal(emb[:, 0, 0, :32], torch.outer(torch.arange(16.0), inv_freq))
        assert concentration == pytest.approx(attention_factor, rel=1e-12)
        scale = _yarn_get_mscale(yarn["rotary_scaling_factor"], yarn["mscale_all_dim"]) ** 2 / math.sqrt(192)
        assert scale == pytest.approx(yarn_apply_mscale(hf.rope_parameters, 192**-0.5), rel=1e-12)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"topk_method": "group_limited_greedy"}, "topk_method"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"moe_layer_freq": 2}, "moe_layer_freq"),
        ({"topk_group": 2}, "topk_group"),  # groups ranked by their top 4 in megatron-core, top 2 in HF
        ({"norm_topk_prob": False}, "norm_topk_prob"),
        ({"num_experts_per_tok": 1, "n_group": 1, "topk_group": 1}, "norm_topk_prob"),  # one expert: HF renormalises it
        ({"num_key_value_heads": 8}, "num_key_value_heads"),
        ({"attention_bias": True}, "attention_bias"),
        ({"rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "truncate": False}},
         "truncate"),
        ({"rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 4096,
                           "attention_factor": 1.2}}, "attention_factor"),
        ({"rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 4096,
                           "mscale_all_dim": 1.0}}, "mscale_all_dim"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192}}, "rope_type"),
    ],
)  # fmt: skip
def test_what_megatron_core_computes_otherwise_is_refused_by_name(changes, field):
    with pytest.raises(ConfigError, match=field):
        config_bridge.megatron_spec(_with(**changes))


def test_an_rms_norm_eps_other_than_the_latent_norms_converts_with_a_note():
    """transformers' latent norms stay at 1e-6 (the layer spec builds them so: `megatron.latent_norm`)."""
    model = config_bridge.megatron_spec(_with(rms_norm_eps=1e-5))
    assert (model.norm_epsilon, model.latent_norm_eps) == (1e-5, 1e-6)
    assert "use epsilon 1e-06 as transformers does, not rms_norm_eps=1e-05" in config_bridge.latent_norm_note(model)
    assert config_bridge.latent_norm_note(config_bridge.megatron_spec(_with())) is None  # 1e-6: nothing to say


def test_trivial_groups_and_one_unnormalised_expert_are_represented():
    assert config_bridge.megatron_spec(_with(topk_group=8)).moe.num_groups is None  # every group chosen
    one = config_bridge.megatron_spec(_with(num_experts_per_tok=1, n_group=1, topk_group=1, norm_topk_prob=False))
    assert one.moe.topk == 1 and one.moe.num_groups is None
    assert config_bridge.megatron_spec(_with(num_experts_per_tok=9)).moe.group_topk == 4  # 9 // 4 == 2 as well


def _reference_interleave(weight: torch.Tensor, period: int, offset: int, width: int) -> torch.Tensor:
    """Row by row: in each group, rotary row i (rotate-half order) goes to 2i, row i + width/2 to 2i + 1."""
    out = weight.clone()
    half = width // 2
    for start in range(0, weight.shape[0], period):
        for i in range(half):
            out[start + offset + 2 * i] = weight[start + offset + i]
            out[start + offset + 2 * i + 1] = weight[start + offset + half + i]
    return out


@pytest.mark.parametrize(("groups", "period", "offset", "width"), [(3, 24, 16, 8), (1, 32, 24, 8), (2, 6, 0, 6)])
def test_rotary_rows_are_interleaved_as_written_out_and_back(groups, period, offset, width):
    weight = torch.randn(groups * period, 5)
    paired = interleave_rotary_rows(weight, period, offset, width)
    assert torch.equal(paired, _reference_interleave(weight, period, offset, width))
    assert torch.equal(deinterleave_rotary_rows(paired, period, offset, width), weight)
    assert not torch.equal(paired, weight)  # the check sees a permutation left out


def test_rotate_half_weights_give_the_same_scores_as_interleaved_ones():
    """HF's rotate-half RoPE on rows R equals megatron-core's MLA RoPE (pairs 2i, 2i+1, de-interleaved before the
    rotation) on `interleave_rotary_rows(R)`: equal q.k for every position pair."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb

    dim, seq = 8, 6
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.outer(torch.arange(seq).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    q_hf, k_hf = (torch.randn(dim, dim) for _ in range(2))
    act = torch.randn(seq, dim)
    q_rot, k_rot = apply_rotary_pos_emb(
        (act @ q_hf.T)[None, None], (act @ k_hf.T)[None, None], emb.cos()[None], emb.sin()[None]
    )

    def megatron_rope(weight: torch.Tensor) -> torch.Tensor:
        rows = (act @ weight.T)[:, None, None]
        return _apply_rotary_pos_emb_bshd(rows, emb[:, None, None], multi_latent_attention=True)[:, 0, 0]

    ours = [megatron_rope(interleave_rotary_rows(w, dim, 0, dim)) for w in (q_hf, k_hf)]
    assert torch.allclose(ours[0] @ ours[1].T, q_rot[0, 0] @ k_rot[0, 0].T, atol=1e-5)
    plain = [megatron_rope(w) for w in (q_hf, k_hf)]
    assert not torch.allclose(plain[0] @ plain[1].T, q_rot[0, 0] @ k_rot[0, 0].T, atol=1e-3)  # unpermuted: wrong


def test_checkpoint_holds_megatron_cores_mla_names(tiny_moe_models, tmp_path):
    convert_hf_to_mcore(tiny_moe_models["deepseek_v3"], tmp_path / "te", layout=Layout(ep=2), show_progress=False)
    keys = DCPCheckpoint(tmp_path / "te" / "release").tensor_keys()
    attention = "decoder.layers.1.self_attention"
    for name in ("linear_q_down_proj.weight", "linear_q_up_proj.layer_norm_weight", "linear_kv_up_proj.weight"):
        assert f"{attention}.{name}" in keys, name
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in keys  # dense layer 0: TE's fused norm
    assert "decoder.layers.1.pre_mlp_layernorm.weight" in keys and "decoder.layers.1.mlp.router.expert_bias" in keys
    assert DCPCheckpoint(tmp_path / "te" / "release").tensor_meta(
        "decoder.layers.1.mlp.experts.experts.linear_fc1.weight"
    ).shape == (16, 64, 64)
    convert_hf_to_mcore(tiny_moe_models["moonlight"], tmp_path / "local", spec="local", show_progress=False)
    keys = DCPCheckpoint(tmp_path / "local" / "release").tensor_keys()
    assert "decoder.layers.1.self_attention.linear_q_proj.weight" in keys  # full-rank query
    assert "decoder.layers.1.self_attention.kv_layernorm.weight" in keys  # the local MLA spec's own names
    assert "decoder.layers.0.pre_mlp_layernorm.weight" in keys


def test_the_megatron_bridge_layout_is_refused_for_mla(tiny_moe_models, tmp_path):
    with pytest.raises(ConfigError, match="Megatron-Bridge layout"):
        convert_hf_to_mcore(
            tiny_moe_models["deepseek_v3"], tmp_path / "b", directory_layout="megatron-bridge", show_progress=False
        )
    assert not (tmp_path / "b").exists()


def _with_mtp_layer(hf_dir: Path, out: Path, *, copies_equal: bool = True, seed: int = 9) -> Path:
    """`hf_dir` plus one MTP layer as DeepSeek publishes it (HF layer N): its decoder layer (layer N-1's weights,
    changed), `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`, and copies of the embedding and output layer."""
    shutil.copytree(hf_dir, out)
    tensors = load_file(out / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    last, mtp = config["num_hidden_layers"] - 1, config["num_hidden_layers"]
    generator = torch.Generator().manual_seed(seed)

    def noise(like: torch.Tensor, scale: float) -> torch.Tensor:
        return torch.randn(like.shape, generator=generator) * scale

    for name in list(tensors):
        if name.startswith(f"model.layers.{last}."):
            value = tensors[name]
            tensors[name.replace(f"layers.{last}.", f"layers.{mtp}.")] = value + noise(value, 0.05)
    hidden = config["hidden_size"]
    prefix = f"model.layers.{mtp}"
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"{prefix}.{norm}.weight"] = 1 + noise(torch.empty(hidden), 0.1)
    tensors[f"{prefix}.eh_proj.weight"] = noise(torch.empty(hidden, 2 * hidden), 0.05)
    tensors[f"{prefix}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    head = tensors["lm_head.weight"].clone()
    tensors[f"{prefix}.shared_head.head.weight"] = head if copies_equal else head + 1e-3
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    return out


@pytest.fixture(scope="module")
def mtp_model(tiny_moe_models, tmp_path_factory):
    return _with_mtp_layer(tiny_moe_models["deepseek_v3"], tmp_path_factory.mktemp("mtp") / "hf")


def test_mtp_layers_convert_to_megatron_cores_mtp_and_back(mtp_model, tmp_path):
    for fmt, spec in (("te", "te"), ("local", "local")):
        out = tmp_path / fmt
        result = convert_hf_to_mcore(mtp_model, out, layout=Layout(tp=2, ep=2), spec=spec, show_progress=False)
        assert result.model.mtp_layers == 1 and not result.notes
        assert config_bridge.from_megatron_args(read_common(out / "release")["args"]).mtp_layers == 1
        convert_mcore_to_hf(out, tmp_path / f"{fmt}-hf", show_progress=False)
        assert_same_weights(mtp_model, tmp_path / f"{fmt}-hf")  # the copies written again from the shared tensors
    keys = set(DCPCheckpoint(tmp_path / "te" / "release").tensor_keys())
    assert {"mtp.layers.0.eh_proj.weight", "mtp.layers.0.enorm.weight", "mtp.layers.0.final_layernorm.weight"} <= keys
    layer = "mtp.layers.0.transformer_layer"
    assert f"{layer}.self_attention.linear_kv_up_proj.layer_norm_weight" in keys
    experts = DCPCheckpoint(tmp_path / "te" / "release").tensor_meta(f"{layer}.mlp.experts.experts.linear_fc1.weight")
    assert experts.shape == (16, 64, 64)  # unstacked MTP layer, experts on the leading axis
    assert f"{layer}.self_attention.kv_layernorm.weight" in DCPCheckpoint(tmp_path / "local" / "release").tensor_keys()


def test_mtp_layers_megatron_core_cannot_hold_are_dropped_with_a_notice_or_refused(
    mtp_model, tiny_moe_models, tmp_path
):
    differing = _with_mtp_layer(tiny_moe_models["deepseek_v3"], tmp_path / "differs", copies_equal=False)
    result = convert_hf_to_mcore(differing, tmp_path / "dropped", show_progress=False)
    (note,) = result.notes
    assert "1 multi-token-prediction layer(s) dropped" in note and "shared_head.head.weight differs" in note
    assert result.model.mtp_layers == 0
    assert not any(k.startswith("mtp.") for k in DCPCheckpoint(tmp_path / "dropped" / "release").tensor_keys())
    export = convert_mcore_to_hf(tmp_path / "dropped", tmp_path / "dropped-hf", show_progress=False)
    assert json.loads((tmp_path / "dropped-hf" / "config.json").read_text())["num_nextn_predict_layers"] == 0
    assert "holds 0" in export.notes[0]
    with pytest.raises(CheckpointError, match=r"cannot be converted: .*differs"):
        convert_hf_to_mcore(differing, tmp_path / "strict", strict_mtp=True, show_progress=False)
    result = run("convert", "--to", "mcore", differing, tmp_path / "cli", "--strict-mtp", "--no-progress")
    assert_one_line_error(result, "multi-token-prediction", "differs")
    legacy = convert_hf_to_mcore(mtp_model, tmp_path / "legacy", checkpoint_format="torch", spec="local",
                                 show_progress=False)  # fmt: skip
    assert "legacy torch format" in legacy.notes[0] and legacy.model.mtp_layers == 0
    # transformers' own DeepSeek-V3 declares one MTP layer and saves none
    declared = tmp_path / "declared"
    shutil.copytree(tiny_moe_models["deepseek_v3"], declared)
    config = json.loads((declared / "config.json").read_text())
    (declared / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    result = convert_hf_to_mcore(declared, tmp_path / "none", show_progress=False)
    assert "holds none of their tensors" in result.notes[0] and result.model.mtp_layers == 0


@pytest.mark.slow
def test_megatron_cores_mtp_layer_computes_deepseeks(mtp_model, tmp_path):
    """The converted MTP layer loads into megatron-core's MTP (built on the local spec, TP2) and its logits equal a
    reference built from HF's own DeepSeek-V3 decoder layer: next token's embedding and the model's final hidden
    state, each normed, projected by `eh_proj`, through the layer, normed, through the output layer."""
    from transformers import AutoModelForCausalLM
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

    layout = Layout(tp=2)
    convert_hf_to_mcore(mtp_model, tmp_path / "m", layout=layout, show_progress=False)
    tokens = torch.randint(0, 211, (2, 12), generator=torch.Generator().manual_seed(2))
    run_world(mtp_logits_rank, layout, str(tmp_path / "m"), layout, tokens, str(tmp_path / "logits.pt"))
    mtp_logits, main_logits = torch.load(tmp_path / "logits.pt", weights_only=True)

    tensors = load_file(mtp_model / "model.safetensors")
    main = AutoModelForCausalLM.from_pretrained(mtp_model, dtype=torch.float32).eval()
    layers = main.config.num_hidden_layers
    longer = AutoModelForCausalLM.from_pretrained(mtp_model, dtype=torch.float32, num_hidden_layers=layers + 1)
    prefix = f"model.layers.{layers}"

    def norm(name: str) -> DeepseekV3RMSNorm:
        module = DeepseekV3RMSNorm(main.config.hidden_size, eps=main.config.rms_norm_eps)
        module.weight.data.copy_(tensors[f"{prefix}.{name}.weight"])
        return module

    with torch.no_grad():
        hidden = main.model(tokens).last_hidden_state
        assert (main.lm_head(hidden) - main_logits).abs().max() <= 1e-4
        following = torch.cat((tokens[:, 1:], torch.zeros_like(tokens[:, :1])), dim=1)  # megatron-core rolls in 0
        embedded = main.model.embed_tokens(following)
        x = torch.cat((norm("enorm")(embedded), norm("hnorm")(hidden)), dim=-1) @ tensors[f"{prefix}.eh_proj.weight"].T
        positions = torch.arange(tokens.shape[1])[None]
        mask = torch.full((tokens.shape[1],) * 2, float("-inf")).triu(1)[None, None]
        out = longer.model.layers[layers](
            x, attention_mask=mask, position_ids=positions, position_embeddings=main.model.rotary_emb(x, positions)
        )
        reference = norm("shared_head.norm")(out) @ tensors[f"{prefix}.shared_head.head.weight"].T
    assert (mtp_logits - reference).abs().max() <= 1e-4
    assert (mtp_logits - main_logits).abs().max() > 1e-2  # a different prediction: the check sees the MTP layer


def test_bridge_inspect_reports_the_mla_checkpoint(tiny_moe_models, tmp_path):
    from hf_mcore_bridge.convert.inspect import inspect_path

    hf_dir = tiny_moe_models["deepseek_v3"]
    convert_hf_to_mcore(hf_dir, tmp_path / "m", layout=Layout(tp=2, ep=2), show_progress=False)
    report = inspect_path(tmp_path / "m")
    hf = load_file(hf_dir / "model.safetensors")
    padding = (-211 % 256) * 64 * 2  # embedding and output layer padded to 256 rows for TP2
    assert report.architecture == "DeepseekV3ForCausalLM" and report.layout["ep"] == 2
    assert report.parameters == sum(t.numel() for t in hf.values()) + padding  # the expert bias included
    rows = {row.name: row.shape for row in report.tensors}
    assert rows["decoder.layers.2.self_attention.linear_kv_down_proj.weight"] == [32, 64]  # kv_lora + rope rows
    assert inspect_path(hf_dir).parameters == sum(t.numel() for t in hf.values())


def test_megatron_args_rebuild_the_model_with_its_rotary_row_order(tiny_moe_models):
    """The refit and an export without HF assets take the model from the checkpoint's args: a rotate-half model
    (Moonlight-like) must come back rotate-half, or its rotary rows would be streamed interleaved."""
    for name in ("deepseek_v3", "moonlight"):
        config = json.loads((tiny_moe_models[name] / "config.json").read_text())
        model = config_bridge.megatron_spec(config)
        assert config_bridge.from_megatron_args(config_bridge.megatron_args(model, Layout(), torch.float32)) == model
    assert not model.mla.rope_interleave and model.mla.q_lora_rank is None
