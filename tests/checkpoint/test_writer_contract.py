"""The run-time contract between the torch-free writers and the installed torch's own, and the fallback it drives.

References are torch itself: `torch.save`, `torch.distributed.checkpoint.save` / `load` with the planner settings
megatron-core saves with, and megatron-core loading the result (`megatron.verify`: logits against HF's). The
contract must find each home-made writer broken on purpose (the archive framing, the plain pickles, the
`.metadata`); a conversion whose check fails must say so once and write through torch, and that output must
load with torch and megatron-core. A torch-free conversion's own files are compared with what torch writes for
the same objects.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from typer.testing import CliRunner

from hf_mcore_bridge.checkpoint import dcp_metadata, torch_archive, writer_contract
from hf_mcore_bridge.checkpoint.megatron_dirs import safe_torch_load
from hf_mcore_bridge.checkpoint.plain_load import member_start
from hf_mcore_bridge.cli.main import app
from hf_mcore_bridge.convert.layout import Layout
from hf_mcore_bridge.convert.to_hf import convert_mcore_to_hf
from hf_mcore_bridge.convert.to_mcore import convert_hf_to_mcore
from hf_mcore_bridge.megatron.verify import VerifyJob, verify
from hf_mcore_bridge.models.tiny_models import build_tiny_model

_SERIALIZATION_ID = re.compile(rb"(archive/\.data/serialization_id(?:FB..Z*)?)\d{40}", re.DOTALL)

PROBE = """
import sys
from hf_mcore_bridge.cli.main import app
try:
    app(sys.argv[1:], standalone_mode=False)
finally:
    print("TORCH_IMPORTED" if "torch" in sys.modules else "NO_TORCH")
"""


def _masked(data: bytes) -> bytes:
    """Each archive's serialization id (a random number per archive) replaced by zeros."""
    return _SERIALIZATION_ID.sub(lambda m: m.group(1) + b"0" * 40, data)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty verdict cache, for this process and for the children it starts."""
    directory = tmp_path / "cache"
    monkeypatch.setenv(writer_contract.CACHE_ENV, str(directory))
    monkeypatch.delenv(writer_contract.TORCH_WRITER_ENV, raising=False)
    monkeypatch.setattr(writer_contract, "_VERDICTS", {})
    return directory


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("hf") / "qwen3", "Qwen3ForCausalLM", seed=5, dtype=torch.bfloat16)


def test_the_installed_torch_writes_what_the_home_made_writers_write():
    assert writer_contract.differences() == []


def _ints_as_four_bytes(writer, value: int) -> None:
    writer._out += pickle.BININT + value.to_bytes(4, "little", signed=True)  # loads the same, other bytes


@pytest.mark.parametrize(
    ("broken", "reported"),
    [
        ("archive alignment", "torch.save of a bfloat16 (6, 8) tensor"),
        ("plain tuples", "torch.save of a common state"),
        ("metadata version", "DCP's .metadata (version)"),
    ],
)
def test_the_check_sees_each_home_made_writer_broken(broken, reported, monkeypatch):
    if broken == "archive alignment":
        monkeypatch.setattr(torch_archive, "ALIGNMENT", 32)  # still a valid archive: torch.load reads it
    elif broken == "plain tuples":
        by_name = torch_archive._by_name
        monkeypatch.setattr(torch_archive, "_by_name", lambda v: by_name(list(v) if type(v) is tuple else v))
    else:
        monkeypatch.setattr(dcp_metadata, "VERSION", "0.0.1")
    found = writer_contract.differences()
    assert any(reported in line for line in found), found
    assert all(line.startswith(f"torch {torch.__version__} writes ") for line in found)


def test_the_verdict_is_kept_per_torch_and_writer(cache, monkeypatch):
    checks: list[int] = []
    real = writer_contract.differences
    monkeypatch.setattr(writer_contract, "differences", lambda: checks.append(1) or real())
    assert not writer_contract.verdict().by_torch and len(checks) == 1
    (record,) = cache.glob("writer-contract-*.json")
    assert json.loads(record.read_text())["key"].startswith(f"torch {torch.__version__.split('+')[0]}")
    assert not writer_contract.verdict().by_torch and len(checks) == 1  # this process's record
    monkeypatch.setattr(writer_contract, "_VERDICTS", {})
    record.write_text(json.dumps({**json.loads(record.read_text()), "differences": ["planted"]}))
    assert writer_contract.verdict().differences == ("planted",) and len(checks) == 1  # the file's record
    monkeypatch.setattr(torch_archive, "ALIGNMENT", 32)  # another writer: checked again, and found different
    assert writer_contract.verdict().by_torch and len(checks) == 2
    assert len(list(cache.glob("writer-contract-*.json"))) == 2


def test_a_check_that_cannot_run_means_torchs_writers_and_is_not_kept(cache, monkeypatch):
    def cannot_write() -> None:
        raise OSError("No space left on device\nwhile writing the sample")

    monkeypatch.setattr(writer_contract, "_dcp_differences", cannot_write)
    assert writer_contract.verdict().differences == ("checking them failed (OSError: No space left on device)",)
    assert not list(cache.glob("*.json"))  # a passing failure: checked again next time


def test_a_failed_check_writes_through_torch_and_the_output_loads(cache, tiny_models, tmp_path, monkeypatch):
    monkeypatch.setattr(torch_archive, "ALIGNMENT", 32)
    hf_dir, out = tiny_models["llama"], tmp_path / "mcore"
    result = CliRunner().invoke(app, ["convert", "--to", "mcore", "--no-progress", "--tp", "2", str(hf_dir), str(out)])
    assert result.exit_code == 0, result.output
    notes = [line for line in result.output.splitlines() if line.startswith("note: ")]
    assert len(notes) == 1 and "with torch's own writers" in notes[0] and "bfloat16 (6, 8) tensor" in notes[0], notes
    release = out / "release"
    assert sorted(p.name for p in release.glob("*.distcp")) == ["__0_0.distcp"]  # torch's writer: one file
    _, items = _items(release)
    assert {_record(data, ".storage_alignment") for data in items.values()} == {b"64"}  # torch's, not ours at 32

    state = _torch_load(release)  # torch's own reader
    hf = load_file(hf_dir / "model.safetensors")
    embedding = state["embedding.word_embeddings.weight"]
    vocab = hf["model.embed_tokens.weight"].shape[0]
    assert torch.equal(embedding[:vocab], hf["model.embed_tokens.weight"]) and not embedding[vocab:].any()
    assert safe_torch_load(release / "common.pt")["args"].tensor_model_parallel_size == 2

    (checked,) = verify([VerifyJob(hf_dir, out)], Layout())  # megatron-core loads it (at TP1), logits as HF's
    assert checked.passed and checked.top1_agreement == 1.0, checked.summary()
    convert_mcore_to_hf(out, tmp_path / "back", show_progress=False)
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert back.keys() == hf.keys() and all(torch.equal(back[n], t) for n, t in hf.items())


def _record(archive: bytes, suffix: str) -> bytes:
    """A record of a `torch.save` archive (read past zipfile's CRC check: the records carry none)."""
    with zipfile.ZipFile(io.BytesIO(archive)) as opened:
        (member,) = (m for m in opened.infolist() if m.filename.endswith(suffix))
    start = member_start(io.BytesIO(archive), member)
    return archive[start : start + member.file_size]


def _torch_load(release: Path) -> dict[str, Any]:
    """Every item of a DCP checkpoint, read by torch's DCP reader: tensors at their global shapes, bytes items."""
    metadata = pickle.loads((release / ".metadata").read_bytes())
    state: dict[str, Any] = {
        key: None if isinstance(meta, BytesStorageMetadata) else torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # that it loads in one process
        planner = DefaultLoadPlanner(flatten_state_dict=False)
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(release)), planner=planner, no_dist=True)
    return state


def _items(release: Path) -> tuple[Any, dict[tuple[str, Any], bytes]]:
    """A DCP checkpoint's metadata (DCP's classes) and each item's bytes, by key and chunk offsets."""
    metadata = pickle.loads((release / ".metadata").read_bytes())
    files = {name: (release / name).read_bytes() for name in {i.relative_path for i in metadata.storage_data.values()}}
    return metadata, {
        (index.fqn, index.offset): files[info.relative_path][info.offset : info.offset + info.length]
        for index, info in metadata.storage_data.items()
    }


def assert_same_checkpoint(ours: Path, theirs: Path) -> None:
    """The same keys, chunks, index hints and version, and each item's bytes equal apart from serialization ids;
    where the items are (files, offsets) may differ."""
    mine, my_items = _items(ours)
    reference, their_items = _items(theirs)
    assert mine.state_dict_metadata == reference.state_dict_metadata
    assert mine.planner_data == reference.planner_data and mine.version == reference.version
    assert {i: i.index for i in mine.storage_data} == {i: i.index for i in reference.storage_data}
    assert my_items.keys() == their_items.keys()
    for key, data in my_items.items():
        assert _masked(data) == _masked(their_items[key]), key


def _convert_in_child(*args: str) -> bool:
    """`bridge ARGS` in a fresh interpreter; whether it imported torch."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *args, "--no-progress"], capture_output=True, text=True, env=dict(os.environ)
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "note:" not in done.stderr, done.stderr
    return "TORCH_IMPORTED" in done.stdout.splitlines()[-1]


def test_a_torch_free_conversion_writes_what_torch_writes(cache, bf16_model, tmp_path, monkeypatch):
    """`common.pt` byte for byte as `torch.save` writes what it holds. The DCP checkpoint (TP2: chunks of one key
    over ranks and layers, which `dcp.save` of plain tensors cannot write) as the same conversion writes it through
    torch (every item `torch.save`d, `.metadata` built by DCP's planner and written by its `FileSystemWriter`):
    each item's bytes, and `.metadata` as loaded. The first conversion checks the contract (so it imports torch),
    the next finds the verdict and imports nothing."""
    convert = ["convert", "--to", "mcore", "--tp", "2", str(bf16_model)]
    assert _convert_in_child(*convert, str(tmp_path / "first"))
    assert not _convert_in_child(*convert, str(tmp_path / "m"))
    release = tmp_path / "m" / "release"

    common = safe_torch_load(release / "common.pt")
    assert common["args"].params_dtype is torch.bfloat16 and common["args"].tensor_model_parallel_size == 2
    buffer = io.BytesIO()
    previous = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(common, buffer)
    finally:
        torch.serialization.set_crc32_options(previous)
    assert _masked((release / "common.pt").read_bytes()) == _masked(buffer.getvalue())

    monkeypatch.setenv(writer_contract.TORCH_WRITER_ENV, "1")
    by_torch = convert_hf_to_mcore(bf16_model, tmp_path / "torch", layout=Layout(tp=2), show_progress=False)
    assert by_torch.notes == (
        f"writing torch's formats with torch's own writers (slower): {writer_contract.TORCH_WRITER_ENV} is set",
    )
    assert len(list(release.glob("*.distcp"))) == 2 and len(list((tmp_path / "torch/release").glob("*.distcp"))) == 1
    assert_same_checkpoint(release, tmp_path / "torch" / "release")
    convert_mcore_to_hf(tmp_path / "torch", tmp_path / "back", show_progress=False)
    back, source = load_file(tmp_path / "back/model.safetensors"), load_file(bf16_model / "model.safetensors")
    assert back.keys() == source.keys() and all(torch.equal(back[n], t) for n, t in source.items())
