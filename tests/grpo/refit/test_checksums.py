"""The refit's transfer checksums (`refit.checksums.tensor_checksums`) against the hash re-implemented here element
by element in Python integers, through both paths: torch (the CPU path) and the Triton kernels (compiled on a GPU,
else in Triton's interpreter, which the conftest selects on machines without CUDA).

Shown: equality with the reference for every element size, memory layout, batching and chunking, and positions
past 2^32; the structured changes that cancel in the old linear sums (plain and position-weighted sums of the bit
patterns, re-implemented here as `_linear_sums`, which the tests show do collide on them) change the new rows;
one random single-bit flip in each of a set of tensors changes that tensor's row and no other; a second call
builds no tensor from host data (what lets a refit recorded as a CUDA graph replay it).
"""

from __future__ import annotations

import pytest
import torch

from hf_mcore_bridge.grpo.refit import checksums as refit_checksums
from hf_mcore_bridge.grpo.refit.stream import mismatched, tensor_checksums

BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
BACKENDS = ("torch", "triton")
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
"""Where the Triton kernels run: compiled on a GPU, else in Triton's interpreter (see conftest)."""

M32 = (1 << 32) - 1
COLUMNS = (  # (a, b, m1, middle shift, m2) of each column, as the module's docstring defines the hash
    (0x9E3779B1, 0x85EBCA77, 0x85EBCA6B, 13, 0xC2B2AE35),
    (0xC2B2AE3D, 0x27D4EB2F, 0x7FEB352D, 15, 0x846CA68B),
)


def _signed64(x: int) -> int:
    return (x + (1 << 63)) % (1 << 64) - (1 << 63)


def _bit_patterns(tensor: torch.Tensor) -> list[int]:
    """The elements' bit patterns in row-major order, as unsigned Python integers."""
    size = tensor.element_size()
    values = tensor.detach().cpu().contiguous().reshape(-1).view(BITS[size]).tolist()
    return [v % (1 << (8 * size)) for v in values]


def _finalise(x: int, m1: int, shift: int, m2: int) -> int:
    x ^= x >> 16
    x = (x * m1) & M32
    x ^= x >> shift
    x = (x * m2) & M32
    return x ^ (x >> 16)


def _reference(tensor: torch.Tensor, first: int = 0) -> list[int]:
    """The hash of the module's docstring, one element at a time (`first`: the first element's position)."""
    finalise0 = COLUMNS[0][2:]
    sums = [0, 0]
    for i, b in enumerate(_bit_patterns(tensor)):
        if tensor.element_size() == 8:
            u0 = (b & M32) ^ _finalise(b >> 32, *finalise0)
            words = (u0, (b >> 32) ^ _finalise(u0, *finalise0))
        else:
            words = (b, b)
        p = (first + i) % (1 << 32)
        for column, (a, odd, m1, shift, m2) in enumerate(COLUMNS):
            x = ((words[column] ^ ((p * a) & M32)) * (((2 * p + 1) * odd) & M32)) & M32
            sums[column] += _finalise(x, m1, shift, m2)
    return [_signed64(s) for s in sums]


def _linear_sums(tensor: torch.Tensor) -> tuple[int, int]:
    """The checksums this hash replaced: the sum of the bit patterns (as signed integers of the element's size)
    and of position x bit pattern, in wrapping int64."""
    values = tensor.detach().contiguous().reshape(-1).view(BITS[tensor.element_size()]).tolist()
    return _signed64(sum(values)), _signed64(sum(i * v for i, v in enumerate(values)))


def _on(backend: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.to(TRITON_DEVICE) for t in tensors] if backend == "triton" else tensors


def _checksums(tensors: list[torch.Tensor], backend: str) -> torch.Tensor:
    return tensor_checksums(_on(backend, tensors), backend=backend).cpu()


def _mixed_tensors() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [
        torch.randn(7, 5),
        torch.randn(5000).to(torch.bfloat16),  # more than one row of a batch's buffer
        torch.randn(33, 65).t(),  # not contiguous
        torch.zeros(0),
        torch.randn(3, 4).double(),
        torch.randint(0, 255, (9,), dtype=torch.uint8),
        torch.randn(4096),  # exactly one row
        torch.tensor(-3.5),  # no dimensions
        torch.randn(6, 7).half()[:, 1:5],  # a slice: not contiguous, 2-byte elements
        torch.randint(-(1 << 62), 1 << 62, (11,)),  # negative int64
        torch.randn(40).to(torch.float8_e4m3fn),
        torch.tensor([True, False, True]),
        torch.full((300,), -0.0),
    ]


@pytest.mark.parametrize("backend", BACKENDS)
def test_checksums_are_the_reference_for_any_dtype_layout_batching_and_path(backend: str, monkeypatch) -> None:
    tensors = _mixed_tensors()
    expected = [_reference(t) for t in tensors]
    assert _checksums(tensors, backend).tolist() == expected  # every tensor through a batch's buffer
    monkeypatch.setattr(refit_checksums, "CHECKSUM_BATCH_ELEMENTS", 40)  # a batch per tensor
    assert _checksums(tensors, backend).tolist() == expected
    monkeypatch.setattr(refit_checksums, "DIRECT_MIN_ELEMENTS", 30)  # the larger ones hashed where they lie
    monkeypatch.setattr(refit_checksums, "FLAT_CHUNK", 1024)  # ... in launches of 1024 elements
    monkeypatch.setattr(refit_checksums, "TORCH_CHUNK_ELEMENTS", 100)
    assert _checksums(tensors, backend).tolist() == expected
    assert tensor_checksums([], backend=backend).shape == (0, 2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_positions_wrap_at_2_to_the_32(backend: str) -> None:
    """Both paths' kernels, given the position of the first element (only tensors of more than 2^32 elements
    reach it), against the reference."""
    from hf_mcore_bridge.grpo.refit import checksum_kernel as refit_checksum_kernel

    torch.manual_seed(3)
    flat_kernel = refit_checksum_kernel.hash_flat if backend == "triton" else refit_checksums._torch_flat
    first = (1 << 32) - 5
    for tensor in (torch.randn(300).bfloat16(), torch.randn(20).double()):
        bits = tensor.view(BITS[tensor.element_size()]).to(TRITON_DEVICE if backend == "triton" else "cpu")
        out = torch.zeros(2, dtype=torch.int64, device=bits.device)
        flat_kernel(bits, (1 << 34) + first, out)
        assert out.tolist() == _reference(tensor, first)


def _collisions() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(tensor, changed tensor) pairs whose old linear sums agree."""
    generator = torch.Generator().manual_seed(5)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    rows = randn(8, 16).bfloat16()
    rows[3] = rows[1][torch.randperm(16, generator=generator)]  # equal bit sums, different rows
    abba = randn(64)
    a, b = abba[10].item(), abba[20].item()
    abba[30:34] = torch.tensor([a, b, b, a])
    baab = abba.clone()
    baab[30:34] = torch.tensor([b, a, a, b])
    ulps = (randn(64).abs() + 0.5).bfloat16()
    nudged = ulps.clone()
    nudged.view(torch.int16)[5:8] += torch.tensor([1, -2, 1], dtype=torch.int16)
    signs = randn(32).double()
    flipped = signs.clone()
    flipped[[3, 7]] = -flipped[[3, 7]]
    pair = randn(16).double()
    pair[6] = -pair[2]
    exchanged = pair.clone()
    exchanged[[2, 6]] = pair[[6, 2]]
    return {
        "rows of equal bit sums swapped": (rows, rows[[0, 3, 2, 1, 4, 5, 6, 7]]),
        "[A, B, B, A] -> [B, A, A, B]": (abba, baab),
        "+1/-2/+1 ulp on neighbours": (ulps, nudged),
        "a pair of sign flips (float64)": (signs, flipped),
        "x <-> -x (float64)": (pair, exchanged),
    }


def test_the_old_linear_sums_collide_on_the_structured_changes() -> None:
    for what, (tensor, changed) in _collisions().items():
        assert not torch.equal(tensor.view(BITS[tensor.element_size()]), changed.view(BITS[changed.element_size()]))
        assert _linear_sums(tensor) == _linear_sums(changed), what


@pytest.mark.parametrize("backend", BACKENDS)
def test_structured_changes_change_both_columns_of_that_tensor_only(backend: str) -> None:
    cases = _collisions()
    names = list(cases)
    originals = [tensor for tensor, _ in cases.values()]
    base = _checksums(originals, backend)
    assert base.tolist() == [_reference(t) for t in originals]
    for index, (what, (_, changed)) in enumerate(cases.items()):
        tensors = [*originals[:index], changed, *originals[index + 1 :]]
        after = _checksums(tensors, backend)
        assert mismatched(names, base, after) == [what]
        assert (after[index] != base[index]).all(), what
        assert after[index].tolist() == _reference(changed), what


def _flip_one_bit(tensor: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A copy of the tensor with one random bit of one random element flipped."""
    size = tensor.element_size()
    flipped = tensor.clone()
    bits = flipped.view(-1).view(BITS[size])
    element = int(torch.randint(tensor.numel(), (1,), generator=generator))
    bit = int(torch.randint(8 * size, (1,), generator=generator))
    mask = torch.tensor(1 << bit if bit < 8 * size - 1 or size == 1 else -(1 << bit), dtype=BITS[size])
    bits[element] ^= mask
    return flipped


def _flip_set() -> list[torch.Tensor]:
    torch.manual_seed(7)
    return [
        torch.randn(40, 30).bfloat16(),
        torch.randn(5000).half(),
        torch.randn(9, 9),
        torch.randn(20).double(),
        torch.randint(0, 255, (70,), dtype=torch.uint8),
        torch.randint(-1000, 1000, (33,)),
        torch.randn(4096 + 3),
    ]


@pytest.mark.parametrize(("backend", "flips"), [("torch", 20), ("triton", 1)])
def test_one_random_bit_flip_changes_that_tensors_row_only(backend: str, flips: int) -> None:
    """Both columns for elements of up to 4 bytes; column 0 for 8-byte elements (a one-bit change touches one half
    of the element); the row equal to the reference's."""
    tensors = _flip_set()
    names = [f"t{i}" for i in range(len(tensors))]
    base = _checksums(tensors, backend)
    generator = torch.Generator().manual_seed(11)
    for _ in range(flips):
        for index, tensor in enumerate(tensors):
            flipped = _flip_one_bit(tensor, generator)
            after = _checksums([*tensors[:index], flipped, *tensors[index + 1 :]], backend)
            assert mismatched(names, base, after) == [names[index]]
            columns = after[index] != base[index]
            assert columns.all() if tensor.element_size() <= 4 else columns[0]
            if backend == "triton":
                assert after[index].tolist() == _reference(flipped)


def test_checksums_see_one_changed_element_and_permutations() -> None:
    torch.manual_seed(1)
    q, k = torch.randn(16, 8), torch.randn(8, 8)
    base = tensor_checksums([q, k])
    changed = q.clone()
    changed[5, 3] = torch.nextafter(changed[5, 3], torch.tensor(float("inf")))  # one ulp
    swapped = torch.cat([k, q[8:]]), q[:8].clone()  # q and k rows exchanged (a mis-split QKV)
    variants = {
        "one ulp": [changed, k],
        "sign of zero": [torch.where(q == q[0, 0], 0.0, q), k],
        "rows swapped": list(swapped),
        "two rows of q exchanged": [q[[1, 0, *range(2, 16)]], k],
        "k transposed": [q, k.t()],
        "k rolled": [q, k.flatten().roll(1).view(8, 8)],
    }
    signed_zero = [torch.where(q == q[0, 0], -0.0, q), k]
    assert not torch.equal(tensor_checksums(variants["sign of zero"]), tensor_checksums(signed_zero))
    for what, tensors in variants.items():
        assert mismatched(["q", "k"], base, tensor_checksums(tensors)), what
    assert mismatched(["q", "k"], base, tensor_checksums([q.clone(), k.clone()])) == []
    assert mismatched(["q", "k"], base, tensor_checksums([q, k.t().t()])) == []
    assert mismatched(["q", "k"], base, tensor_checksums([changed, k])) == ["q"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_repeated_call_builds_no_tensor_from_host_data(backend: str, monkeypatch) -> None:
    """The batches' layout tables are cached: a refit recorded as a CUDA graph (after an eager one with the same
    shapes) copies nothing from the host."""
    monkeypatch.setattr(refit_checksums, "DIRECT_MIN_ELEMENTS", 1000)  # both paths
    tensors = _on(backend, _mixed_tensors())
    first = tensor_checksums(tensors, backend=backend)

    def from_host(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("a tensor built from host data")

    monkeypatch.setattr(torch, "tensor", from_host)
    with pytest.raises(AssertionError, match="host data"):  # the guard itself fires
        refit_checksums._layout((3, 1, 4, 1, 5), (0, 1, 2, 3, 4), torch.device("cpu"))
    assert torch.equal(tensor_checksums(tensors, backend=backend), first)


def test_the_triton_backend_refuses_cpu_tensors_outside_the_interpreter(monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="run on CUDA"):
        tensor_checksums([torch.zeros(3)], backend="triton")
