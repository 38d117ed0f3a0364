"""The project's DCP writer against torch.distributed.checkpoint's own: the same bytes, whether a chunk's data is
produced as a tensor or copied in the kernel from pieces of another file.

torch's `FileSystemWriter` (one thread, one file) is the reference: for the same items in the same order, the
data file must be byte-identical apart from each archive's serialization id (a random number per archive), and
the `.metadata` must unpickle (with torch's classes) to equal metadata. Pieces are checked the same way: a chunk
given as `Span`/`Rows`/`Zeros` pieces of a file holding a tensor's bytes comes out as torch writes that chunk.
"""

from __future__ import annotations

import io
import pickle
import re
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import MetadataIndex

from hf_mcore_bridge.checkpoint.byte_copy import RowPart, Rows, Span, Zeros
from hf_mcore_bridge.checkpoint.dcp_reader import DCPCheckpoint
from hf_mcore_bridge.checkpoint.dcp_writer import ObjectItem, TensorChunk, write_dcp
from hf_mcore_bridge.checkpoint.torch_archive import TensorArchive

_SERIALIZATION_ID = re.compile(rb"(archive/\.data/serialization_id(?:FB..Z*)?)\d{40}", re.DOTALL)


def _masked(data: bytes) -> bytes:
    """Bytes with each archive's serialization id (local record only) replaced by zeros."""
    return _SERIALIZATION_ID.sub(lambda m: m.group(1) + b"0" * 40, data)


def _torch_save(tensor: torch.Tensor) -> bytes:
    previous = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)  # as DCP writes through our writer and theirs alike
    try:
        buffer = io.BytesIO()
        torch.save(tensor, buffer)
        return buffer.getvalue()
    finally:
        torch.serialization.set_crc32_options(previous)


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [((2, 3), torch.bfloat16), ((70000,), torch.bool), ((1, 2, 3, 4, 5), torch.float16), ((3, 65537), torch.int64)],
)
def test_archive_is_what_torch_save_writes(shape, dtype):
    tensor = torch.arange(torch.Size(shape).numel()).reshape(shape).to(dtype)
    expected = _torch_save(tensor)
    archive = TensorArchive(str(dtype).removeprefix("torch."), shape)
    ours = archive.head + tensor.reshape(-1).view(torch.uint8).numpy().tobytes() + archive.tail
    assert archive.length == len(expected)
    assert _masked(ours) == _masked(expected)
    assert ours != expected  # the ids differ: the mask above is what made them equal
    assert torch.equal(torch.load(io.BytesIO(ours), weights_only=True), tensor)


def _reference(directory: Path, state: dict[str, object]) -> None:
    writer = dcp.FileSystemWriter(str(directory), single_file_per_rank=True, thread_count=1, sync_files=False)
    previous = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        dcp.save(state, storage_writer=writer, no_dist=True)
    finally:
        torch.serialization.set_crc32_options(previous)


def _chunk(key: str, tensor: torch.Tensor, **pieces) -> TensorChunk:
    shape = tuple(tensor.shape)
    return TensorChunk(key, shape, (0,) * len(shape), shape, tensor.dtype, lambda: tensor, **pieces)


def test_one_file_is_byte_identical_to_torchs_writer(tmp_path):
    """Tensors given as tensors and as kernel-copied pieces of a file: the same file and metadata as torch's."""
    matrix = torch.randn(6, 8).to(torch.bfloat16)
    vector = torch.randn(5)
    embedding = torch.cat((torch.randn(3, 4), torch.zeros(2, 4)))  # two zero rows of padding
    source = tmp_path / "source.bin"
    source.write_bytes(b"x" * 100 + matrix.view(torch.uint8).numpy().tobytes() + embedding[:3].numpy().tobytes())
    row = 8 * 2
    halves = (RowPart(source, 100 + 3 * row, 8, row), RowPart(source, 108 + 3 * row, 8, row))
    pieces = (Span(source, 100, 3 * row), Rows(3, halves))  # rows 0-2 whole, then rows 3-5 as two halves each
    chunks = [
        _chunk("layers.weight", matrix, pieces=pieces),
        _chunk("norm", vector),
        _chunk("embedding", embedding, pieces=(Span(source, 100 + 6 * row, 48), Zeros(32))),
    ]
    objects = [ObjectItem("layers._extra_state/shard_0_1", [None])]
    write_dcp(tmp_path / "ours", chunks, objects, files=1)
    state = {"layers._extra_state/shard_0_1": [None], "layers.weight": matrix, "norm": vector}  # DCP saves the list
    _reference(tmp_path / "torch", {**state, "embedding": embedding})

    ours, theirs = (tmp_path / d / "__0_0.distcp" for d in ("ours", "torch"))
    assert _masked(ours.read_bytes()) == _masked(theirs.read_bytes())
    mine = pickle.loads((tmp_path / "ours" / ".metadata").read_bytes())  # torch's own classes
    reference = pickle.loads((tmp_path / "torch" / ".metadata").read_bytes())
    assert mine.state_dict_metadata == reference.state_dict_metadata
    assert mine.storage_data == reference.storage_data
    assert [i.index for i in mine.storage_data] == [i.index for i in reference.storage_data]
    assert mine.storage_data[MetadataIndex("embedding", (0, 0))].length == len(_torch_save(embedding))

    # a wrong piece shows: the matrix's second half-row swapped
    swapped = (pieces[0], Rows(3, tuple(reversed(pieces[1].parts))))
    write_dcp(tmp_path / "wrong", [_chunk("layers.weight", matrix, pieces=swapped)], files=1)
    loaded = _load(tmp_path / "wrong", {"layers.weight": matrix})
    assert not torch.equal(loaded["layers.weight"], matrix)
    assert torch.equal(loaded["layers.weight"][:3], matrix[:3])


def _load(directory: Path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    state = {key: torch.empty_like(value) for key, value in like.items()}
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(directory)), no_dist=True)
    return state


def test_chunks_across_files_load_with_torchs_reader(tmp_path):
    """Several data files written in parallel, chunks of one tensor spread over them, and an item too large for
    the archive appended with torch.save (the limit lowered to make a small one large)."""
    weight = torch.randn(8, 6)
    chunks = [
        TensorChunk("w", (8, 6), (row, 0), (2, 6), torch.float32, lambda row=row: weight[row : row + 2].clone())
        for row in range(0, 8, 2)
    ]
    odd = torch.arange(6, dtype=torch.float32)
    unframed = TensorChunk("odd", (6,), (0,), (6,), torch.complex64, lambda: odd.to(torch.complex64))
    write_dcp(tmp_path, [*chunks, unframed], [ObjectItem("o", {"a": 1})], files=3)
    assert sorted(p.name for p in tmp_path.glob("*.distcp")) == ["__0_0.distcp", "__0_1.distcp", "__0_2.distcp"]
    loaded = _load(tmp_path, {"w": weight, "odd": odd.to(torch.complex64)})
    assert torch.equal(loaded["w"], weight)
    assert torch.equal(loaded["odd"], odd.to(torch.complex64))
    metadata = pickle.loads((tmp_path / ".metadata").read_bytes())
    assert len({info.relative_path for info in metadata.storage_data.values()}) == 3


def test_no_produced_chunk_outlives_its_write(tmp_path):
    """Memory holds at most the chunk being written: a model of many keys (per-layer keys of a heterogeneous stack,
    DeepSeek-V3's dense first layers) does not accumulate one chunk per key."""
    alive: list[weakref.ref[torch.Tensor]] = []
    most_alive = 0

    def chunk(key: str, value: float) -> TensorChunk:
        def produce() -> torch.Tensor:
            nonlocal most_alive
            most_alive = max(most_alive, sum(ref() is not None for ref in alive))
            tensor = torch.full((1000,), value)
            alive.append(weakref.ref(tensor))
            return tensor

        return TensorChunk(f"layers.{key}.weight", (1000,), (0,), (1000,), torch.float32, produce)

    write_dcp(tmp_path, [chunk(str(i), float(i)) for i in range(8)], files=1)
    assert most_alive <= 1 and all(ref() is None for ref in alive)
    for i in range(8):
        loaded = DCPCheckpoint(tmp_path).read(f"layers.{i}.weight")
        assert torch.equal(loaded, torch.full((1000,), float(i)))
