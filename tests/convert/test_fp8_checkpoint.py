"""Blockwise FP8 checkpoints as DeepSeek publishes them: dequantized to bfloat16 on import, written back as bfloat16
or as FP8 blocks (`--fp8-blockwise`).

The FP8 source is built here from a tiny bfloat16 DeepSeek-V3 (hidden 160, MLP widths 272 and 136: blocks of 128
with ragged edges), quantized by code written in the test, with the router and its correction bias in float32 as
HF keeps them; the expected values are the test's own dequantization `q * scale_inv`, block by block. Its scales
are random (powers of two, or any float32), or made as DeepSeek makes them from float32 weights: amax / 448 per
block (DeepSeek-V3's float32 `weight_scale_inv`), rounded up to a power of two for DeepSeek-V3.1's `ue8m0`. FP8
exports are compared, byte for byte, with the source file's tensors read with safetensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cli_errors import assert_one_line_error, run
from fp8_sources import QUANTIZATION, SHAPE, V31_QUANTIZATION, block_amax, expand, fp8_source
from safetensors.torch import load_file, save_file

from hf_mcore_bridge.checkpoint.fp8_blocks import dequantize_blockwise, dequantize_rows, quantize_blockwise
from hf_mcore_bridge.convert.inspect import inspect_path
from hf_mcore_bridge.convert.layout import Layout
from hf_mcore_bridge.convert.to_hf import convert_mcore_to_hf
from hf_mcore_bridge.convert.to_mcore import convert_hf_to_mcore
from hf_mcore_bridge.errors import CheckpointError
from hf_mcore_bridge.models.config_errors import ConfigError
from hf_mcore_bridge.models.tiny_models import build_tiny_model


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes (torch.equal on them is bit identity: -0 is not 0, FP8 compares at all)."""
    return tensor.contiguous().view(torch.uint8)


def assert_same_tensors(exported: Path, source: Path) -> None:
    """Every tensor of `exported` bit for bit the source file's, both read with safetensors."""
    want, got = load_file(source / "model.safetensors"), load_file(exported / "model.safetensors")
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].dtype == value.dtype and got[name].shape == value.shape, name
        assert torch.equal(_bits(got[name]), _bits(value)), name


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fp8")
    return build_tiny_model(root / "bf16", "DeepseekV3ForCausalLM", seed=4, dtype=torch.bfloat16, **SHAPE)


@pytest.mark.parametrize("pow2", [True, False], ids=["ue8m0 scales", "float32 scales"])
def test_fp8_checkpoint_round_trip(pow2, bf16_model, tmp_path):
    source = tmp_path / "fp8"
    expected = fp8_source(source, bf16_model, kind="random ue8m0" if pow2 else "random float32")
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
        dequantized = (blocks[name].float() * expand(scale, value.shape)).to(torch.bfloat16)
        assert torch.equal(dequantized, value), name  # the source's blocks and scales (kept in the HF assets)
    assert_same_tensors(tmp_path / "fp8-out", source)
    scales = sum(n.endswith("_scale_inv") for n in load_file(source / "model.safetensors"))
    assert sum(n.endswith("_scale_inv") for n in blocks) == scales
    (note,) = inspect_path(tmp_path / "fp8-out").notes  # `bridge inspect` says what the blocks are
    assert note.startswith(f"{scales} weights in 128 x 128 FP8 blocks")
    # the FP8 export converts again, to the same bfloat16 checkpoint
    convert_hf_to_mcore(tmp_path / "fp8-out", tmp_path / "mcore2", show_progress=False)
    convert_mcore_to_hf(tmp_path / "mcore2", tmp_path / "bf16-2", show_progress=False)
    again = load_file(tmp_path / "bf16-2" / "model.safetensors")
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
    fp8_source(source, bf16_model, kind="random ue8m0")
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
    from hf_mcore_bridge.models.mapping_types import Direct, Size
    from hf_mcore_bridge.models.parallel_style import Parallel

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


def _convert(*args) -> None:
    result = run("convert", *args, "--no-progress")
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("kind", ["v3", "v3.1"], ids=["DeepSeek-V3 float32 scales", "DeepSeek-V3.1 ue8m0 scales"])
def test_deepseek_fp8_checkpoints_round_trip_bit_identical_through_the_cli(kind, bf16_model, tmp_path):
    """`bridge convert` to mcore at TP2 EP2 and back with `--fp8-blockwise`: the source's FP8 codes (-0 included),
    scales and `quantization_config`, bit for bit, whatever rounding the bfloat16 checkpoint did."""
    source = tmp_path / "fp8"
    fp8_source(source, bf16_model, kind=kind)
    tensors = load_file(source / "model.safetensors")
    scales = [t for n, t in tensors.items() if n.endswith("_scale_inv")]
    powers = all(torch.equal(s, torch.exp2(torch.log2(s).round())) for s in scales)
    assert powers == (kind == "v3.1")  # V3's are no powers of two: the format matters
    assert any((_bits(t) == 0x80).any() for t in tensors.values() if t.dtype == torch.float8_e4m3fn)  # -0 codes
    _convert("--to", "mcore", "--tp", "2", "--ep", "2", source, tmp_path / "mcore")
    _convert("--to", "hf", "--fp8-blockwise", tmp_path / "mcore", tmp_path / "back")
    assert_same_tensors(tmp_path / "back", source)
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["quantization_config"] == json.loads((source / "config.json").read_text())["quantization_config"]


def test_bfloat16_values_do_not_determine_float32_scales():
    """Why the source's scales are kept: DeepSeek-V3's amax / 448, recomputed from the bfloat16 block, is another
    float32 in practically every block (the bfloat16 amax keeps 8 of the scale's 24 significant bits)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(128 * 16, 128 * 16, generator=generator) * 0.02
    scale = block_amax(weight) / 448
    full = expand(scale, weight.shape)
    q = (weight / full).clamp(-448, 448).to(torch.float8_e4m3fn)
    bf16 = (q.float() * full).to(torch.bfloat16)
    recomputed = block_amax(bf16.float()) / 448
    assert (recomputed == scale).float().mean() < 0.05
    assert torch.allclose(recomputed, scale, rtol=2**-8, atol=0)


def test_float32_values_determine_only_amax_made_scales():
    """Nor would float32 values do in general: over every float32 of one binade, a scale made as amax / 448 comes
    back from `448 * scale` (the block's largest value where its largest |q| is 448), an arbitrary scale does not
    about one time in nine."""
    every = (torch.arange(2**23, dtype=torch.int32) | (127 << 23)).view(torch.float32)  # [1, 2)
    made = every / 448
    assert torch.equal((made * 448) / 448, made)
    failing = ((every * 448) / 448 != every).float().mean().item()
    assert 0.09 < failing < 0.12, failing


def test_export_without_the_kept_scales_computes_them(bf16_model, tmp_path):
    """The kept scales are what makes the float32 export exact: without them (a checkpoint converted by an older
    version) the scales are amax / 448 of the bfloat16 blocks, within 2^-8 of the source's but not equal."""
    source = tmp_path / "fp8"
    fp8_source(source, bf16_model, kind="v3")
    convert_hf_to_mcore(source, tmp_path / "mcore", layout=Layout(tp=2, ep=2), show_progress=False)
    (tmp_path / "mcore" / "hf_assets" / "fp8_scales.safetensors").unlink()
    convert_mcore_to_hf(tmp_path / "mcore", tmp_path / "back", show_progress=False, fp8_blockwise=True)
    want, got = load_file(source / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    scales = [n for n in want if n.endswith("_scale_inv")]
    assert not all(torch.equal(want[n], got[n]) for n in scales)
    assert all(torch.allclose(want[n], got[n], rtol=2**-8, atol=0) for n in scales)
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["quantization_config"] == QUANTIZATION  # still DeepSeek-V3's format: float32 scales


@pytest.mark.parametrize(
    ("kind", "fmt"), [("v3", "ue8m0"), ("v3.1", "float32")], ids=["V3 as ue8m0", "V3.1 as float32"]
)
def test_another_scale_format_when_asked(kind, fmt, bf16_model, tmp_path):
    """`--fp8-scale-format ue8m0` of float32 scales writes powers of two (the source's values within e4m3's
    rounding); `float32` of power-of-two scales keeps them (powers of two are float32 scales), with DeepSeek-V3's
    config (no `scale_fmt`)."""
    source = tmp_path / "fp8"
    expected = fp8_source(source, bf16_model, kind=kind)
    _convert("--to", "mcore", "--tp", "2", "--ep", "2", source, tmp_path / "mcore")
    _convert("--to", "hf", "--fp8-blockwise", "--fp8-scale-format", fmt, tmp_path / "mcore", tmp_path / "back")
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    got = load_file(tmp_path / "back" / "model.safetensors")
    if fmt == "float32":
        assert config["quantization_config"] == QUANTIZATION
        assert_same_tensors(tmp_path / "back", source)
        return
    assert config["quantization_config"] == V31_QUANTIZATION
    for name in expected:
        scale = got.get(f"{name}_scale_inv")
        if scale is None:
            continue
        assert torch.equal(scale, torch.exp2(torch.log2(scale).round())), name
        dequantized = got[name].float() * expand(scale, got[name].shape)
        assert torch.allclose(dequantized, expected[name].float(), rtol=2**-3, atol=1e-6), name


def test_a_block_changed_since_import_gets_a_scale_of_its_own():
    """`quantize_blockwise(keep=)` keeps a scale only where the block is exactly `q * scale` and the scale is of
    the format: a changed block, a non-finite scale, and (for powers of two) a float32 scale are recomputed."""
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(300, 260, generator=generator) * 0.02
    scale = block_amax(weight) / 448
    full = expand(scale, weight.shape)
    q = (weight / full).clamp(-448, 448).to(torch.float8_e4m3fn)
    values = (q.float() * full).to(torch.bfloat16)
    changed = values.clone()
    changed[130, 5] *= 1.5  # block (1, 0) trained since
    keep = scale.clone()
    keep[2, 2] = float("nan")
    q2, scale2 = quantize_blockwise(changed, keep=keep)
    kept = torch.ones_like(scale, dtype=torch.bool)
    kept[1, 0] = kept[2, 2] = False
    assert torch.equal(scale2[kept], scale[kept])
    own = block_amax(changed.float()) / 448
    assert torch.equal(scale2[~kept], own[~kept])
    rows, cols = torch.meshgrid(torch.arange(300) // 128, torch.arange(260) // 128, indexing="ij")
    mask = kept[rows, cols]
    assert torch.equal(_bits(q2)[mask], _bits(q)[mask])
    _, pow2_scale = quantize_blockwise(values, pow2=True, keep=scale)
    assert torch.equal(pow2_scale, torch.exp2(torch.ceil(torch.log2(block_amax(values.float()) / 448))))


def _damaged(source: Path, change) -> tuple[str, str]:
    """Change one FP8 weight (and its scale) of `source` in place: `change(q_bytes, scale)`; returns the weight's
    and the scale's names."""
    tensors = load_file(source / "model.safetensors")
    name = next(n for n, t in sorted(tensors.items()) if t.dtype == torch.float8_e4m3fn)
    q_bytes, scale = _bits(tensors[name]).clone(), tensors[f"{name}_scale_inv"].clone()
    change(q_bytes, scale)
    tensors[name], tensors[f"{name}_scale_inv"] = q_bytes.view(torch.float8_e4m3fn), scale
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    return name, f"{name}_scale_inv"


def _set_scale(value: float):
    def change(q_bytes: torch.Tensor, scale: torch.Tensor) -> None:
        scale[0, 1] = value

    return change


def _nan_code(q_bytes: torch.Tensor, scale: torch.Tensor) -> None:
    q_bytes[150, 7] = 0x7F  # e4m3fn's NaN


def _overflow(q_bytes: torch.Tensor, scale: torch.Tensor) -> None:
    q_bytes[:128, 128:] = 0  # the block's only code:
    q_bytes[3, 140] = 0x7E  # 448
    scale[0, 1] = 1e37  # finite, but 448 times it is not


@pytest.mark.parametrize(
    ("change", "named", "fragments"),
    [
        (_set_scale(float("nan")), "scale", ["holds nan for block [0, 1]"]),
        (_set_scale(float("inf")), "scale", ["holds inf for block [0, 1]"]),
        (_nan_code, "weight", ["dequantizes to nan at [150, 7]", "e4m3 code 0x7f"]),
        (_overflow, "weight", ["dequantizes to inf at [3, 140]", "e4m3 code 0x7e"]),
    ],
    ids=["nan scale", "inf scale", "nan code", "beyond bfloat16"],
)
def test_non_finite_scales_and_weights_are_refused_by_name(change, named, fragments, bf16_model, tmp_path):
    source = tmp_path / "fp8"
    fp8_source(source, bf16_model, kind="v3")
    weight, scale = _damaged(source, change)
    result = run("convert", "--to", "mcore", "--tp", "2", "--ep", "2", source, tmp_path / "out", "--no-progress")
    assert_one_line_error(result, weight if named == "weight" else scale, "in model.safetensors", *fragments)
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["fp8"]  # no staging directory left either


def test_fp8_weights_without_a_quantization_config_name_the_missing_config(bf16_model, tmp_path):
    source = tmp_path / "fp8"
    fp8_source(source, bf16_model, kind="v3")
    config = json.loads((source / "config.json").read_text())
    del config["quantization_config"]
    (source / "config.json").write_text(json.dumps(config))
    result = run("convert", "--to", "mcore", source, tmp_path / "out", "--no-progress")
    assert_one_line_error(result, "is float8_e4m3fn", "config.json has no quantization_config", "model.safetensors")
    assert "--ignore-unknown" not in result.output
    assert not (tmp_path / "out").exists()
    result = run("convert", "--to", "mcore", source, tmp_path / "out", "--no-progress", "--ignore-unknown")
    assert_one_line_error(result, "config.json has no quantization_config")
    assert not (tmp_path / "out").exists()


def test_kept_scales_that_do_not_fit_the_model_are_refused_before_anything_is_written(bf16_model, tmp_path):
    source = tmp_path / "fp8"
    fp8_source(source, bf16_model, kind="v3")
    convert_hf_to_mcore(source, tmp_path / "mcore", show_progress=False)
    kept_file = tmp_path / "mcore" / "hf_assets" / "fp8_scales.safetensors"
    kept = load_file(kept_file)
    assert sorted(kept) == sorted(n for n in load_file(source / "model.safetensors") if n.endswith("_scale_inv"))
    name = sorted(kept)[0]
    kept[name] = kept[name][:1]
    save_file(kept, kept_file)
    result = run("convert", "--to", "hf", "--fp8-blockwise", tmp_path / "mcore", tmp_path / "out", "--no-progress")
    assert_one_line_error(result, name, "fp8_scales.safetensors has shape (1, ")
    assert not (tmp_path / "out").exists()


def test_unknown_scale_formats_and_misfitting_kept_scales_are_refused():
    from hf_mcore_bridge.convert.fp8_checkpoint import Fp8Export, export_scale_format

    with pytest.raises(ValueError, match="unknown FP8 scale format 'e8m0'"):
        export_scale_format("e8m0", {})
    with pytest.raises(ValueError, match="unknown FP8 scale format 'source'"):
        Fp8Export([], "source")
    with pytest.raises(ValueError, match=r"keep \(1, 2\) does not fit a 300 x 200 weight"):
        quantize_blockwise(torch.randn(300, 200), keep=torch.ones(1, 2))
