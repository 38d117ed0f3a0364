"""The DCP reader reads plain tensor items straight into place, and anything else through `torch.load`; both give
what torch.distributed.checkpoint's own loader gives."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from hf_mcore_bridge.checkpoint.dcp_reader import DCPCheckpoint
from hf_mcore_bridge.convert.layout import Layout
from hf_mcore_bridge.convert.to_mcore import convert_hf_to_mcore


def _torch_dcp(directory, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    state = {key: torch.empty(shape, dtype=dtype)}
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(directory)), no_dist=True)
    return state[key]


def test_plain_items_are_read_in_place(tiny_models_bf16, tmp_path, monkeypatch):
    convert_hf_to_mcore(tiny_models_bf16["qwen3"], tmp_path / "m", layout=Layout(tp=2, pp=2), show_progress=False)
    checkpoint = DCPCheckpoint(tmp_path / "m" / "release")

    def no_torch_load(self, index):
        raise AssertionError(f"{index.fqn} went through torch.load")

    monkeypatch.setattr(DCPCheckpoint, "_load_item", no_torch_load)
    for key in checkpoint.tensor_keys():
        meta = checkpoint.tensor_meta(key)
        assert torch.equal(checkpoint.read(key), _torch_dcp(checkpoint.directory, key, meta.shape, meta.dtype.torch)), (
            key
        )
        # one layer of a stacked tensor: a region cut across the TP chunks
        if len(meta.shape) == 3:
            layer = checkpoint.read(key, (1, 0, 0), (1, *meta.shape[1:]))
            assert torch.equal(layer, _torch_dcp(checkpoint.directory, key, meta.shape, meta.dtype.torch)[1:2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_other_items_go_through_torch_load(dtype, tmp_path, monkeypatch):
    """A transposed tensor (saved with its strides) is not plain: torch.load reads it; a plain one is read in place."""
    base = torch.arange(48, dtype=torch.float32).to(dtype)
    state = {"transposed": base.reshape(6, 8).t(), "plain": base.reshape(4, 12).clone()}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True)
    checkpoint = DCPCheckpoint(tmp_path)
    loaded: list[str] = []
    real_load = DCPCheckpoint._load_item
    monkeypatch.setattr(
        DCPCheckpoint, "_load_item", lambda self, index: loaded.append(index.fqn) or real_load(self, index)
    )
    assert torch.equal(checkpoint.read("transposed"), state["transposed"])
    assert torch.equal(checkpoint.read("plain"), state["plain"])
    assert loaded == ["transposed"]
    assert torch.equal(checkpoint.read("transposed", (2, 1), (3, 4)), state["transposed"][2:5, 1:5])
