"""Whether this project's own writers of torch's formats still write what the installed torch writes.

A conversion that casts nothing never imports torch (2 s or more of a conversion; `docs/PERFORMANCE.md`), so it
writes three of torch's formats itself:

- the zip framing `torch.save` puts around one tensor (`torch_archive.TensorArchive`: every DCP tensor item);
- `torch.save` of plain values (`torch_archive.saved_plain`: `common.pt`, megatron-core's extra-state items and
  the 0.19 common state, in a process that has not imported torch);
- DCP's data-file layout and `.metadata` pickle (`dcp_writer.write_dcp`, `dcp_metadata.metadata_pickle`).

They follow torch's writers as those are today. `verdict()` compares them with the installed torch's before a
conversion writes, on small representative objects written both ways:

- `torch.save` archives of a few tensors and of a common state like Megatron-LM's, byte for byte, ours given the
  random serialization id (a per-archive number) that torch's got;
- a DCP checkpoint written by `write_dcp` and by `torch.distributed.checkpoint.save` (with the planner settings
  megatron-core saves with: no flattening, so no `planner_data`): the data file byte for byte
  with each archive's serialization id masked, and the `.metadata` as loaded with DCP's own classes. Its bytes are
  not meant to match: this project pickles it at protocol 2 (all it can write without importing DCP's classes),
  DCP at `pickle.dump`'s default (4, 5 from Python 3.14), and each carries a random `save_id` and its own path.

Any difference, and the conversion writes through torch's own writers instead (`torch_writer`) and says so in a
note. No torch release is named anywhere: the check runs against whichever torch is installed.

Cost: checking imports torch and DCP (6-10 s on the shared 2-core VM) and writes a few KB in a temporary
directory. So the verdict is kept for the process and in a file under the user's cache directory
(`HF_MCORE_BRIDGE_CACHE`, else `$XDG_CACHE_HOME/hf-mcore-bridge`, else `~/.cache/hf-mcore-bridge`), keyed by the
installed torch's version, Python's, and a digest of what the home-made writers produce for the representative
objects (so a new torch or a changed writer is checked again); a conversion that finds it imports nothing.
`HF_MCORE_BRIDGE_TORCH_WRITER=1` writes through torch without checking.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.metadata
import io
import json
import os
import pathlib
import pickle
import re
import sys
import tempfile
import types
import warnings
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf_mcore_bridge.checkpoint import dtypes
from hf_mcore_bridge.checkpoint.dcp_metadata import StoredItem, StoredTensor, metadata_pickle
from hf_mcore_bridge.checkpoint.plain_load import member_start
from hf_mcore_bridge.checkpoint.torch_archive import TensorArchive, saved_plain

TORCH_WRITER_ENV = "HF_MCORE_BRIDGE_TORCH_WRITER"
"""Set to 1: write through torch's own writers, unchecked."""
CACHE_ENV = "HF_MCORE_BRIDGE_CACHE"
"""The directory that keeps verdicts (see the module docstring for the default)."""
NAME = "hf-mcore-bridge"

TENSORS = (("bfloat16", (6, 8)), ("float32", (5,)), ("int64", (3, 2, 2)))
"""(dtype, shape) of the tensors framed both ways."""
_DCP_TENSORS = (("w", TENSORS[0]), ("n", TENSORS[1]))
"""The DCP checkpoint's tensors, by key."""
OBJECT_KEY = "decoder.layers.self_attention.core_attention._extra_state/shard_0_1"
"""The DCP checkpoint's bytes item, holding `[None]` as megatron-core's extra states do."""

_ID = "1" * 40
"""The serialization id of the archives that make the digest (any 40 digits)."""
_SAVE_ID = "00000000-0000-4000-8000-000000000000"
_SERIALIZATION_ID = re.compile(rb"(archive/\.data/serialization_id(?:FB..Z*)?)\d{40}", re.DOTALL)
_VERDICTS: dict[str, tuple[str, ...]] = {}


def plain_value() -> dict[str, Any]:
    """A common state like the one Megatron-LM saves, with every kind of value `saved_plain` writes."""
    args = argparse.Namespace(
        num_layers=2, hidden_size=64, norm_epsilon=1e-6, params_dtype=dtypes.BFLOAT16, bf16=True, fp16=False,
        rope_scaling_factor=None, moe_layer_freq=[1, 0], shape=(3, 4), tokenizer_type="HuggingFaceTokenizer",
        big=2**40, huge=2**70, negative=-7, name="é", save=pathlib.PosixPath("/tmp/checkpoints"),
    )  # fmt: skip
    return {
        "args": args,
        "checkpoint_version": 3.0,
        "iteration": 0,
        "content_metadata": {"singleton_local_shards": False, "chained_optim_avoid_prefix": True},
        "extra": types.SimpleNamespace(steps=[1, 2, 3], done=()),
    }


PLAIN_VALUES = (("a common state", plain_value), ("an extra state", lambda: [None]))
"""The plain values saved both ways."""


@dataclass(frozen=True)
class Verdict:
    """How the conversion writes torch's formats: itself (no differences) or through torch's writers."""

    differences: tuple[str, ...]
    """What the installed torch writes differently (or why torch's writers were chosen)."""

    @property
    def by_torch(self) -> bool:
        return bool(self.differences)

    @property
    def note(self) -> str | None:
        """One line for the user when the conversion writes through torch."""
        if not self.differences:
            return None
        return f"writing torch's formats with torch's own writers (slower): {'; '.join(self.differences)}"


def verdict() -> Verdict:
    """The contract's verdict for the installed torch (from this process's or the cache file's record, else
    checked now; see the module docstring)."""
    if os.environ.get(TORCH_WRITER_ENV, "") not in ("", "0"):
        return Verdict((f"{TORCH_WRITER_ENV} is set",))
    key = _key()
    if key not in _VERDICTS:
        recorded = _read_record(key)
        if recorded is None:
            try:
                recorded = tuple(differences())
            except Exception as err:  # torch's writers failed on the sample: use them, but do not remember that
                lines = str(err).strip().splitlines() or [""]
                return Verdict((f"checking them failed ({type(err).__name__}: {lines[0]})",))
            _write_record(key, recorded)
        _VERDICTS[key] = recorded
    return Verdict(_VERDICTS[key])


@functools.cache
def _torch_version() -> str | None:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def _key() -> str:
    """The installed torch and Python, and a digest of what the home-made writers write for the objects above."""
    digest = hashlib.sha256()
    for dtype, shape in TENSORS:
        archive = TensorArchive(dtype, shape, _ID)
        digest.update(archive.head + archive.tail)
    for _, value in PLAIN_VALUES:
        digest.update(saved_plain(value(), _ID))
    digest.update(_metadata_sample())
    return f"torch {_torch_version()}; python {sys.version_info[0]}.{sys.version_info[1]}; {digest.hexdigest()}"


def _metadata_sample() -> bytes:
    """What `metadata_pickle` writes for the DCP checkpoint's items, at fixed places (for the digest)."""
    tensors = [StoredTensor(key, dtype, shape, (((0,) * len(shape), shape),)) for key, (dtype, shape) in _DCP_TENSORS]
    items = [StoredItem(OBJECT_KEY, None, "__0_0.distcp", 0, 10)]
    items += [StoredItem(t.key, t.chunks[0][0], "__0_0.distcp", 10 * (i + 2), 10) for i, t in enumerate(tensors)]
    return metadata_pickle([OBJECT_KEY, *(t.key for t in tensors)], tensors, items, Path("/checkpoint"), _SAVE_ID)


def _cache_file(key: str) -> Path | None:
    """Where the verdict of `key` is kept; None without a torch version to key it by or a directory to keep it in."""
    if _torch_version() is None:
        return None
    try:
        fallback = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / NAME
    except RuntimeError:  # no home directory
        fallback = None
    root = Path(os.environ[CACHE_ENV]) if os.environ.get(CACHE_ENV) else fallback
    return None if root is None else root / f"writer-contract-{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def _read_record(key: str) -> tuple[str, ...] | None:
    path = _cache_file(key)
    try:
        record = json.loads(path.read_text()) if path is not None else None
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("key") != key or not isinstance(record.get("differences"), list):
        return None
    return tuple(str(d) for d in record["differences"])


def _write_record(key: str, found: tuple[str, ...]) -> None:
    """Keep the verdict for later processes; an unwritable cache only means checking again next time."""
    path = _cache_file(key)
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{os.getpid()}")
        temporary.write_text(json.dumps({"key": key, "differences": list(found)}))
        os.replace(temporary, path)
    except OSError:
        pass


def differences() -> list[str]:
    """Check now (imports torch and DCP): what the installed torch writes differently from the home-made writers,
    one line each; empty when nothing differs."""
    import torch

    version = torch.__version__
    previous = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)  # as both write them in a conversion
    try:
        found = [*_archive_differences(), *_dcp_differences()]
    finally:
        torch.serialization.set_crc32_options(previous)
    return [f"torch {version} writes {what} differently" for what in found]


def _torch_save(value: Any) -> bytes:
    import torch

    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _serialization_id(archive: bytes) -> str:
    """The archive's serialization id record ('' if it has none); read past zipfile's CRC check, as the records
    are written without CRC-32."""
    with zipfile.ZipFile(io.BytesIO(archive)) as opened:
        for member in opened.infolist():
            if member.filename.endswith("/.data/serialization_id"):
                start = member_start(io.BytesIO(archive), member)
                return archive[start : start + member.file_size].decode("ascii", "replace")
    return ""


def _tensor(dtype: str, shape: tuple[int, ...]) -> Any:
    import torch

    count = 1
    for size in shape:
        count *= size
    return torch.arange(count).reshape(shape).to(getattr(torch, dtype))


def _raw(tensor: Any) -> bytes:
    import torch

    return tensor.reshape(-1).view(torch.uint8).numpy().tobytes()


def _archive_differences() -> Iterator[str]:
    from hf_mcore_bridge.checkpoint.torch_writer import torch_dtypes

    for dtype, shape in TENSORS:
        tensor = _tensor(dtype, shape)
        theirs = _torch_save(tensor)
        archive = TensorArchive(dtype, shape, _serialization_id(theirs))
        ours = archive.head + _raw(tensor) + archive.tail
        if ours != theirs:
            yield f"torch.save of a {dtype} {shape} tensor ({_where(ours, theirs)})"
    for name, value in PLAIN_VALUES:
        theirs = _torch_save(torch_dtypes(value()))
        ours = saved_plain(value(), _serialization_id(theirs))
        if ours != theirs:
            yield f"torch.save of {name} ({_where(ours, theirs)})"


def _where(ours: bytes, theirs: bytes) -> str:
    first = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), min(len(ours), len(theirs)))
    return f"{len(ours)} bytes against {len(theirs)}, first difference at byte {first}"


def _dcp_differences() -> Iterator[str]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from hf_mcore_bridge.checkpoint.dcp_writer import ObjectItem, TensorChunk, write_dcp

    tensors = {key: _tensor(dtype, shape) for key, (dtype, shape) in _DCP_TENSORS}
    chunks = [
        TensorChunk(k, tuple(t.shape), (0,) * t.dim(), tuple(t.shape), t.dtype, lambda t=t: t)
        for k, t in tensors.items()
    ]
    state: dict[str, Any] = {OBJECT_KEY: [None], **tensors}
    with tempfile.TemporaryDirectory(prefix="hf-mcore-bridge-contract-") as work:
        ours, theirs = Path(work) / "ours", Path(work) / "theirs"
        write_dcp(ours, chunks, [ObjectItem(OBJECT_KEY, [None])], files=1)
        planner = DefaultSavePlanner(flatten_state_dict=False)  # as megatron-core saves: no `planner_data`
        writer = dcp.FileSystemWriter(str(theirs), single_file_per_rank=True, thread_count=1, sync_files=False)
        with warnings.catch_warnings():  # that it saves in one process, as asked
            warnings.simplefilter("ignore")
            dcp.save(state, storage_writer=writer, planner=planner, no_dist=True)
        data = [sorted(d.glob("*.distcp")) for d in (ours, theirs)]
        if [p.name for p in data[0]] != [p.name for p in data[1]]:
            yield f"DCP data files ({[p.name for p in data[1]]}, this project {[p.name for p in data[0]]})"
        elif any(_masked(a.read_bytes()) != _masked(b.read_bytes()) for a, b in zip(*data, strict=True)):
            yield "a DCP data file"
        mismatch = _metadata_mismatch((ours / ".metadata").read_bytes(), (theirs / ".metadata").read_bytes())
        if mismatch:
            yield f"DCP's .metadata ({mismatch})"


def _masked(data: bytes) -> bytes:
    return _SERIALIZATION_ID.sub(lambda m: m.group(1) + b"0" * 40, data)


def _metadata_mismatch(ours: bytes, theirs: bytes) -> str | None:
    """Which part of two `.metadata` files differs when loaded with DCP's classes (None: none), leaving out the
    random `save_id` and the checkpoint's path."""
    try:
        mine = pickle.loads(ours)  # DCP's classes, imported by the caller: the file's own classes
    except Exception as err:
        return f"DCP cannot load this project's: {type(err).__name__}: {err}"
    reference = pickle.loads(theirs)
    parts = ("state_dict_metadata", "planner_data", "storage_data", "version")
    for part in parts:
        if getattr(mine, part, None) != getattr(reference, part, None):
            return part
    if [i.index for i in mine.storage_data] != [i.index for i in reference.storage_data]:
        return "storage_data's index hints"
    meta = (mine.storage_meta, reference.storage_meta)
    if any(getattr(meta[0], f, None) != getattr(meta[1], f, None) for f in ("load_id", "modules")):
        return "storage_meta"
    return None
