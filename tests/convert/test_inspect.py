"""`bridge inspect`: architecture, layout, dtypes, parameter count and tensors of HF and Megatron checkpoints."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file
from typer.testing import CliRunner

from hf_mcore_bridge.cli.main import app
from hf_mcore_bridge.convert.layout import Layout
from hf_mcore_bridge.convert.to_mcore import convert_hf_to_mcore

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


def test_inspect_megatron_bridge_layout(tiny_models, tmp_path):
    """No `args` in its common state: the layout comes from `run_config.yaml`, the architecture from the HF
    assets, and the tensors are those of the same model in the Megatron-LM layout (read by the same DCP reader)."""
    for name, directory_layout in (("bridge", "megatron-bridge"), ("lm", "megatron-lm")):
        convert_hf_to_mcore(
            tiny_models["qwen3"],
            tmp_path / name,
            layout=Layout(tp=2),
            directory_layout=directory_layout,
            show_progress=False,
        )
    bridge = json.loads(runner.invoke(app, ["inspect", str(tmp_path / "bridge"), "--json"]).output)
    lm = json.loads(runner.invoke(app, ["inspect", str(tmp_path / "lm"), "--json"]).output)
    assert bridge["format"] == "megatron-core torch_dist, Megatron-Bridge layout (iteration 0)"
    assert bridge["architecture"] == "Qwen3ForCausalLM" and bridge["layout"]["tp"] == 2
    assert not any("records no args" in note for note in bridge["notes"])
    assert bridge["tensors"] == lm["tensors"] and bridge["parameters"] == lm["parameters"]


def test_inspect_dtensor_checkpoint(tiny_models, tmp_path):
    """A DTensor GRPO checkpoint (laid out as `grpo.backends.dtensor.checkpoint` writes it) is read through its HF copy,
    given as the checkpoint root or as the iteration directory."""
    from hf_mcore_bridge.grpo.backends.dtensor.checkpoint import HF_DIR

    root = tmp_path / "checkpoints"
    shutil.copytree(tiny_models["qwen2"], root / "iter_0000004" / HF_DIR)
    (root / "iter_0000004" / "trainer_state.json").write_text("{}")
    (root / "latest_checkpointed_iteration.txt").write_text("4")
    tensors = load_file(tiny_models["qwen2"] / "model.safetensors")
    for given in (root, root / "iter_0000004"):
        result = runner.invoke(app, ["inspect", str(given), "--json"])
        assert result.exit_code == 0, result.output
        report = json.loads(result.output)
        assert report["format"] == "DTensor GRPO checkpoint (step 4); the tensors of its HF copy, hf/"
        assert report["path"] == str(root / "iter_0000004") and report["architecture"] == "Qwen2ForCausalLM"
        assert {row["name"] for row in report["tensors"]} == set(tensors)


def test_convert_of_a_dtensor_checkpoint_names_bridge_export(tiny_models, tmp_path):
    from hf_mcore_bridge.grpo.backends.dtensor.checkpoint import HF_DIR

    root = tmp_path / "checkpoints"
    shutil.copytree(tiny_models["qwen2"], root / "iter_0000004" / HF_DIR)
    (root / "latest_checkpointed_iteration.txt").write_text("4")
    result = runner.invoke(app, ["convert", "--to", "hf", str(root), str(tmp_path / "out"), "--no-progress"])
    assert result.exit_code == 2 and not (tmp_path / "out").exists()
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "is a DTensor run's checkpoint: `bridge export RUN DEST`" in lines[0], result.output


def test_inspect_not_a_checkpoint(tmp_path):
    result = runner.invoke(app, ["inspect", str(tmp_path)])
    assert result.exit_code == 2 and result.output.startswith("error: ")


def _hf_reference(hf_dir, tp: int) -> tuple[int, str]:
    """Parameters a Megatron checkpoint of this HF model holds at `tp`, computed from the HF files: the HF tensors
    plus the vocabulary padding rows (multiple of 128 x TP) of the embedding and, if untied, the output layer."""
    config = json.loads((hf_dir / "config.json").read_text())
    tensors = load_file(hf_dir / "model.safetensors")
    multiple = 128 * tp
    padding = -config["vocab_size"] % multiple
    copies = 1 if config.get("tie_word_embeddings") else 2
    return sum(t.numel() for t in tensors.values()) + padding * config["hidden_size"] * copies, config["architectures"][
        0
    ]


@pytest.mark.parametrize(
    ("variant", "layout"),
    [
        ("llama", Layout(tp=2, pp=2, vpp=2)),
        ("llama_tied", Layout(pp=4)),
        ("qwen3", Layout(tp=2)),
        ("mixtral", Layout(tp=2, ep=2)),
        ("glm4_moe", Layout(tp=2, pp=2, ep=2)),
    ],
    ids=["llama-tp2-pp2-vpp2", "tied-pp4", "qwen3-tp2", "mixtral-tp2-ep2", "glm4_moe-tp2-pp2-ep2"],
)
def test_inspect_reads_the_legacy_torch_format(variant, layout, tiny_models, tiny_moe_models, tmp_path):
    hf_dir = {**tiny_models, **tiny_moe_models}[variant]
    # legacy MoE files are written for the local spec; they are reported under Transformer Engine's names
    legacy_spec = "local" if layout.ep > 1 else "te"
    for name, fmt, spec in (("legacy", "torch", legacy_spec), ("dist", "torch_dist", "te")):
        convert_hf_to_mcore(
            hf_dir, tmp_path / name, layout=layout, spec=spec, checkpoint_format=fmt, show_progress=False
        )
    result = runner.invoke(app, ["inspect", str(tmp_path / "legacy"), "--json"])
    assert result.exit_code == 0, result.output
    legacy = json.loads(result.output)
    dist = json.loads(runner.invoke(app, ["inspect", str(tmp_path / "dist"), "--json"]).output)
    parameters, architecture = _hf_reference(hf_dir, layout.tp)
    assert legacy["format"].startswith("megatron-core torch (legacy)")
    assert legacy["architecture"] == architecture and legacy["parameters"] == parameters
    assert legacy["layout"]["tp"] == layout.tp and legacy["layout"]["pp"] == layout.pp
    # the same global tensors as the distributed checkpoint's own metadata lists (a separate reader)
    assert {(r["name"], tuple(r["shape"]), r["dtype"]) for r in legacy["tensors"]} == {
        (r["name"], tuple(r["shape"]), r["dtype"]) for r in dist["tensors"]
    }


def test_inspect_reads_an_exported_hf_directory(tiny_models, tmp_path):
    from hf_mcore_bridge.convert.to_hf import convert_mcore_to_hf

    convert_hf_to_mcore(tiny_models["qwen2"], tmp_path / "m", layout=Layout(tp=2), show_progress=False)
    convert_mcore_to_hf(tmp_path / "m", tmp_path / "hf", show_progress=False, max_shard_size=20_000)
    result = runner.invoke(app, ["inspect", str(tmp_path / "hf"), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    source = load_file(tiny_models["qwen2"] / "model.safetensors")
    assert report["format"] == "huggingface safetensors" and report["architecture"] == "Qwen2ForCausalLM"
    assert {r["name"]: r["shape"] for r in report["tensors"]} == {n: list(t.shape) for n, t in source.items()}
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 1  # sharded output, read through its index
