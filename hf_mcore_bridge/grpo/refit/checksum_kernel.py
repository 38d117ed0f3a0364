"""The refit checksum's Triton kernels; `refit.checksums` defines the hash and calls them on CUDA tensors.

Kept in a module of its own so that Triton is imported only when a CUDA tensor is first checksummed (or a test runs
the kernels in Triton's interpreter, TRITON_INTERPRET=1 set before Triton is imported). Each program reads
`BLOCK x ITERS` elements in their own width, mixes them as 32-bit words in registers, sums each column in int64
and adds the two sums to its tensor's row of the output with an integer atomic (exact in any order). Positions
are 32-bit words, so a launch covers fewer than 2^31 elements (`refit.checksums.FLAT_CHUNK`) and takes the
position of its first element as `base`.
"""

import os

import torch
import triton
import triton.language as tl

from hf_mcore_bridge.grpo.refit.checksum_hash import CHECKSUM_LANES, MIXERS, RowLayout

BLOCK = 2048
"""Elements per program per iteration (8 per thread at 8 warps: one 16-byte load of 2-byte elements)."""
ITERS = 4
"""Iterations per program (unrolled, so their loads are in flight together)."""
NUM_WARPS = 8

_M32 = 0xFFFFFFFF
A0, B0, M1_0, S0, M2_0 = (
    tl.constexpr(v) for v in (MIXERS[0].a, MIXERS[0].b, MIXERS[0].m1, MIXERS[0].shift, MIXERS[0].m2)
)
A1, B1, M1_1, S1, M2_1 = (
    tl.constexpr(v) for v in (MIXERS[1].a, MIXERS[1].b, MIXERS[1].m1, MIXERS[1].shift, MIXERS[1].m2)
)
TWICE_B0 = tl.constexpr(2 * MIXERS[0].b & _M32)
TWICE_B1 = tl.constexpr(2 * MIXERS[1].b & _M32)
LANES = tl.constexpr(CHECKSUM_LANES)


@triton.jit
def _finalise(x, M1: tl.constexpr, SHIFT: tl.constexpr, M2: tl.constexpr):
    x ^= x >> 16
    x *= M1
    x ^= x >> SHIFT
    x *= M2
    x ^= x >> 16
    return x


@triton.jit
def _column(
    u,
    p,
    A: tl.constexpr,
    TWICE_B: tl.constexpr,
    B: tl.constexpr,
    M1: tl.constexpr,
    SHIFT: tl.constexpr,
    M2: tl.constexpr,
):
    x = (u ^ (p * A)) * (p * TWICE_B + B)  # (2p + 1) * b, mod 2^32
    return _finalise(x, M1, SHIFT, M2).to(tl.int64)


@triton.jit
def _mixed(raw, p, BYTES: tl.constexpr):
    """(v0, v1) as int64 of elements `raw` (their bits as integers of their own width) at positions `p` (uint32)."""
    if BYTES == 8:
        b = raw.to(tl.uint64, bitcast=True)
        lo = b.to(tl.uint32)
        hi = (b >> 32).to(tl.uint32)
        u0 = lo ^ _finalise(hi, M1_0, S0, M2_0)
        u1 = hi ^ _finalise(u0, M1_0, S0, M2_0)
    elif BYTES == 4:
        u0 = raw.to(tl.uint32, bitcast=True)
        u1 = u0
    elif BYTES == 2:
        u0 = raw.to(tl.uint16, bitcast=True).to(tl.uint32)
        u1 = u0
    else:
        u0 = raw.to(tl.uint32)  # uint8: zero-extended
        u1 = u0
    return _column(u0, p, A0, TWICE_B0, B0, M1_0, S0, M2_0), _column(u1, p, A1, TWICE_B1, B1, M1_1, S1, M2_1)


@triton.jit(do_not_specialize=["base"])
def _flat_kernel(bits_ptr, n, base, out_ptr, BYTES: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    start = tl.program_id(0) * (BLOCK * ITERS)
    lanes = tl.arange(0, BLOCK)
    first = tl.cast(base, tl.uint32)
    sum0 = tl.zeros([BLOCK], dtype=tl.int64)
    sum1 = tl.zeros([BLOCK], dtype=tl.int64)
    for k in tl.static_range(ITERS):
        offsets = start + k * BLOCK + lanes
        inside = offsets < n
        raw = tl.load(bits_ptr + offsets, mask=inside, other=0)
        v0, v1 = _mixed(raw, offsets.to(tl.uint32) + first, BYTES)
        sum0 += tl.where(inside, v0, 0)
        sum1 += tl.where(inside, v1, 0)
    tl.atomic_add(out_ptr, tl.sum(sum0), sem="relaxed")
    tl.atomic_add(out_ptr + 1, tl.sum(sum1), sem="relaxed")


@triton.jit
def _rows_kernel(bits_ptr, within_ptr, counts_ptr, owner_ptr, out_ptr, BYTES: tl.constexpr):
    row = tl.program_id(0)
    lanes = tl.arange(0, LANES)
    raw = tl.load(bits_ptr + row * LANES + lanes)
    first = (tl.load(within_ptr + row) * LANES).to(tl.uint32)
    inside = lanes < tl.load(counts_ptr + row)  # the padding after a tensor's last element is not part of it
    v0, v1 = _mixed(raw, lanes.to(tl.uint32) + first, BYTES)
    target = out_ptr + 2 * tl.load(owner_ptr + row)
    tl.atomic_add(target, tl.sum(tl.where(inside, v0, 0)), sem="relaxed")
    tl.atomic_add(target + 1, tl.sum(tl.where(inside, v1, 0)), sem="relaxed")


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _launch_options() -> dict[str, int]:
    return {} if _interpreted() else {"num_warps": NUM_WARPS}


def hash_flat(bits: torch.Tensor, base: int, out_row: torch.Tensor) -> None:
    """Adds the hash of contiguous elements (fewer than 2^31) whose first is at position `base` to `out_row`."""
    n = bits.numel()
    grid = (triton.cdiv(n, BLOCK * ITERS),)
    _flat_kernel[grid](
        bits, n, base & _M32, out_row, BYTES=bits.element_size(), BLOCK=BLOCK, ITERS=ITERS, **_launch_options()
    )


def hash_rows(buffer: torch.Tensor, layout: RowLayout, out: torch.Tensor) -> None:
    """Adds the hash of each row of a batch's buffer to its tensor's row of `out` (one program per row)."""
    grid = (buffer.numel() // CHECKSUM_LANES,)
    _rows_kernel[grid](
        buffer, layout.within, layout.counts, layout.owner, out, BYTES=buffer.element_size(), **_launch_options()
    )
