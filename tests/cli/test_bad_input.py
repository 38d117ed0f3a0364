"""Bad input: one clear line naming the problem, a non-zero exit, no traceback, nothing half-written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from cli_errors import assert_one_line_error, run
from safetensors.torch import load_file, save_file

from hf_mcore_bridge.convert.layout import Layout
from hf_mcore_bridge.convert.to_mcore import convert_hf_to_mcore


@pytest.fixture
def llama(tiny_models, tmp_path) -> Path:
    """A private copy of the tiny Llama that a test may damage."""
    return Path(shutil.copytree(tiny_models["llama"], tmp_path / "llama"))


def _rewrite(hf_dir: Path, change) -> None:
    tensors = load_file(hf_dir / "model.safetensors")
    change(tensors)
    save_file(tensors, hf_dir / "model.safetensors", metadata={"format": "pt"})


def _to_mcore(src: Path, dst: Path, *extra: str):
    return run("convert", "--to", "mcore", src, dst, "--no-progress", *extra)


def test_missing_weights(llama, tmp_path):
    (llama / "model.safetensors").unlink()
    assert_one_line_error(_to_mcore(llama, tmp_path / "out"), "has no model.safetensors")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage", ["corrupt", "truncated"])
def test_corrupt_or_truncated_safetensors(llama, tmp_path, damage):
    path = llama / "model.safetensors"
    if damage == "corrupt":
        path.write_bytes(b"\x13\x00\x00\x00\x00\x00\x00\x00not json at all....")
    else:
        data = path.read_bytes()
        path.write_bytes(data[:-100])
    assert_one_line_error(_to_mcore(llama, tmp_path / "out"), "model.safetensors", "corrupt or truncated")


def test_index_naming_a_missing_shard(llama, tmp_path):
    tensors = load_file(llama / "model.safetensors")
    (llama / "model.safetensors").unlink()
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names[:10]}, llama / "model-00001-of-00002.safetensors")
    index = {
        "metadata": {},
        "weight_map": {n: f"model-0000{1 + (i >= 10)}-of-00002.safetensors" for i, n in enumerate(names)},
    }
    (llama / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_one_line_error(_to_mcore(llama, tmp_path / "out"), "model-00002-of-00002.safetensors", "does not exist")


def test_missing_tensor(llama, tmp_path):
    _rewrite(llama, lambda t: t.pop("model.layers.3.mlp.up_proj.weight"))
    assert_one_line_error(_to_mcore(llama, tmp_path / "out"), "missing", "model.layers.3.mlp.up_proj.weight")


def test_unexpected_tensor_and_the_override(llama, tmp_path):
    _rewrite(llama, lambda t: t.update({"model.layers.0.self_attn.extra_gate.weight": torch.zeros(2)}))
    assert_one_line_error(_to_mcore(llama, tmp_path / "out"), "unexpected", "extra_gate", "--ignore-unknown")
    assert _to_mcore(llama, tmp_path / "out", "--ignore-unknown").exit_code == 0


def test_unsupported_architecture_lists_supported(llama, tmp_path):
    config = json.loads((llama / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (llama / "config.json").write_text(json.dumps(config))
    assert_one_line_error(_to_mcore(llama, tmp_path / "out"), "GPT2LMHeadModel", "LlamaForCausalLM", "Qwen3ForCausalLM")


def test_infeasible_layout(llama, tmp_path):
    assert_one_line_error(
        _to_mcore(llama, tmp_path / "out", "--tp", "8"), "num_query_groups=4 is not divisible by tp=8"
    )
    assert_one_line_error(_to_mcore(llama, tmp_path / "out", "--pp", "3"), "num_layers=8 is not divisible by pp=3")
    assert_one_line_error(_to_mcore(llama, tmp_path / "out", "--pp", "2", "--vpp", "3"), "not divisible by pp*vpp=6")
    assert not (tmp_path / "out").exists()


def test_shape_that_contradicts_the_config(llama, tmp_path):
    _rewrite(llama, lambda t: t.update({"model.layers.2.self_attn.k_proj.weight": torch.zeros(16, 64)}))
    assert_one_line_error(_to_mcore(llama, tmp_path / "out"), "k_proj", "num_key_value_heads")


def test_non_empty_destination_needs_overwrite(llama, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    assert_one_line_error(_to_mcore(llama, out), "not empty", "--overwrite-foreign")
    assert_one_line_error(_to_mcore(llama, out, "--overwrite"), "not written by", "--overwrite-foreign")
    assert (out / "keep.txt").read_text() == "precious"
    assert _to_mcore(llama, out, "--overwrite-foreign").exit_code == 0
    assert not (out / "keep.txt").exists() and (out / "release" / ".metadata").exists()


def test_interrupted_conversion_leaves_nothing(llama, tmp_path, monkeypatch):
    from hf_mcore_bridge.checkpoint import parallel_write

    calls = {"n": 0}
    original = parallel_write.write_pieces

    def interrupt_midway(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 20:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(parallel_write, "write_pieces", interrupt_midway)
    with pytest.raises(KeyboardInterrupt):
        convert_hf_to_mcore(llama, tmp_path / "out", layout=Layout(tp=2), show_progress=False)
    assert list(tmp_path.iterdir()) == [llama]  # no destination, no staging directory


def test_debug_shows_the_traceback(llama, tmp_path):
    (llama / "model.safetensors").unlink()
    result = run("--debug", "convert", "--to", "mcore", llama, tmp_path / "out")
    assert result.exit_code != 0 and result.exception is not None


def test_pickle_weights_refused_without_opt_in(llama, tmp_path):
    tensors = load_file(llama / "model.safetensors")
    (llama / "model.safetensors").unlink()
    torch.save(tensors, llama / "pytorch_model.bin")
    assert_one_line_error(_to_mcore(llama, tmp_path / "out"), "pickle", "--allow-pickle")
    assert _to_mcore(llama, tmp_path / "out", "--allow-pickle").exit_code == 0


# --- export (Megatron -> HF) ---


@pytest.fixture
def converted(tiny_models, tmp_path) -> Path:
    out = tmp_path / "mcore"
    convert_hf_to_mcore(tiny_models["llama"], out, layout=Layout(tp=2), show_progress=False)
    return out


def _to_hf(src: Path, dst: Path, *extra: str):
    return run("convert", "--to", "hf", src, dst, "--no-progress", *extra)


def test_export_not_a_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    assert_one_line_error(_to_hf(tmp_path / "empty", tmp_path / "out"), "not a Megatron checkpoint")


def test_export_truncated_distcp(converted, tmp_path):
    data_file = next((converted / "release").glob("*.distcp"))
    data_file.write_bytes(data_file.read_bytes()[:1000])
    assert_one_line_error(_to_hf(converted, tmp_path / "out"), "truncated")
    assert not (tmp_path / "out").exists()


def test_export_unreadable_common(converted, tmp_path):
    (converted / "release" / "common.pt").write_bytes(b"garbage, not a torch file")
    assert_one_line_error(_to_hf(converted, tmp_path / "out"), "common.pt", "unreadable")


def test_export_missing_tensors(converted, tiny_models, tmp_path):
    # a Qwen3 config expects q/k norms that a Llama checkpoint does not hold
    qwen3 = json.loads((tiny_models["qwen3"] / "config.json").read_text())
    qwen3.update(
        {
            k: v
            for k, v in json.loads((converted / "hf_assets" / "config.json").read_text()).items()
            if k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size")
        }
    )
    qwen3["head_dim"] = 8
    (tmp_path / "qwen3.json").write_text(json.dumps(qwen3))
    assert_one_line_error(
        _to_hf(converted, tmp_path / "out", "--hf-config", tmp_path / "qwen3.json"), "missing", "q_layernorm"
    )


def test_export_args_contradicting_tensors(converted, tmp_path):
    from hf_mcore_bridge.checkpoint.megatron_dirs import read_common

    common = read_common(converted / "release")
    common["args"].num_layers = 6
    torch.save(common, converted / "release" / "common.pt")
    shutil.rmtree(converted / "hf_assets")  # the config is rebuilt from args
    assert_one_line_error(_to_hf(converted, tmp_path / "out"), "stacks 8 layers", "6")


def test_export_unknown_iteration(converted, tmp_path):
    assert_one_line_error(_to_hf(converted, tmp_path / "out", "--iteration", "5"), "no iteration 5")


def test_bridge_export_peft_of_a_checkpoint_without_adapters(converted, tmp_path):
    """`bridge export --peft` of a checkpoint that holds no LoRA adapters (full weights): one line, nothing
    written."""
    result = run("export", converted, tmp_path / "out", "--peft")
    assert_one_line_error(result, "--peft", "holds no LoRA adapters")
    assert not (tmp_path / "out").exists()
