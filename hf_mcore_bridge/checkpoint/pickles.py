"""Pickle streams (protocol 2) that name classes and functions by module and name, without importing them.

Python's pickler checks every class it writes by importing its module; the pickles the conversion writes name
torch's DCP metadata classes, whose package takes most of a second to import. `PickleWriter` emits the opcodes
directly: globals by name (`Global`), objects rebuilt by a call (`Call`) or by `__new__` plus a state (`New`),
and plain values (None, bools, ints, floats, strings, tuples, lists, dicts; `Pairs` for a dict keyed by such objects).
It memoizes exactly where the standard pickler does for these values, so that a tensor's `data.pkl` comes out
byte for byte as `torch.save` writes it.

Reading goes through `torch.load(weights_only=True)`; `refused_globals` says why such a load refused a file, in
one line: the classes and functions its pickle names beyond what the load allows (torch's own message is several
lines and suggests loading the file without `weights_only`, which would run them).
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any


@dataclass(frozen=True)
class Global:
    """A class or function, by its module and name (written as the GLOBAL opcode)."""

    module: str
    name: str


@dataclass(frozen=True)
class Call:
    """An object rebuilt as `func(*args)` (the REDUCE opcode), then given `state` (BUILD) unless it is None: what
    the standard pickler writes for an object whose `__reduce__` returns `(func, args[, state])`."""

    func: Global
    args: tuple[Any, ...]
    state: Any = None


@dataclass(frozen=True)
class New:
    """An object rebuilt as `cls.__new__(cls)` followed by `__setstate__(state)` or a `__dict__` update (NEWOBJ,
    BUILD): how the standard pickler writes a dataclass instance."""

    cls: Global
    state: Any


@dataclass(frozen=True)
class Pairs:
    """A dict given as its (key, value) pairs: for keys that are `New` or `Call` values, which do not hash here."""

    items: tuple[tuple[Any, Any], ...]


@dataclass(frozen=True)
class PersistentId:
    """A reference resolved by the unpickler's `persistent_load` (BINPERSID), e.g. a tensor's storage."""

    value: Any


_BATCH = 1000
"""Items per APPENDS / SETITEMS, as the standard pickler batches them."""


class PickleWriter:
    """Writes one protocol-2 pickle of a value built from the types above and plain Python values."""

    def __init__(self) -> None:
        self._out = bytearray(pickle.PROTO + b"\x02")
        self._memo = 0

    def dumps(self, value: Any) -> bytes:
        self._save(value)
        self._out += pickle.STOP
        return bytes(self._out)

    def _put(self) -> None:
        index = self._memo
        self._memo += 1
        self._out += pickle.BINPUT + bytes([index]) if index < 256 else pickle.LONG_BINPUT + struct.pack("<I", index)

    def _save(self, value: Any) -> None:
        out = self._out
        if value is None:
            out += pickle.NONE
        elif value is True or value is False:
            out += pickle.NEWTRUE if value else pickle.NEWFALSE
        elif isinstance(value, int):
            self._int(value)
        elif isinstance(value, float):
            out += pickle.BINFLOAT + struct.pack(">d", value)
        elif isinstance(value, str):
            encoded = value.encode("utf-8", "surrogatepass")
            out += pickle.BINUNICODE + struct.pack("<I", len(encoded)) + encoded
            self._put()
        elif isinstance(value, Global):
            out += pickle.GLOBAL + f"{value.module}\n{value.name}\n".encode()
            self._put()
        elif isinstance(value, tuple):
            self._tuple(value)
        elif isinstance(value, PersistentId):
            self._save(value.value)
            out += pickle.BINPERSID
        elif isinstance(value, Call):
            self._save(value.func)
            self._save(tuple(value.args))
            out += pickle.REDUCE
            self._put()
            if value.state is not None:
                self._save(value.state)
                out += pickle.BUILD
        elif isinstance(value, New):
            self._save(value.cls)
            out += pickle.EMPTY_TUPLE + pickle.NEWOBJ
            self._put()
            self._save(value.state)
            out += pickle.BUILD
        elif isinstance(value, list):
            out += pickle.EMPTY_LIST
            self._put()
            self._batched([(item,) for item in value], pickle.APPEND, pickle.APPENDS)
        elif isinstance(value, dict | Pairs):
            out += pickle.EMPTY_DICT
            self._put()
            pairs = list(value.items() if isinstance(value, dict) else value.items)
            self._batched(pairs, pickle.SETITEM, pickle.SETITEMS)
        else:
            raise TypeError(f"cannot write {type(value).__name__} into a pickle by name")

    def _int(self, value: int) -> None:
        if 0 <= value < 256:
            self._out += pickle.BININT1 + bytes([value])
        elif 0 <= value < 65536:
            self._out += pickle.BININT2 + struct.pack("<H", value)
        elif -(2**31) <= value < 2**31:
            self._out += pickle.BININT + struct.pack("<i", value)
        else:
            encoded = pickle.encode_long(value)  # type: ignore[attr-defined]
            self._out += pickle.LONG1 + bytes([len(encoded)]) + encoded

    def _tuple(self, items: tuple[Any, ...]) -> None:
        if not items:
            self._out += pickle.EMPTY_TUPLE
            return
        if len(items) <= 3:
            for item in items:
                self._save(item)
            self._out += (pickle.TUPLE1, pickle.TUPLE2, pickle.TUPLE3)[len(items) - 1]
        else:
            self._out += pickle.MARK
            for item in items:
                self._save(item)
            self._out += pickle.TUPLE
        self._put()

    def _batched(self, items: Sequence[tuple[Any, ...]], one: bytes, many: bytes) -> None:
        """List items (1-tuples) or dict items (pairs), in batches as the standard pickler writes them."""
        for start in range(0, len(items), _BATCH):
            batch = items[start : start + _BATCH]
            if len(batch) > 1:
                self._out += pickle.MARK
            for item in batch:
                for part in item:
                    self._save(part)
            self._out += many if len(batch) > 1 else one


def dumps(value: Any) -> bytes:
    """The protocol-2 pickle of `value` (see `PickleWriter`)."""
    return PickleWriter().dumps(value)


def refused_globals(source: Path | IO[bytes], err: BaseException) -> str | None:
    """Why `torch.load(source, weights_only=True)` raised `err`, when it is the pickle naming globals the load does
    not allow: "refers to posix.system, ..."; else None. Call it inside the same `safe_globals` context as the load,
    so that what that context allows is not named."""
    if not isinstance(err, pickle.UnpicklingError):
        return None
    import torch

    try:
        if not isinstance(source, Path):
            source.seek(0)
        names = sorted(torch.serialization.get_unsafe_globals_in_checkpoint(source))
    except Exception:  # not a zip archive torch wrote: the caller reports the load's own error
        return None
    if not names:
        return None
    return (
        f"refers to {', '.join(names)}, which a weights-only load does not import or call (a pickle can run code);"
        " it was not loaded"
    )
