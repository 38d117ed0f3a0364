"""`bridge inspect`: architecture, layout, dtypes, parameter count and tensors of HF and Megatron checkpoints."""

from __future__ import annotations

import json

from safetensors.torch import load_file
from typer.testing import CliRunner

from hf_mcore_bridge.cli.main import app
from hf_mcore_bridge.layout import Layout
from hf_mcore_bridge.to_mcore import convert_hf_to_mcore

runner = CliRunner()


def test_inspect_hf_directory_as_json(tiny_models):
    result = runner.invoke(app, ["inspect", str(tiny_models["qwen2"]), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    tensors = load_file(tiny_models["qwen2"] / "model.safetensors")
    assert report["architecture"] == "Qwen2ForCausalLM" and report["dtypes"] == ["float32"]
    assert report["parameters"] == sum(t.numel() for t in tensors.values())
    assert {row["name"] for row in report["tensors"]} == set(tensors)
    bias = next(row for row in report["tensors"] if row["name"] == "model.layers.0.self_attn.k_proj.bias")
    assert bias["shape"] == [32] and bias["bytes"] == 32 * 4


def test_inspect_megatron_checkpoint(tiny_models, tmp_path):
    convert_hf_to_mcore(tiny_models["llama"], tmp_path / "m", layout=Layout(tp=2, pp=2), show_progress=False)
    report = json.loads(runner.invoke(app, ["inspect", str(tmp_path / "m"), "--json"]).output)
    assert report["architecture"] == "LlamaForCausalLM"
    assert report["layout"]["tp"] == 2 and report["layout"]["pp"] == 2
    assert any("211 padded to 256" in note for note in report["notes"])
    qkv = next(row for row in report["tensors"] if row["name"] == "decoder.layers.self_attention.linear_qkv.weight")
    assert qkv["shape"] == [8, 128, 64]  # layers stacked; q (64) + k (32) + v (32) rows per layer
    table = runner.invoke(app, ["inspect", str(tmp_path / "m")])
    assert table.exit_code == 0 and "linear_qkv" in table.output and "tp=2 pp=2" in table.output


def test_inspect_not_a_checkpoint(tmp_path):
    result = runner.invoke(app, ["inspect", str(tmp_path)])
    assert result.exit_code == 2 and result.output.startswith("error: ")
