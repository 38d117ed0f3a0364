"""GPT-OSS conversion: the fused, interleaved experts against transformers' own reading of them, MXFP4 checkpoints
(dequantized against a reference written here from the format's definition and against transformers'), the
`--mxfp4` export, the published config through megatron-core's `TransformerConfig`, and what megatron-core must
refuse, by name. Logit parity through megatron-core: `tests/megatron/test_gpt_oss_parity.py`."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hf_weights import assert_same_weights
from safetensors.torch import load_file, save_file

from hf_mcore_bridge.checkpoint import expert_parts, mxfp4
from hf_mcore_bridge.checkpoint.hf_dir import HFCheckpoint
from hf_mcore_bridge.convert import config_bridge
from hf_mcore_bridge.convert.layout import Layout, validate_layout
from hf_mcore_bridge.convert.to_hf import convert_mcore_to_hf
from hf_mcore_bridge.convert.to_mcore import convert_hf_to_mcore
from hf_mcore_bridge.errors import LayoutError
from hf_mcore_bridge.mappings.gpt_oss import FUSED_EXPERTS
from hf_mcore_bridge.models.config_errors import ConfigError
from hf_mcore_bridge.models.tiny_models import build_tiny_model

ARCH = "GptOssForCausalLM"
GPT_OSS_20B = {
    "architectures": [ARCH],
    "model_type": "gpt_oss",
    "attention_bias": True,
    "attention_dropout": 0.0,
    "eos_token_id": 200002,
    "experts_per_token": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "initial_context_length": 4096,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072,
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "pad_token_id": 199999,
    "quantization_config": {
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
        "quant_method": "mxfp4",
    },
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 201088,
}
"""openai/gpt-oss-20b's config.json as published."""


def test_every_part_is_cut_and_put_back_exactly() -> None:
    """`expert_parts.take` against the layouts written out here; `join` its inverse; incomplete parts refused."""
    slice_ = torch.randn(6, 8)  # GPT-OSS's gate_up_proj[e]: [H, 2F], gate and up interleaved
    assert torch.equal(expert_parts.take(slice_, "even_t"), slice_[:, ::2].T)
    assert torch.equal(expert_parts.take(slice_, "odd_t"), slice_[:, 1::2].T)
    assert torch.equal(expert_parts.take(slice_, "t"), slice_.T)
    assert torch.equal(expert_parts.take(slice_, "gate"), slice_[:3])
    for pair in (("even_t", "odd_t"), ("gate", "up")):
        assert torch.equal(expert_parts.join({p: expert_parts.take(slice_, p) for p in pair}), slice_)
        assert expert_parts.fused_shape(pair[0], expert_parts.part_shape(pair[0], (6, 8))) == (6, 8)
    bias = torch.randn(8)
    assert torch.equal(expert_parts.join({p: expert_parts.take(bias, p) for p in ("even_t", "odd_t")}), bias)
    with pytest.raises(ValueError, match="do not make"):
        expert_parts.join({"even_t": slice_[:, ::2].T})


def test_experts_are_read_as_transformers_computes_them(tmp_path: Path) -> None:
    """Each expert's gate/up/down as linear-layer weights: transformers' `GptOssExperts` computes `gate_up =
    x @ gate_up_proj[e] + bias`, gate = gate_up[..., ::2], up = gate_up[..., 1::2], `down = h @ down_proj[e]`."""
    hf_dir = build_tiny_model(tmp_path / "hf", ARCH)
    fused = load_file(hf_dir / "model.safetensors")
    hf = HFCheckpoint(hf_dir)
    layer, expert = 2, 5
    wanted = [(template, layer, expert) for template in FUSED_EXPERTS]
    hf.add_fused_aliases(dict(FUSED_EXPERTS), wanted)
    prefix = f"model.layers.{layer}.mlp.experts"
    x = torch.randn(3, 64)
    gate_up = x @ fused[f"{prefix}.gate_up_proj"][expert] + fused[f"{prefix}.gate_up_proj_bias"][expert]
    mine = f"{prefix}.{expert}"
    gate = x @ hf.read(f"{mine}.gate_proj.weight").T + hf.read(f"{mine}.gate_proj.bias")
    up = x @ hf.read(f"{mine}.up_proj.weight").T + hf.read(f"{mine}.up_proj.bias")
    torch.testing.assert_close(gate, gate_up[..., ::2], rtol=0, atol=1e-6)
    torch.testing.assert_close(up, gate_up[..., 1::2], rtol=0, atol=1e-6)
    h = torch.randn(3, 32)
    down = h @ fused[f"{prefix}.down_proj"][expert]
    torch.testing.assert_close(h @ hf.read(f"{mine}.down_proj.weight").T, down, rtol=0, atol=1e-6)


def _reference_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 from its definition, element by element: 32 values per block, two per byte (low nibble first), e2m1
    (sign, 2 exponent bits biased by 1, 1 mantissa bit; exponent 0 subnormal) times 2 ** (e8m0 scale - 127)."""
    out = torch.empty(*scales.shape, 32, dtype=torch.float64)
    for index in torch.cartesian_prod(*(torch.arange(n) for n in scales.shape)):
        where = tuple(index.tolist())
        for i in range(32):
            code = (int(blocks[where][i // 2]) >> (4 * (i % 2))) & 0xF
            sign, exponent, mantissa = -1.0 if code & 8 else 1.0, (code >> 1) & 3, code & 1
            magnitude = mantissa * 0.5 if exponent == 0 else (1 + mantissa / 2) * 2.0 ** (exponent - 1)
            out[where][i] = sign * magnitude * 2.0 ** (int(scales[where]) - 127)
    return out.flatten(-2)


def test_mxfp4_dequantizes_as_its_definition_and_transformers_say() -> None:
    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (2, 3, 2, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(110, 135, (2, 3, 2), dtype=torch.uint8, generator=generator)
    values = mxfp4.dequantize(blocks, scales)
    assert torch.equal(values.double(), _reference_dequantize(blocks, scales))
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    assert torch.equal(convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16), values.transpose(1, 2))
    assert [torch.equal(q, b) for q, b in zip(mxfp4.quantize(values, scales), (blocks, scales), strict=True)] == [1, 1]
    with pytest.raises(ValueError, match="not exact"):
        mxfp4.quantize(values + 1e-3 * values.abs().amax(), scales)


def _mxfp4_checkpoint(hf_dir: Path, out: Path) -> Path:
    """The tiny model as GPT-OSS publishes its weights: bf16, expert weights as MXFP4 ([out, in] blocks)."""
    tensors = {name: t.to(torch.bfloat16) for name, t in load_file(hf_dir / "model.safetensors").items()}
    for name in [n for n in tensors if n.endswith(("gate_up_proj", "down_proj"))]:
        blocks, scales = mxfp4.quantize(tensors.pop(name).transpose(1, 2))
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
    out.mkdir()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((hf_dir / "config.json").read_text())
    config |= {"torch_dtype": "bfloat16", "quantization_config": GPT_OSS_20B["quantization_config"]}
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_mxfp4_checkpoint_imports_exactly_and_exports_bit_identical(tmp_path: Path) -> None:
    source = _mxfp4_checkpoint(build_tiny_model(tmp_path / "hf", ARCH), tmp_path / "mxfp4")
    packed = load_file(source / "model.safetensors")
    convert_hf_to_mcore(source, tmp_path / "m", layout=Layout(tp=2, ep=2, etp=1), show_progress=False)
    convert_mcore_to_hf(tmp_path / "m", tmp_path / "bf16", show_progress=False)
    plain = load_file(tmp_path / "bf16" / "model.safetensors")
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.3.mlp.experts.down_proj"):
        blocks, scales = packed[f"{name}_blocks"], packed[f"{name}_scales"]
        expected = _reference_dequantize(blocks, scales).transpose(1, 2)
        assert plain[name].dtype == torch.bfloat16 and torch.equal(plain[name].double(), expected)
        assert torch.equal(plain[name], convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16))
    assert "quantization_config" not in json.loads((tmp_path / "bf16" / "config.json").read_text())
    convert_mcore_to_hf(tmp_path / "m", tmp_path / "again", mxfp4=True, show_progress=False)
    assert_same_weights(source, tmp_path / "again")
    config = json.loads((tmp_path / "again" / "config.json").read_text())
    assert config["quantization_config"] == GPT_OSS_20B["quantization_config"]


def test_published_config_builds_megatron_core_config() -> None:
    from megatron.core.fusions.fused_bias_geglu import quick_gelu
    from megatron.core.transformer import TransformerConfig

    model = config_bridge.megatron_spec(GPT_OSS_20B)
    layout = Layout(tp=2, ep=4, etp=1)
    validate_layout(layout, model)
    kwargs = config_bridge.transformer_config_kwargs(model, layout, torch.bfloat16)
    config = TransformerConfig(**kwargs)
    assert (config.softmax_type, config.window_size, config.window_attn_skip_freq[:4]) == (
        "learnable",
        (127, 0),
        [1, 0, 1, 0],
    )
    assert config.activation_func is quick_gelu and config.activation_func_clamp_value == 7.0
    assert config.glu_linear_offset == 1.0 and config.add_bias_linear and config.num_moe_experts == 32
    assert config.softmax_scale is None  # megatron-core's YaRN concentration is transformers' here
    yarn = config_bridge.yarn_config_attributes(model)
    assert yarn["yarn_correction_range_round_to_int"] is False and yarn["yarn_rotary_scaling_factor"] == 32.0
    args = config_bridge.megatron_args(model, layout, torch.bfloat16)
    assert config_bridge.from_megatron_args(args) == model
    back = model.to_hf()
    for field in ("swiglu_limit", "sliding_window", "layer_types", "num_local_experts", "attention_bias"):
        assert back[field] == GPT_OSS_20B[field], field


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"swiglu_alpha": 1.5}, "swiglu_alpha"),
        ({"attention_bias": False}, "gate_up_proj_bias"),
        ({"layer_types": None}, "layer_types"),
        ({"sliding_window": None}, "sliding_window"),
        ({"layer_types": ["chunked_attention", "full_attention"] * 12}, "layer_types"),
    ],
)
def test_what_megatron_core_computes_otherwise_is_refused_by_name(change: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        config_bridge.megatron_spec({**GPT_OSS_20B, **change})


def test_layouts_megatron_core_cannot_build_are_refused_by_name() -> None:
    model = config_bridge.megatron_spec(GPT_OSS_20B)
    with pytest.raises(LayoutError, match="etp=2"):
        validate_layout(Layout(tp=2), model)
    with pytest.raises(LayoutError, match="context parallelism"):
        validate_layout(Layout(cp=2), model)
    validate_layout(Layout(tp=2, etp=1), model)
    dense_window = replace(model, attention_sinks=False, sliding_window=None, layer_types=("full_attention",) * 24)
    validate_layout(Layout(cp=2), dense_window)


def test_fused_experts_stream_one_expert_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Import reads one expert's slice of a fused tensor at a time, export makes one at a time: memory stays at
    one expert's tensors whatever the number of experts."""
    hf_dir = build_tiny_model(tmp_path / "hf", ARCH)
    read, joined = [], []
    slice_of, join = HFCheckpoint._expert_slice, expert_parts.join

    def one_slice(self: HFCheckpoint, fused: str, expert: int | None) -> torch.Tensor:
        out = slice_of(self, fused, expert)
        read.append((expert, out.shape))
        return out

    def one_join(tensors: dict) -> torch.Tensor:
        out = join(tensors)
        joined.append(out.shape)
        return out

    monkeypatch.setattr(HFCheckpoint, "_expert_slice", one_slice)
    monkeypatch.setattr(expert_parts, "join", one_join)
    convert_hf_to_mcore(hf_dir, tmp_path / "m", layout=Layout(ep=2), show_progress=False)
    convert_mcore_to_hf(tmp_path / "m", tmp_path / "back", show_progress=False)
    assert_same_weights(hf_dir, tmp_path / "back")
    assert read and all(expert is not None for expert, _ in read)
    assert {tuple(shape) for _, shape in read} == {(64, 64), (64,), (32, 64)}  # gate_up, biases, down: one expert
    assert len(joined) == 4 * 4 * 8 and {tuple(shape) for shape in joined} == {(64, 64), (64,), (32, 64)}
