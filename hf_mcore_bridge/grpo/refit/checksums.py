"""Checksums for the refit's transfer check: a hash of each tensor's bit pattern that mixes every element with its
position, batched on the tensors' device with no synchronisation.

The hash, exactly (what `tests/grpo/refit/test_checksums.py` re-implements element by element in Python
integers). A tensor is read in row-major order of its shape, whatever its memory layout; element i has the bit
pattern b of its size (1, 2, 4 or 8 bytes) read as an unsigned integer, and position word p = i mod 2^32. All
arithmetic on words is mod 2^32.

- Words: for elements of up to 4 bytes, u0 = u1 = b. For 8-byte elements, with lo = b mod 2^32 and
  hi = b >> 32: u0 = lo ^ F0(hi), u1 = hi ^ F0(u0) (two Feistel rounds: (u0, u1) determines b).
- Column c (c = 0, 1; its constants in `refit.checksum_hash.MIXERS[c]`): x = (u_c ^ (p * a)) * ((2p + 1) * b), then
  v_c = F_c(x), where F_c(x) is x ^= x >> 16; x *= m1; x ^= x >> shift; x *= m2; x ^= x >> 16 (MurmurHash3's
  32-bit finaliser for column 0, "lowbias32" for column 1).
- The tensor's row: column c is the sum over all elements of v_c (unsigned 32-bit values) mod 2^64, as a signed
  int64. A tensor with no elements gives [0, 0].

Every step of v_c is invertible for a fixed position (xor with a constant, multiplication by an odd number,
x ^= x >> s), so one changed element changes its v_c by a nonzero amount below 2^32 in magnitude, never 0 mod
2^64: it always changes the row (both columns for elements of up to 4 bytes; for 8-byte elements column 0 at least
when only one half of the element changed, as a one-bit change does, and one column at least in any case). The
mix is not linear in the elements, so the structured changes that cancel in sums of (position x) bit pattern
(rows with equal sums swapped, [A, B, B, A] -> [B, A, A, B], +1/-2/+1 ulp on neighbours, paired sign flips, x and
-x exchanged in float64) show: the tests construct each of them and see both columns change. A change of several
elements goes unseen only where, in both columns, the changed elements' differences cancel; nothing here bounds
how often that happens. Positions 2^32 apart share their constants (only tensors of more than 2^32 elements have
such pairs). Dtype is not part of it: compare tensors of
one dtype.

How: the sum does not depend on the order of additions, so any batching and any reduction order give the same
row, on CPU and CUDA alike. On CUDA the kernels are Triton's (`refit.checksum_kernel`: the bits read in their own
width, mixed in registers, summed per program and added to the tensor's row with an integer atomic). Tensors of at
least `DIRECT_MIN_ELEMENTS` are hashed where they lie (a non-contiguous one through a contiguous copy), one launch
per tensor (per `FLAT_CHUNK` elements); smaller ones are copied, per element size and batch of up to
`CHECKSUM_BATCH_ELEMENTS`, into rows of `CHECKSUM_LANES` elements of one buffer (one multi-tensor copy, which reads
a non-contiguous tensor through its strides) and hashed by one launch over its rows, which masks the rows'
padding. The layout tables of a batch (each row's tensor, its index within it and its count of elements) are built
once per batch shape and cached, so a refit recorded as a CUDA graph builds no tensor from host data. Elsewhere
(CPU, or CUDA without Triton) the same arithmetic runs in torch on int64 tensors, tensor by tensor in chunks of
`TORCH_CHUNK_ELEMENTS`.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from typing import Literal

import torch

from hf_mcore_bridge.grpo.refit.checksum_hash import CHECKSUM_LANES, MIXERS, Mixer, RowLayout

__all__ = ["CHECKSUM_BATCH_ELEMENTS", "tensor_checksums"]

CHECKSUM_BATCH_ELEMENTS = 1 << 26
"""Elements of one batch's buffer at most (small tensors padded to whole rows; its one temporary): below 2^31, so
the rows kernel's offsets fit in 32 bits."""

DIRECT_MIN_ELEMENTS = 1 << 20
"""Tensors of at least this many elements are hashed where they lie (a non-contiguous one through a contiguous
copy), one kernel launch each per `FLAT_CHUNK`; smaller ones go through a batch's buffer."""

FLAT_CHUNK = 1 << 30
"""Elements per kernel launch over a tensor hashed where it lies (its offsets then fit in 32 bits)."""

TORCH_CHUNK_ELEMENTS = 1 << 20
"""Elements the torch path mixes at once (a dozen int64 temporaries of this size)."""

_M32 = 0xFFFFFFFF


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""The integer type a tensor's elements are read as (their bit pattern), by element size."""

_UNSIGNED = {1: 0xFF, 2: 0xFFFF, 4: _M32}
"""The mask that reads a signed integer of an element size as unsigned."""

Backend = Literal["triton", "torch"]


# --- the hash in torch, on int64 tensors holding words below 2^32 ---------------------------------------------


def _mul32(x: torch.Tensor, c: torch.Tensor | int) -> torch.Tensor:
    """x * c mod 2^32 for words x, c below 2^32, with no int64 product above 2^49 (signed overflow is avoided)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _finalise(x: torch.Tensor, mixer: Mixer) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, mixer.m1)
    x = x ^ (x >> mixer.shift)
    x = _mul32(x, mixer.m2)
    return x ^ (x >> 16)


def _words(bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(u0, u1) of elements read as `_BITS` integers, as int64 tensors of words."""
    if bits.element_size() == 8:
        lo, hi = bits & _M32, (bits >> 32) & _M32
        u0 = lo ^ _finalise(hi, MIXERS[0])
        return u0, hi ^ _finalise(u0, MIXERS[0])
    u = bits.to(torch.int64) & _UNSIGNED[bits.element_size()]
    return u, u


def _mixed(bits: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(v0, v1) of elements at positions (int64, any value: taken mod 2^32), as int64 tensors of words."""
    p = positions & _M32
    odd = (2 * p + 1) & _M32
    columns = []
    for u, mixer in zip(_words(bits), MIXERS, strict=True):
        x = _mul32(u ^ _mul32(p, mixer.a), _mul32(odd, mixer.b))
        columns.append(_finalise(x, mixer))
    return columns[0], columns[1]


def _torch_flat(bits: torch.Tensor, base: int, out_row: torch.Tensor) -> None:
    """Adds the hash of contiguous elements whose first is at position `base` to `out_row` ([2] int64)."""
    for start in range(0, bits.numel(), TORCH_CHUNK_ELEMENTS):
        chunk = bits[start : start + TORCH_CHUNK_ELEMENTS]
        positions = torch.arange(base + start, base + start + chunk.numel(), device=bits.device)
        v0, v1 = _mixed(chunk, positions)
        out_row.add_(torch.stack([v0.sum(), v1.sum()]))


# --- batching -------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def _layout(numels: tuple[int, ...], owners: tuple[int, ...], device: torch.device) -> RowLayout:
    """The `RowLayout` of tensors of `numels` elements that are rows `owners` of the output. Cached, so a refit
    recorded as a CUDA graph builds no tensor from host data (the eager refit before the recording made them)."""
    within, counts, owner = [], [], []
    for numel, index in zip(numels, owners, strict=True):
        rows = -(-numel // CHECKSUM_LANES)
        within += range(rows)
        counts += [CHECKSUM_LANES] * (rows - 1) + [numel - (rows - 1) * CHECKSUM_LANES]
        owner += [index] * rows
    as_tensor = functools.partial(torch.tensor, dtype=torch.int64, device=device)
    return RowLayout(as_tensor(within), as_tensor(counts), as_tensor(owner))


def _hash_batch(
    tensors: Sequence[torch.Tensor], owners: Sequence[int], out: torch.Tensor, rows_kernel: Callable[..., None]
) -> None:
    """Hashes small tensors of one element size through one buffer of whole rows (one multi-tensor copy)."""
    lanes = CHECKSUM_LANES
    bits = _BITS[tensors[0].element_size()]
    rows = [-(-t.numel() // lanes) for t in tensors]
    buffer = torch.empty(sum(rows) * lanes, dtype=bits, device=out.device)  # padding is masked, never read as data
    views, offset = [], 0
    for tensor, count in zip(tensors, rows, strict=True):
        views.append(buffer[offset : offset + tensor.numel()].view(tensor.shape))
        offset += count * lanes
    # the copy reads a non-contiguous tensor through its strides: the buffer holds the elements in row-major order
    torch._foreach_copy_(views, [t.detach().view(bits) for t in tensors])
    rows_kernel(buffer, _layout(tuple(t.numel() for t in tensors), tuple(owners), out.device), out)


def _batches(numels: Sequence[int]) -> list[list[int]]:
    """Consecutive indices of tensors of `numels` elements, grouped so that each group's buffer (whole rows) holds
    at most `CHECKSUM_BATCH_ELEMENTS` (a larger tensor alone)."""
    batches: list[list[int]] = [[]]
    size = 0
    for index, numel in enumerate(numels):
        padded = -(-numel // CHECKSUM_LANES) * CHECKSUM_LANES
        if batches[-1] and size + padded > CHECKSUM_BATCH_ELEMENTS:
            batches.append([])
            size = 0
        batches[-1].append(index)
        size += padded
    return [batch for batch in batches if batch]


def _backend(device: torch.device, backend: Backend | None) -> Backend:
    if backend is None:
        return "triton" if device.type == "cuda" and _triton_available() else "torch"
    if backend == "triton":
        if not _triton_available():
            raise ValueError("the triton checksum kernels need Triton (shipped with torch's CUDA builds on Linux)")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
            raise ValueError("the triton checksum kernels run on CUDA (on CPU only under TRITON_INTERPRET=1)")
    return backend


@functools.cache
def _triton_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def _kernels(backend: Backend) -> tuple[Callable[..., None], Callable[..., None] | None]:
    """(flat, rows) of a backend: flat(bits, base, out_row) and rows(buffer, layout, out) add to the output. The
    torch path has no rows kernel: it hashes every tensor on its own (padding small ones would multiply its work)."""
    if backend == "torch":
        return _torch_flat, None
    from hf_mcore_bridge.grpo.refit import checksum_kernel as refit_checksum_kernel

    return refit_checksum_kernel.hash_flat, refit_checksum_kernel.hash_rows


def tensor_checksums(tensors: Sequence[torch.Tensor], backend: Backend | None = None) -> torch.Tensor:
    """Per tensor, the two columns of the hash this module defines: [len(tensors), 2] int64 on the tensors' device
    (all on one device).

    Equal for equal bits and shape, whatever the layout in memory, the batching or the device; one changed element
    always changes its tensor's row, and structured changes that cancel in linear sums show (see the module's
    docstring for what is guaranteed and what is not). Nothing synchronises. `backend`: "triton" (the default on
    CUDA where Triton is installed; on CPU only in Triton's interpreter) or "torch" (the default elsewhere)."""
    if not tensors:
        return torch.zeros((0, 2), dtype=torch.int64)
    device = tensors[0].device
    flat_kernel, rows_kernel = _kernels(_backend(device, backend))
    out = torch.zeros((len(tensors), 2), dtype=torch.int64, device=device)
    small: dict[int, list[int]] = {}
    for index, tensor in enumerate(tensors):
        if tensor.numel() >= DIRECT_MIN_ELEMENTS or (rows_kernel is None and tensor.numel()):
            bits = tensor.detach().reshape(-1).view(_BITS[tensor.element_size()])  # copies a non-contiguous one
            for start in range(0, bits.numel(), FLAT_CHUNK):
                flat_kernel(bits[start : start + FLAT_CHUNK], start, out[index])
        elif tensor.numel():
            small.setdefault(tensor.element_size(), []).append(index)
    if rows_kernel is not None:
        for indices in small.values():
            for batch in _batches([tensors[i].numel() for i in indices]):
                chosen = [indices[i] for i in batch]
                _hash_batch([tensors[i] for i in chosen], chosen, out, rows_kernel)
    return out
