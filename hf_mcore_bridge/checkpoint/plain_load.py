"""Reading a `torch.save` archive that holds no tensors (Megatron-LM's common state), without importing torch.

`torch.save` writes a zip archive whose `<prefix>/data.pkl` is the pickled object; tensors in it are persistent
references to the archive's storage records. A common state of plain values (numbers, strings, containers), an
argparse `Namespace` and dtypes needs none of torch to rebuild: `load_plain` unpickles it with an allow-list of
exactly those globals, dtypes read as `dtypes.DType`. Anything else (a tensor, an enum of megatron-core, a
global it does not know) raises `NeedsTorch`, and the caller loads the archive with `torch.load(weights_only=True)`
and its own allow-list instead, so the allow-list here never admits more than that one does.
"""

from __future__ import annotations

import argparse
import collections
import io
import pathlib
import pickle
import struct
import types
import zipfile
from pathlib import Path
from typing import Any

from hf_mcore_bridge.checkpoint import dtypes

_GLOBALS: dict[tuple[str, str], Any] = {
    ("argparse", "Namespace"): argparse.Namespace,
    ("types", "SimpleNamespace"): types.SimpleNamespace,
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("collections", "OrderedDict"): collections.OrderedDict,
}


class NeedsTorch(Exception):
    """The archive holds something only `torch.load` rebuilds (the message says what)."""


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name in dtypes.BY_NAME:
            return dtypes.BY_NAME[name]
        found = _GLOBALS.get((module, name))
        if found is None:
            raise NeedsTorch(f"{module}.{name}")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise NeedsTorch("a tensor")


def load_plain(source: Path | bytes) -> Any:
    """The object a `torch.save` archive (a file or its bytes) holds; `NeedsTorch` when it is not made of the
    values above, or is not a zip archive (torch's legacy format); ValueError or a pickle error for a damaged one."""
    data = source if isinstance(source, bytes) else Path(source).read_bytes()
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
    except zipfile.BadZipFile:
        raise NeedsTorch("not a zip archive") from None
    with archive:
        pickles = [z for z in archive.infolist() if z.filename.endswith("/data.pkl") and z.filename.count("/") == 1]
        if len(pickles) != 1 or pickles[0].compress_type != zipfile.ZIP_STORED:
            raise NeedsTorch("no single stored data.pkl")
    start = member_start(io.BytesIO(data), pickles[0])
    return _PlainUnpickler(io.BytesIO(data[start : start + pickles[0].file_size])).load()


def member_start(handle: Any, member: zipfile.ZipInfo) -> int:
    """Where a stored zip member's bytes begin in `handle` (a seekable binary file of the archive), read from its
    local header; its CRC-32 is not checked (as torch's reader does not: `torch.save` with its CRC turned off, as
    this project writes archives, leaves the field zero). ValueError: no local header there."""
    handle.seek(member.header_offset)
    header = handle.read(30)
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        raise ValueError("bad local header")
    name_length, extra_length = struct.unpack("<HH", header[26:30])
    return member.header_offset + 30 + name_length + extra_length
