"""Blockwise FP8 checkpoints as DeepSeek publishes them: dequantized to bfloat16 on import, written back as bfloat16
or as FP8 blocks (`--fp8-blockwise`).

The FP8 source is built here from a tiny bfloat16 DeepSeek-V3 (hidden 160, MLP widths 272 and 136: blocks of 128
with ragged edges), quantized by code written in the test, with the router and its correction bias in float32 as
HF keeps them; the expected values are the test's own dequantization `q * scale_inv`, block by block.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_bad_input import assert_one_line_error, run

from hf_mcore_bridge.convert.config_errors import ConfigError
from hf_mcore_bridge.convert.fp8_blocks import dequantize_blockwise, dequantize_rows, quantize_blockwise
from hf_mcore_bridge.convert.inspect import inspect_path
from hf_mcore_bridge.convert.layout import Layout
from hf_mcore_bridge.convert.to_hf import convert_mcore_to_hf
from hf_mcore_bridge.convert.to_mcore import convert_hf_to_mcore
from hf_mcore_bridge.errors import CheckpointError
from hf_mcore_bridge.tiny_models import build_tiny_model

LINEAR = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections DeepSeek-V3's checkpoints hold in FP8 (the router `mlp.gate` and embeddings stay bfloat16)."""
FLOAT32 = ("mlp.gate.weight", "e_score_correction_bias")
SHAPE = {"hidden_size": 160, "intermediate_size": 272, "moe_intermediate_size": 136, "num_hidden_layers": 2}
QUANTIZATION = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


def _expand(scale: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Each block's scale on each of its elements (written out block by block)."""
    full = torch.empty(shape)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            full[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = scale[i, j]
    return full


def _fp8_source(directory: Path, bf16: Path, *, pow2: bool) -> dict[str, torch.Tensor]:
    """`bf16`'s weights as an FP8 checkpoint in `directory`; returns the expected bfloat16 value of every tensor."""
    shutil.copytree(bf16, directory)
    tensors, expected = load_file(directory / "model.safetensors"), {}
    generator = torch.Generator().manual_seed(5)
    for name in list(tensors):
        weight = tensors[name].float()
        if any(name.endswith(f"{part}.weight") for part in FLOAT32) or name.endswith("e_score_correction_bias"):
            tensors[name] = expected[name] = weight  # float32, as HF keeps them
        elif any(f".{part}.weight" in name for part in LINEAR):
            blocks = (-(-weight.shape[0] // 128), -(-weight.shape[1] // 128))
            if pow2:  # ue8m0 scales: powers of two around amax / 448
                scale = torch.exp2(torch.randint(-9, -6, blocks, generator=generator).float())
            else:  # DeepSeek-V3's float32 scales
                scale = torch.rand(blocks, generator=generator) * 1e-3 + 5e-4
            full = _expand(scale, weight.shape)
            q = (weight / full).clamp(-448, 448).to(torch.float8_e4m3fn)
            tensors[name], tensors[f"{name}_scale_inv"] = q, scale
            expected[name] = (q.float() * full).to(torch.bfloat16)
        else:
            expected[name] = tensors[name]
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = QUANTIZATION
    (directory / "config.json").write_text(json.dumps(config))
    return expected


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fp8")
    return build_tiny_model(root / "bf16", "DeepseekV3ForCausalLM", seed=4, dtype=torch.bfloat16, **SHAPE)


@pytest.mark.parametrize("pow2", [True, False], ids=["ue8m0 scales", "float32 scales"])
def test_fp8_checkpoint_round_trip(pow2, bf16_model, tmp_path):
    source = tmp_path / "fp8"
    expected = _fp8_source(source, bf16_model, pow2=pow2)
    result = convert_hf_to_mcore(source, tmp_path / "mcore", layout=Layout(tp=2, ep=2), show_progress=False)
    assert any("FP8 weights" in note and "dequantized to bfloat16" in note for note in result.notes)
    convert_mcore_to_hf(tmp_path / "mcore", tmp_path / "bf16", show_progress=False)
    exported = load_file(tmp_path / "bf16" / "model.safetensors")
    assert sorted(exported) == sorted(expected)
    for name, value in expected.items():
        assert exported[name].dtype == value.dtype and torch.equal(exported[name], value), name
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert "quantization_config" not in config and config["torch_dtype"] == "bfloat16"

    convert_mcore_to_hf(tmp_path / "mcore", tmp_path / "fp8-out", show_progress=False, fp8_blockwise=True)
    blocks = load_file(tmp_path / "fp8-out" / "model.safetensors")
    config = json.loads((tmp_path / "fp8-out" / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    assert sorted(n for n in blocks if not n.endswith("_scale_inv")) == sorted(expected)
    for name, value in exported.items():
        scale = blocks.get(f"{name}_scale_inv")
        if scale is None:  # not FP8: as the bfloat16 export
            assert torch.equal(blocks[name], value), name
            continue
        assert blocks[name].dtype == torch.float8_e4m3fn and scale.dtype == torch.float32, name
        dequantized = (blocks[name].float() * _expand(scale, value.shape)).to(torch.bfloat16)
        if pow2:  # representable blocks come back exactly
            assert torch.equal(dequantized, value), name
        else:  # bfloat16(q * s) for float32 s is no e4m3 block any more: the nearest one
            assert torch.allclose(dequantized.float(), value.float(), rtol=0.07, atol=1e-6), name
    scales = sum(n.endswith("_scale_inv") for n in load_file(source / "model.safetensors"))
    assert sum(n.endswith("_scale_inv") for n in blocks) == scales
    (note,) = inspect_path(tmp_path / "fp8-out").notes  # `bridge inspect` says what the blocks are
    assert note.startswith(f"{scales} weights in 128 x 128 FP8 blocks")
    # the FP8 export converts again, to the same bfloat16 checkpoint
    convert_hf_to_mcore(tmp_path / "fp8-out", tmp_path / "mcore2", show_progress=False)
    convert_mcore_to_hf(tmp_path / "mcore2", tmp_path / "bf16-2", show_progress=False)
    again = load_file(tmp_path / "bf16-2" / "model.safetensors")
    if pow2:
        assert all(torch.equal(again[n], exported[n]) for n in exported)


def test_dequantized_row_ranges_equal_the_whole_weights_rows():
    q, scale = quantize_blockwise(torch.randn(300, 200))
    whole = dequantize_blockwise(q, scale, torch.bfloat16)
    for start, stop in ((0, 300), (5, 7), (127, 129), (130, 300), (256, 300)):
        rows = dequantize_rows(q[start:stop], scale[start // 128 : -(-stop // 128)], start, torch.bfloat16)
        assert torch.equal(rows, whole[start:stop]), (start, stop)
    broken = dequantize_rows(q[130:140], scale[0:1], 130, torch.bfloat16)  # the wrong block's scales
    assert not torch.equal(broken, whole[130:140])


def test_power_of_two_scales_make_dequantized_weights_exact_fixed_points():
    weight = torch.randn(200, 300) * 0.02
    q, scale = quantize_blockwise(weight, pow2=True)
    assert torch.equal(scale, torch.exp2(torch.log2(scale).round()))
    once = dequantize_blockwise(q, scale, torch.bfloat16)
    q2, scale2 = quantize_blockwise(once, pow2=True)
    assert torch.equal(dequantize_blockwise(q2, scale2, torch.bfloat16), once)


def test_other_quantizations_and_broken_blocks_are_refused(bf16_model, tmp_path):
    source = tmp_path / "fp8"
    _fp8_source(source, bf16_model, pow2=True)
    config = json.loads((source / "config.json").read_text())
    for field, value in (("weight_block_size", [64, 64]), ("activation_scheme", "static"), ("fmt", "e5m2")):
        changed = {**config, "quantization_config": {**QUANTIZATION, field: value}}
        (source / "config.json").write_text(json.dumps(changed))
        with pytest.raises(ConfigError, match=field):
            convert_hf_to_mcore(source, tmp_path / f"out-{field}", show_progress=False)
    (source / "config.json").write_text(json.dumps(config))
    tensors = load_file(source / "model.safetensors")
    scale = next(n for n in tensors if n.endswith("_scale_inv"))
    save_file({n: t for n, t in tensors.items() if n != scale}, source / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"no {scale}"):
        convert_hf_to_mcore(source, tmp_path / "out-scale", show_progress=False)
    result = run("convert", "--to", "mcore", source, tmp_path / "cli", "--no-progress")
    assert_one_line_error(result, "is FP8 but the checkpoint has no", scale)


def test_weights_taller_than_a_span_read_and_write_as_whole_blocks(tmp_path):
    """Reading dequantizes, and export quantizes, `SPAN_ROWS` rows at a time: the same values as whole-weight
    dequantization and quantization, for any row range."""
    from hf_mcore_bridge.convert.fp8_checkpoint import SPAN_ROWS, Fp8Checkpoint, Fp8Export
    from hf_mcore_bridge.convert.mapping_types import Direct, Size
    from hf_mcore_bridge.convert.parallel_style import Parallel

    rows = 2 * SPAN_ROWS + 300
    weight = torch.randn(rows, 200) * 0.02
    q, scale = quantize_blockwise(weight, pow2=True)
    save_file({"w.weight": q, "w.weight_scale_inv": scale}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": QUANTIZATION}))
    checkpoint = Fp8Checkpoint(tmp_path)
    whole = dequantize_blockwise(q, scale, torch.bfloat16)
    assert checkpoint.names() == {"w.weight"} and checkpoint.info("w.weight").dtype.torch == torch.bfloat16
    for span in (None, (0, rows), (SPAN_ROWS - 5, SPAN_ROWS + 7), (130, 2 * SPAN_ROWS + 1)):
        expected = whole if span is None else whole[span[0] : span[1]]
        assert torch.equal(checkpoint.read("w.weight", span), expected), span
    export = Fp8Export([Direct("w", "w.weight", Parallel.ROW, (Size.HIDDEN, Size.FFN))])
    (_, q2), (_, scale2) = export.tensors("w.weight", whole)
    expected_q, expected_scale = quantize_blockwise(whole, pow2=True)
    assert torch.equal(scale2, expected_scale) and torch.equal(q2.view(torch.uint8), expected_q.view(torch.uint8))
