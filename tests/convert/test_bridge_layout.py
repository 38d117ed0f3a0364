"""Megatron-Bridge's checkpoint layout: export reads it, `--layout megatron-bridge` writes it.

Layout facts (Megatron-Bridge v0.6.0 source: `training/checkpointing.py`, `training/utils/checkpoint_utils.py`,
`training/state.py`, `models/gpt_provider.py`): `<root>/iter_NNNNNNN/` holds the torch_dist files (common state
without `args`), `run_config.yaml` (its `model` section: `_target_` a provider class, fields of megatron-core's
`TransformerConfig` plus the GPT provider's own) and `train_state.pt`; `<root>/latest_train_state.pt` (a dict of
tensors, `step` among them) and `<root>/latest_checkpointed_iteration.txt` (the step) say which is newest.
The checkpoints read here are assembled in the test from those facts, and the written ones are checked by a reader
written here from them, then exported.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from hf_weights import assert_same_weights
from typer.testing import CliRunner

from hf_mcore_bridge.cli.main import app
from hf_mcore_bridge.convert.layout import Layout
from hf_mcore_bridge.convert.to_hf import convert_mcore_to_hf
from hf_mcore_bridge.convert.to_mcore import convert_hf_to_mcore
from hf_mcore_bridge.errors import CheckpointError

GPT_PROVIDER_FIELDS = {
    # GPTModelProvider's own dataclass fields (Megatron-Bridge v0.6.0 models/gpt_provider.py) that are not
    # TransformerConfig fields; the rest of a `model` section must be TransformerConfig fields
    "share_embeddings_and_output_weights",
    "make_vocab_size_divisible_by",
    "position_embedding_type",
    "rotary_base",
    "rotary_percent",
    "rope_scaling",
    "rope_scaling_factor",
    "seq_length",
    "vocab_size",
    "should_pad_vocab",
    "hf_model_id",
}


def _hf(hf_dir: Path) -> dict:
    return json.loads((hf_dir / "config.json").read_text())


def _model_section(hf: dict) -> dict:
    """A `run_config.yaml` model section as Megatron-Bridge writes it for an HF model (its field names)."""
    heads = hf["num_attention_heads"]
    rope = hf.get("rope_parameters") or {}  # transformers 5; older configs: rope_theta + rope_scaling
    theta = hf.get("rope_theta", rope.get("rope_theta"))
    scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type") not in (None, "default") else None)
    section = {
        "_target_": "megatron.bridge.models.gpt_provider.GPTModelProvider",
        "num_layers": hf["num_hidden_layers"],
        "hidden_size": hf["hidden_size"],
        "ffn_hidden_size": hf["intermediate_size"],
        "num_attention_heads": heads,
        "num_query_groups": hf["num_key_value_heads"],
        "kv_channels": hf.get("head_dim") or hf["hidden_size"] // heads,
        "layernorm_epsilon": hf["rms_norm_eps"],
        "normalization": "RMSNorm",
        "gated_linear_unit": True,
        "activation_func": {"_target_": "torch.nn.functional.silu", "_call_": False},
        "add_bias_linear": False,
        "add_qkv_bias": hf["model_type"] == "qwen2",
        "qk_layernorm": hf["model_type"] in ("qwen3", "qwen3_moe"),
        "position_embedding_type": "rope",
        "rotary_base": theta,
        "rope_scaling": scaling is not None,
        "rope_scaling_factor": scaling["factor"] if scaling else 1.0,
        "seq_length": hf["max_position_embeddings"],
        "vocab_size": hf["vocab_size"],
        "share_embeddings_and_output_weights": hf["tie_word_embeddings"],
        "params_dtype": {"_target_": "torch.float32", "_call_": False},
    }
    if hf["model_type"] == "mixtral":
        section |= {
            "num_moe_experts": hf["num_local_experts"],
            "moe_ffn_hidden_size": hf["intermediate_size"],
            "moe_router_topk": hf["num_experts_per_tok"],
            "moe_layer_freq": 1,
            "moe_router_pre_softmax": False,
        }
    return section


def _as_bridge_checkpoint(megatron_lm: Path, hf: dict, step: int) -> Path:
    """Rearrange a Megatron-LM-layout checkpoint into Megatron-Bridge's layout (no args, no HF assets)."""
    iteration = megatron_lm / f"iter_{step:07d}"
    (megatron_lm / "release").rename(iteration)
    shutil.rmtree(megatron_lm / "hf_assets")
    (megatron_lm / "latest_checkpointed_iteration.txt").unlink()
    common_path = iteration / "common.pt"
    with torch.serialization.safe_globals([__import__("argparse").Namespace]):
        common = torch.load(common_path, weights_only=True)
    del common["args"]
    torch.save(common, common_path)
    (iteration / "run_config.yaml").write_text(yaml.safe_dump({"model": _model_section(hf)}))
    state = {"step": torch.tensor(step), "consumed_train_samples": torch.tensor(0), "do_train": torch.tensor(True)}
    torch.save(state, iteration / "train_state.pt")
    torch.save(state, megatron_lm / "latest_train_state.pt")
    return megatron_lm


@pytest.mark.parametrize("variant", ["llama", "qwen3", "qwen2"])
def test_export_reads_a_megatron_bridge_checkpoint(variant, tiny_models, tmp_path):
    hf_dir = tiny_models[variant]
    convert_hf_to_mcore(hf_dir, tmp_path / "m", layout=Layout(tp=2), show_progress=False)
    root = _as_bridge_checkpoint(tmp_path / "m", _hf(hf_dir), step=100)
    convert_mcore_to_hf(root, tmp_path / "hf", show_progress=False)  # found through latest_train_state.pt
    assert_same_weights(hf_dir, tmp_path / "hf")
    back = _hf(tmp_path / "hf")
    for key in ("num_hidden_layers", "hidden_size", "num_key_value_heads", "rms_norm_eps", "vocab_size"):
        assert back[key] == _hf(hf_dir)[key], key
    assert back["architectures"] == _hf(hf_dir)["architectures"]


def test_export_reads_a_megatron_bridge_moe_checkpoint(tiny_moe_models, tmp_path):
    hf_dir = tiny_moe_models["mixtral"]
    convert_hf_to_mcore(hf_dir, tmp_path / "m", layout=Layout(ep=2), spec="local", show_progress=False)
    root = _as_bridge_checkpoint(tmp_path / "m", _hf(hf_dir), step=7)
    convert_mcore_to_hf(root / "iter_0000007", tmp_path / "hf", show_progress=False)  # the iteration directory
    assert_same_weights(hf_dir, tmp_path / "hf")
    assert _hf(tmp_path / "hf")["architectures"] == ["MixtralForCausalLM"]


def test_run_config_without_model_or_with_another_activation_is_refused(tiny_models, tmp_path):
    hf_dir = tiny_models["llama"]
    convert_hf_to_mcore(hf_dir, tmp_path / "m", show_progress=False)
    root = _as_bridge_checkpoint(tmp_path / "m", _hf(hf_dir), step=1)
    run_config = root / "iter_0000001" / "run_config.yaml"
    section = yaml.safe_load(run_config.read_text())["model"]
    run_config.write_text(
        yaml.safe_dump({"model": section | {"activation_func": {"_target_": "torch.nn.functional.gelu"}}})
    )
    with pytest.raises(CheckpointError, match="gelu"):
        convert_mcore_to_hf(root, tmp_path / "a", show_progress=False)
    run_config.write_text(yaml.safe_dump({"optimizer": {}}))
    with pytest.raises(CheckpointError, match="no `model` section"):
        convert_mcore_to_hf(root, tmp_path / "b", show_progress=False)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.parametrize(("variant", "layout"), [("llama", Layout(tp=2, pp=2)), ("qwen3", Layout())])
def test_written_megatron_bridge_layout(variant, layout, tiny_models, tmp_path):
    from megatron.core.transformer import TransformerConfig

    hf_dir = tiny_models[variant]
    hf = _hf(hf_dir)
    root = tmp_path / "m"
    convert_hf_to_mcore(hf_dir, root, layout=layout, directory_layout="megatron-bridge", show_progress=False)
    iteration = root / "iter_0000000"
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "0"
    for path in (root / "latest_train_state.pt", iteration / "train_state.pt"):
        state = torch.load(path, weights_only=True)
        assert all(isinstance(v, torch.Tensor) for v in state.values()) and int(state["step"]) == 0
    with torch.serialization.safe_globals([__import__("argparse").Namespace]):
        common = torch.load(iteration / "common.pt", weights_only=True)
    assert "args" not in common and common["checkpoint_version"] == 3.0 and common["iteration"] == 0
    model = yaml.safe_load((iteration / "run_config.yaml").read_text())["model"]
    assert model["_target_"] == "megatron.bridge.models.gpt_provider.GPTModelProvider"
    fields = {f.name for f in dataclasses.fields(TransformerConfig)} | GPT_PROVIDER_FIELDS
    assert not set(model) - fields - {"_target_"}, "a field the provider would not accept"
    expected = _model_section(hf)
    for key in ("num_layers", "hidden_size", "ffn_hidden_size", "num_query_groups", "kv_channels"):
        assert model[key] == expected[key], key
    for key in ("layernorm_epsilon", "rotary_base", "seq_length", "vocab_size", "qk_layernorm", "activation_func"):
        assert model[key] == expected[key], key
    assert model["share_embeddings_and_output_weights"] is hf["tie_word_embeddings"]
    assert model["should_pad_vocab"] is True and model["make_vocab_size_divisible_by"] == 128
    assert model["tensor_model_parallel_size"] == layout.tp and model["pipeline_model_parallel_size"] == layout.pp
    # and the project's export reads it back, from run_config.yaml alone
    shutil.rmtree(root / "hf_assets")
    convert_mcore_to_hf(root, tmp_path / "hf", show_progress=False)
    assert_same_weights(hf_dir, tmp_path / "hf")


def test_cli_layout_option(tiny_models, tmp_path):
    runner = CliRunner()
    base = ["convert", "--to", "mcore", str(tiny_models["llama"])]
    result = runner.invoke(app, [*base, str(tmp_path / "m"), "--no-progress", "--layout", "megatron-bridge"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "m" / "iter_0000000" / "run_config.yaml").is_file()
    result = runner.invoke(app, [*base, str(tmp_path / "n"), "--layout", "megatron-bridge", "--format", "torch"])
    assert result.exit_code == 2 and "torch_dist checkpoints only" in result.output
    result = runner.invoke(
        app, ["convert", "--to", "hf", str(tmp_path / "m"), str(tmp_path / "n"), "--layout", "megatron-bridge"]
    )
    assert result.exit_code == 2 and "--layout" in result.output
    assert not (tmp_path / "n").exists()


def test_verify_a_written_megatron_bridge_checkpoint(tiny_models, tmp_path):
    """megatron-core loads the Megatron-Bridge layout (model built from run_config.yaml) and gives HF's logits."""
    convert_hf_to_mcore(tiny_models["qwen3"], tmp_path / "m", directory_layout="megatron-bridge", show_progress=False)
    shutil.rmtree(tmp_path / "m" / "hf_assets")
    result = CliRunner().invoke(app, ["verify", str(tiny_models["qwen3"]), str(tmp_path / "m")])
    assert result.exit_code == 0, result.output
    assert "OK" in result.output
