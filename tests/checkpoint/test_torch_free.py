"""Conversions that cast nothing run without importing torch, and the torch-free readers and writers they use
agree with torch's own.

A conversion plans from file headers and copies bytes in the kernel; importing torch (1-2 s) would cost more than
the copy. The first tests run `bridge convert` in a fresh interpreter and report whether torch was imported, with
a conversion that casts (which needs torch) as the case that shows the probe sees an import; both find the writer
contract's verdict already recorded (`writer_contract`). The others check the torch-free pieces against torch:
`dtypes` against torch's dtypes, safetensors' headers and `torch.save`'s pickles; `plain_load` against
`torch.load`; `torch_archive.saved_plain` by loading its archives with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import argparse
import io
import json
import pickle
import pickletools
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_mcore_bridge.checkpoint import dtypes, writer_contract
from hf_mcore_bridge.checkpoint.dcp_writer import saved
from hf_mcore_bridge.checkpoint.megatron_dirs import read_common, safe_torch_load
from hf_mcore_bridge.checkpoint.plain_load import NeedsTorch, load_plain, member_start
from hf_mcore_bridge.checkpoint.torch_archive import saved_plain
from hf_mcore_bridge.models.tiny_models import build_tiny_model

PROBE = """
import sys
import types
from hf_mcore_bridge.cli.main import app
try:
    app(sys.argv[1:], standalone_mode=False)
finally:
    print("TORCH_IMPORTED" if "torch" in sys.modules else "NO_TORCH")
"""


def _convert(*args: str) -> bool:
    """Run `bridge ARGS` in a fresh interpreter; whether it imported torch."""
    done = subprocess.run([sys.executable, "-c", PROBE, *args, "--no-progress"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return "TORCH_IMPORTED" in done.stdout.splitlines()[-1]


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("hf") / "qwen3", "Qwen3ForCausalLM", seed=3, dtype=torch.bfloat16)


@pytest.fixture
def checked_writers(tmp_path, monkeypatch) -> None:
    """The writer contract's verdict recorded where the child conversions look for it (a conversion that finds
    none checks the contract, importing torch: `test_writer_contract`)."""
    monkeypatch.setenv(writer_contract.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(writer_contract.TORCH_WRITER_ENV, raising=False)
    monkeypatch.setattr(writer_contract, "_VERDICTS", {})
    assert not writer_contract.verdict().by_torch


def test_conversions_that_cast_nothing_import_no_torch(bf16_model, tmp_path, checked_writers):
    mcore, back = tmp_path / "mcore", tmp_path / "back"
    assert not _convert("convert", "--to", "mcore", str(bf16_model), str(mcore), "--tp", "2", "--pp", "2")
    assert not _convert("convert", "--to", "hf", str(mcore), str(back))
    source, exported = load_file(bf16_model / "model.safetensors"), load_file(back / "model.safetensors")
    assert source.keys() == exported.keys()
    for name, tensor in source.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    common = safe_torch_load(mcore / "release" / "common.pt")  # written without torch, read by torch
    assert common["args"].params_dtype is torch.bfloat16 and common["args"].bf16 is True
    assert common["args"].tensor_model_parallel_size == 2 and common["iteration"] == 0


def test_the_probe_sees_a_conversion_that_needs_torch(bf16_model, tmp_path, checked_writers):
    assert _convert("convert", "--to", "mcore", str(bf16_model), str(tmp_path / "m"), "--dtype", "fp32")


def test_dtypes_name_what_torch_safetensors_and_torch_save_name(tmp_path):
    for kind in dtypes.ALL:
        reference = getattr(torch, kind.name)
        assert dtypes.of(reference) is kind and kind.torch is reference
        assert kind.itemsize == reference.itemsize and kind.floating == reference.is_floating_point
        save_file({"t": torch.zeros(2, dtype=reference)}, tmp_path / "t.safetensors")
        with (tmp_path / "t.safetensors").open("rb") as handle:
            header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
        assert header["t"]["dtype"] == kind.safetensors, kind
        if kind.storage is not None:
            buffer = io.BytesIO()
            torch.save(torch.zeros(2, dtype=reference), buffer)
            with zipfile.ZipFile(buffer) as archive:
                pickled = archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
            names = {arg for op, arg, _ in pickletools.genops(pickled) if op.name == "GLOBAL"}
            assert f"torch {kind.storage}" in names, kind
    with pytest.raises(ValueError, match="complex64"):
        dtypes.of(torch.complex64)


def _namespace() -> argparse.Namespace:
    return argparse.Namespace(
        num_layers=2, hidden_size=64, norm_epsilon=1e-6, rope_scaling_factor=None, params_dtype=torch.bfloat16,
        bf16=True, moe_layer_freq=[1, 0], shape=(3, 4), tokenizer_type="HuggingFaceTokenizer", big=2**40, neg=-7,
    )  # fmt: skip


def test_plain_load_reads_what_torch_load_reads(tmp_path):
    common = {"args": _namespace(), "checkpoint_version": 3.0, "iteration": 5, "meta": {"a": [1, 2]}}
    torch.save(common, tmp_path / "common.pt")
    plain = load_plain(tmp_path / "common.pt")
    reference = safe_torch_load(tmp_path / "common.pt")
    assert plain["args"].params_dtype is dtypes.BFLOAT16
    plain["args"].params_dtype = torch.bfloat16
    assert plain == reference


@pytest.mark.parametrize(
    "payload, refused",
    [
        ({"rng": torch.zeros(3)}, "_rebuild_tensor_v2"),
        ({"f": print}, "print"),
    ],
)
def test_plain_load_leaves_anything_else_to_torch(payload, refused, tmp_path):
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    with pytest.raises(NeedsTorch, match=refused):
        load_plain(buffer.getvalue())


def test_plain_load_never_resolves_an_unlisted_global():
    class Boom:
        def __reduce__(self):
            return (exec, ("raise SystemExit('ran')",))

    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as out:
        out.writestr("archive/data.pkl", pickle.dumps(Boom(), protocol=2))
    with pytest.raises(NeedsTorch, match="exec"):
        load_plain(archive.getvalue())


def test_read_common_torch_free_falls_back_to_torch_for_tensors(tmp_path):
    torch.save({"args": _namespace(), "rng": torch.arange(3)}, tmp_path / "common.pt")
    common = read_common(tmp_path, torch_free=True)
    assert torch.equal(common["rng"], torch.arange(3)) and common["args"].params_dtype is torch.bfloat16


def test_saved_plain_archives_load_in_torch_as_the_value():
    value = {"args": _namespace(), "checkpoint_version": 3.0, "content": {"x": [None, True, 0.5]}}
    with_dtype = dict(value, args=argparse.Namespace(**{**vars(value["args"]), "params_dtype": dtypes.BFLOAT16}))
    with torch.serialization.safe_globals([argparse.Namespace]):
        loaded = torch.load(io.BytesIO(saved_plain(with_dtype)), weights_only=True)
    assert loaded == value and loaded["args"].params_dtype is torch.bfloat16
    assert torch.load(io.BytesIO(saved_plain([None])), weights_only=True) == [None]


def test_saved_falls_back_to_torch_save_for_tensors():
    with pytest.raises(TypeError, match="Tensor"):
        saved_plain({"t": torch.ones(2)})
    payload = {"t": torch.ones(2), "dtype": dtypes.FLOAT16}
    loaded = torch.load(io.BytesIO(saved(payload)), weights_only=True)
    assert torch.equal(loaded["t"], torch.ones(2)) and loaded["dtype"] is torch.float16


def test_saved_plain_writes_the_bytes_torch_save_writes_for_namespaces():
    """Byte for byte, given torch's serialization id: an argparse Namespace (rebuilt by `__new__`) and a
    SimpleNamespace (rebuilt by its `__reduce__`, a call and a state) are pickled differently by the standard
    pickler, and must be here too."""
    value = {"args": argparse.Namespace(a=1, b=[2.5, None]), "extra": types.SimpleNamespace(steps=(1, 2), name="x")}
    previous = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)  # as this project writes archives
    try:
        buffer = io.BytesIO()
        torch.save(value, buffer)
    finally:
        torch.serialization.set_crc32_options(previous)
    theirs = buffer.getvalue()
    with zipfile.ZipFile(io.BytesIO(theirs)) as archive:
        (member,) = (m for m in archive.infolist() if m.filename.endswith("/.data/serialization_id"))
    start = member_start(io.BytesIO(theirs), member)
    assert saved_plain(value, theirs[start : start + 40].decode()) == theirs
