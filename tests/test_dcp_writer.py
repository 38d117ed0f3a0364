"""The streaming DCP writer frees each chunk once written: torch's writer keeps, until the file is closed, the last
tensor written under every key, so a model of many keys (per-layer keys of a heterogeneous stack: DeepSeek-V3's
dense first layers) would otherwise hold one chunk per key."""

from __future__ import annotations

import torch

from hf_mcore_bridge.checkpoint.dcp_reader import DCPCheckpoint
from hf_mcore_bridge.checkpoint.dcp_writer import TensorChunk, write_dcp


def test_chunks_are_freed_once_written_and_read_back_intact(tmp_path):
    produced: list[torch.Tensor] = []

    def chunk(key: str, value: float) -> TensorChunk:
        def produce() -> torch.Tensor:
            produced.append(torch.full((1000,), value))
            return produced[-1]

        return TensorChunk(key, (1000,), (0,), (1000,), torch.float32, produce)

    write_dcp(tmp_path, [chunk(f"layers.{i}.weight", float(i)) for i in range(6)])
    assert [t.untyped_storage().size() for t in produced[:-1]] == [0] * 5  # all but the last, freed
    reader = DCPCheckpoint(tmp_path)
    for i in range(6):
        assert torch.equal(reader.read(f"layers.{i}.weight"), torch.full((1000,), float(i)))
