"""`--mcore-version`: the `torch_dist` layouts of megatron-core 0.16-0.19, written and read back.

Layout facts (Megatron-LM source, tags core_v0.16.1 .. core_v0.19.0, `megatron/core/dist_checkpointing/`):
0.16-0.18 save the common state with `torch.save` to `common.pt` and record `common_backend` in `metadata.json`;
0.19 saves it as the ShardedObject `common_state` inside the DCP files (`serialization.save`) and reads it back
with `torch.distributed.checkpoint.load({unique_key: BytesIO()}, no_dist=True)`, then `torch.load(...)[0]`
(`serialization.load_common_state_dict`) — re-implemented in `_mcore019_common` below, independent of the reader
under test.
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hf_weights import assert_same_weights
from typer.testing import CliRunner

from hf_mcore_bridge.checkpoint.megatron_dirs import installed_mcore_version, read_common
from hf_mcore_bridge.cli.main import app
from hf_mcore_bridge.convert.layout import Layout
from hf_mcore_bridge.convert.to_hf import convert_mcore_to_hf
from hf_mcore_bridge.convert.to_mcore import convert_hf_to_mcore
from hf_mcore_bridge.errors import CheckpointError


def _mcore019_common(checkpoint_dir: Path) -> dict:
    """megatron-core 0.19's `load_common_state_dict` for a checkpoint without `common.pt`."""
    key = "common_state/shard_0_1"  # ShardedObject("common_state", None, (1,), (0,)).unique_key
    state = {key: io.BytesIO()}
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(checkpoint_dir)), no_dist=True)
    loaded = state[key]
    if isinstance(loaded, io.BytesIO):  # torch's default load planner may already have unpickled it
        loaded.seek(0)
        with torch.serialization.safe_globals([argparse.Namespace]):
            loaded = torch.load(loaded, weights_only=True)
    return loaded[0]


def _convert(hf_dir: Path, out: Path, version: int | None, layout: Layout | None = None) -> Path:
    layout = layout or Layout()
    convert_hf_to_mcore(hf_dir, out, layout=layout, spec="local", mcore_version=version, show_progress=False)
    return out / "release"


@pytest.mark.parametrize("version", [16, 17, 18, 19])
def test_layout_of_each_version(version, tiny_models, tmp_path):
    hf_dir = tiny_models["qwen3"]
    release = _convert(hf_dir, tmp_path / "m", version, Layout(tp=2))
    metadata = json.loads((release / "metadata.json").read_text())
    if version < 19:
        assert metadata == {
            "sharded_backend": "torch_dist",
            "sharded_backend_version": 1,
            "common_backend": "torch",
            "common_backend_version": 1,
        }
        with torch.serialization.safe_globals([argparse.Namespace]):
            common = torch.load(release / "common.pt", weights_only=True)
    else:
        assert metadata == {"sharded_backend": "torch_dist", "sharded_backend_version": 1}
        assert not (release / "common.pt").exists()
        common = _mcore019_common(release)
    hf = json.loads((hf_dir / "config.json").read_text())
    assert common["args"].num_layers == hf["num_hidden_layers"] and common["args"].tensor_model_parallel_size == 2
    assert common["checkpoint_version"] == 3.0 and common["iteration"] == 0
    assert read_common(release)["args"].hidden_size == hf["hidden_size"]
    # export reads the layout back bit-exactly, also from the args alone (no stored HF config)
    shutil.rmtree(tmp_path / "m" / "hf_assets")
    convert_mcore_to_hf(tmp_path / "m", tmp_path / "back", show_progress=False)
    assert_same_weights(hf_dir, tmp_path / "back")


@pytest.mark.skipif(installed_mcore_version() >= 19, reason="the installed megatron-core reads the 0.19 layout")
def test_installed_megatron_core_reads_its_own_layout_only(tiny_models, tmp_path):
    """megatron-core 0.16.1 (installed here) reads the 0.16 layout and, as its source says, not the 0.19 one: hence
    the default `--mcore-version` is the installed release."""
    from megatron.core import dist_checkpointing
    from megatron.core.safe_globals import register_safe_globals

    register_safe_globals()
    old = _convert(tiny_models["llama"], tmp_path / "a", 16)
    layers = json.loads((tiny_models["llama"] / "config.json").read_text())["num_hidden_layers"]
    assert dist_checkpointing.load_common_state_dict(str(old))["args"].num_layers == layers
    new = _convert(tiny_models["llama"], tmp_path / "b", 19)
    with pytest.raises(Exception) as failure:  # 0.16.1's own error path then fails on a str
        dist_checkpointing.load_common_state_dict(str(new))
    assert isinstance(failure.value.__context__, FileNotFoundError) and "common.pt" in str(failure.value.__context__)


def test_default_version_is_the_installed_one(tiny_models, tmp_path):
    from importlib.metadata import version

    release = _convert(tiny_models["llama"], tmp_path / "m", None)
    installed_minor = int(version("megatron-core").split(".")[1])
    assert (release / "common.pt").exists() is (installed_minor < 19)


def test_missing_common_state_is_one_clear_error(tiny_models, tmp_path):
    old = _convert(tiny_models["llama"], tmp_path / "a", 16)
    (old / "common.pt").unlink()
    with pytest.raises(CheckpointError, match=r"lacks common\.pt, which its metadata\.json"):
        read_common(old)
    new = _convert(tiny_models["llama"], tmp_path / "b", 19)
    metadata = new / ".metadata"
    blob = metadata.read_bytes()
    metadata.write_bytes(blob.replace(b"common_state/shard_0_1", b"common_statX/shard_0_1"))
    with pytest.raises(CheckpointError, match=r"neither common\.pt nor a DCP item common_state/shard_0_1"):
        read_common(new)


def test_common_state_not_a_one_element_list_is_refused(tmp_path):
    from hf_mcore_bridge.checkpoint.dcp_writer import ObjectItem, write_dcp

    write_dcp(tmp_path, [], [ObjectItem("common_state/shard_0_1", {"args": None})])
    (tmp_path / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    with pytest.raises(CheckpointError, match="one-element list"):
        read_common(tmp_path)


def test_cli_mcore_version(tiny_models, tmp_path):
    runner = CliRunner()
    args = ["convert", "--to", "mcore", str(tiny_models["llama"]), str(tmp_path / "m"), "--no-progress"]
    result = runner.invoke(app, [*args, "--mcore-version", "0.19"])
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "m" / "release" / "common.pt").exists()
    result = runner.invoke(app, [*args[:4], str(tmp_path / "n"), "--no-progress", "--mcore-version", "0.20"])
    assert result.exit_code == 2 and "0.20" in result.output
    result = runner.invoke(app, [*args[:4], str(tmp_path / "n"), "--format", "torch", "--mcore-version", "0.19"])
    assert result.exit_code == 2 and "--mcore-version applies to --format torch_dist only" in result.output
    assert not (tmp_path / "n").exists()


@pytest.mark.skipif(installed_mcore_version() >= 19, reason="the installed megatron-core reads the 0.19 layout")
def test_verify_refuses_a_layout_the_installed_megatron_core_cannot_load(tiny_models, tmp_path):
    """Under megatron-core 0.16.1 the 0.19 layout is refused with its reason before a world starts; the 0.16
    layout passes the check."""
    from hf_mcore_bridge.checkpoint.megatron_dirs import check_installed_reads

    check_installed_reads(_convert(tiny_models["llama"], tmp_path / "a", 16))
    _convert(tiny_models["llama"], tmp_path / "b", 19)
    result = CliRunner().invoke(app, ["verify", str(tiny_models["llama"]), str(tmp_path / "b")])
    assert result.exit_code == 2, result.output
    assert "megatron-core >= 0.19 layout" in result.output and "--mcore-version 0.16" in result.output
