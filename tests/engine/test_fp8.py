"""Per-block FP8 weights (`engine.fp8`) against a quantizer written here block by block with Python loops."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily

from hf_mcore_bridge.engine import fp8
from hf_mcore_bridge.engine.fp8 import (
    dequantize_blockwise,
    fp8_linear,
    gemm_agrees,
    gemm_scales,
    quantize_activations,
    quantize_blockwise,
    scaled_mm_failure,
    scaled_mm_works,
)

E4M3 = torch.float8_e4m3fn


def _reference(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, scale_inv, dequantized) from the definition: each 128 x 128 block (smaller at the edges) over its
    amax / 448, rounded to e4m3; scale 1 for a block of zeros."""
    n, k = weight.shape
    rows, cols = (n + 127) // 128, (k + 127) // 128
    q = torch.empty(n, k, dtype=E4M3)
    scales = torch.empty(rows, cols)
    out = torch.empty(n, k)
    for i in range(rows):
        for j in range(cols):
            block = weight[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].float()
            amax = block.abs().max().item()
            scale = amax / 448.0 if amax > 0 else 1.0
            scales[i, j] = scale
            scale_t = torch.tensor(scale, dtype=torch.float32)
            q_block = (block / scale_t).clamp(-448, 448).to(E4M3)
            q[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = q_block
            out[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = q_block.float() * scale_t
    return q, scales, out


@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (5, 130), (128, 1)])
def test_quantize_matches_the_blockwise_definition_and_its_error_bound(shape: tuple[int, int]) -> None:
    weight = torch.randn(*shape, generator=torch.Generator().manual_seed(0)) * 0.02
    weight[0, 0] = 0.0  # zeros stay zeros
    q, scale_inv = quantize_blockwise(weight.to(torch.bfloat16))
    want_q, want_scales, want = _reference(weight.to(torch.bfloat16))
    assert q.dtype == E4M3 and scale_inv.dtype == torch.float32
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(scale_inv, want_scales)
    back = dequantize_blockwise(q, scale_inv, torch.float32)
    assert torch.equal(back, want)
    assert back[0, 0] == 0.0
    # e4m3: 3 mantissa bits (relative step 2^-3, rounding half of it) and subnormals down to 2^-9 of the scale
    scales = scale_inv.repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]]
    bound = 2**-4 * weight.abs() + 2**-10 * scales
    assert ((back - weight.to(torch.bfloat16).float()).abs() <= bound * (1 + 1e-6)).all()


def test_representable_values_round_trip_exactly() -> None:
    generator = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 256, (200, 300), generator=generator, dtype=torch.uint8).view(E4M3).float()
    codes = torch.where(codes.isfinite(), codes, 0.0)  # the NaN codes
    codes[::128, ::128] = 448.0  # every block reaches the top of the range: its scale is exactly its power of two
    blocks = torch.tensor([[2.0**-12, 2.0**-3, 1.0], [4.0, 2.0**-20, 0.5]])
    weight = codes * blocks.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]
    q, scale_inv = quantize_blockwise(weight)
    assert torch.equal(scale_inv, blocks)
    assert torch.equal(dequantize_blockwise(q, scale_inv, torch.float32), weight)


def test_block_edges_when_the_dims_are_not_multiples_of_128() -> None:
    weight = torch.full((130, 260), 0.25)
    weight[129, 259] = 1000.0  # the last (2 x 4) block of the last block row and column
    weight[0:128, 256:260] = 0.0  # a 128 x 4 edge block of zeros
    q, scale_inv = quantize_blockwise(weight)
    assert scale_inv.shape == (2, 3)
    expected = torch.full((2, 3), 0.25 / 448)
    expected[1, 2], expected[0, 2] = 1000.0 / 448, 1.0
    assert torch.equal(scale_inv, expected)
    back = dequantize_blockwise(q, scale_inv, torch.float32)
    assert back[129, 259] == 1000.0 and back[0, 0] == 0.25 and back[128, 0] == 0.25
    assert (back[0:128, 256:260] == 0).all()


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="inf or nan"):
        quantize_blockwise(torch.tensor([[1.0, float("inf")]]))
    with pytest.raises(ValueError, match="2-D"):
        quantize_blockwise(torch.ones(2, 2, 2))
    q, scale_inv = quantize_blockwise(torch.ones(130, 10))
    with pytest.raises(ValueError, match="does not fit a 130 x 10 weight"):
        dequantize_blockwise(q, scale_inv[:1], torch.float32)


def test_fp8_linear_on_cpu_is_the_dequantized_linear() -> None:
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(96, 200, generator=generator) * 0.05
    x = torch.randn(3, 7, 200, generator=generator)
    bias = torch.randn(96, generator=generator)
    q, scale_inv = quantize_blockwise(weight)
    _, _, dequantized = _reference(weight)
    assert not scaled_mm_works(torch.device("cpu"))
    assert scaled_mm_failure(torch.device("cpu")) == "not a CUDA device"
    torch.testing.assert_close(fp8_linear(x, q, scale_inv, bias), x @ dequantized.t() + bias, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fp8_linear_on_cuda_agrees_with_the_dequantized_matmul() -> None:
    """Which path runs is printed (blockwise `scaled_mm` or the dequantize fallback); the product agrees with the
    bf16 matmul of the dequantized weight to FP8 activation rounding."""
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(3)
    x = torch.randn(64, 1024, device=device, generator=generator, dtype=torch.bfloat16)
    q, scale_inv = quantize_blockwise(torch.randn(2048, 1024, device=device, generator=generator) * 0.02)
    expected = x.float() @ dequantize_blockwise(q, scale_inv, torch.float32).t()
    got = fp8_linear(x, q, scale_inv).float()
    print(f"blockwise scaled_mm used: {scaled_mm_works(device)} ({scaled_mm_failure(device) or 'agrees'})")
    assert ((got - expected).norm() / expected.norm()).item() < 0.05


def test_the_gemm_check_accepts_the_dequantized_product_and_refuses_wrong_or_failing_ones() -> None:
    """The start-up check that decides whether `scaled_mm` is used, run here on CPU with stand-in GEMMs."""
    cpu = torch.device("cpu")

    def dequantized(x: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
        return x.float() @ _reference_dequantized(q, scale_inv).t()

    def unscaled(x: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
        return x.float() @ q.float().t()  # scales left out

    def transposed(x: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
        return dequantized(x, q, scale_inv.flip(0))  # scales of the wrong blocks

    def failing(x: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("not supported on this device")

    assert gemm_agrees(cpu, dequantized)
    assert not gemm_agrees(cpu, unscaled)
    assert not gemm_agrees(cpu, transposed)
    assert not gemm_agrees(cpu, failing)


def _reference_dequantized(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    out = q.float().clone()
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            out[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] *= scale_inv[i, j]
    return out


def test_activation_scales_are_per_row_group_and_m_contiguous() -> None:
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(4)) * 3
    x[2, 128:] = 0.0  # a group of zeros gets scale 1
    q, scale = quantize_activations(x.to(torch.bfloat16))
    assert scale.shape == (5, 2) and scale.stride() == (1, 5)
    for row in range(5):
        for group in range(2):
            part = x[row, group * 128 : (group + 1) * 128].to(torch.bfloat16).float()
            amax = part.abs().max().item()
            want = torch.tensor(amax / 448 if amax > 0 else 1.0)
            assert scale[row, group] == want
            back = q[row, group * 128 : (group + 1) * 128].float() * want
            torch.testing.assert_close(back, (part / want).clamp(-448, 448).to(E4M3).float() * want)


def test_gemm_scales_are_the_transposed_scales_padded_to_four_k_blocks() -> None:
    scale_inv = torch.arange(1, 16, dtype=torch.float32).view(3, 5)  # N = 384, K = 640: 5 K-blocks, L4 = 8
    out = gemm_scales(scale_inv)
    assert out.shape == (8, 3) and out.stride() == (1, 8)
    assert torch.equal(out[:5], scale_inv.t())


def _fake_cuda(mode: FakeTensorMode, tensor: torch.Tensor) -> torch.Tensor:
    """A fake CUDA tensor of `tensor`'s shape, strides and dtype."""
    meta = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")
    return FakeTensor(mode, meta, torch.device("cuda"))


@pytest.mark.parametrize(("m", "k", "n"), [(512, 2048, 3072), (16, 384, 256), (48, 8192, 2048)])
def test_scaled_mm_operands_pass_torchs_own_layout_check(
    monkeypatch: pytest.MonkeyPatch, m: int, k: int, n: int
) -> None:
    """torch's checks of `scaled_mm` (its meta function, the mirror of ATen's CUDA checks) run on fake CUDA
    tensors: the operands `_scaled_mm` builds pass them; the weight scales as stored (`[N/128, K/128]`,
    row-major), which the first H200 run passed, are refused. The activation scales are laid out by the real
    quantizer, run on CPU (fake CUDA tensors cannot run its broadcasts on a machine without CUDA)."""
    mode = FakeTensorMode()

    def quantize_on_cpu(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with unset_fake_temporarily():
            q, scale = quantize_activations(torch.ones(tuple(x.shape), dtype=x.dtype))
        return _fake_cuda(mode, q), _fake_cuda(mode, scale)

    monkeypatch.setattr(fp8, "_QUANTIZE", quantize_on_cpu)
    with mode:
        x = torch.empty(m, k, dtype=torch.bfloat16, device="cuda")
        q = torch.empty(n, k, dtype=E4M3, device="cuda")
        scale_inv = torch.empty(n // 128, -(-k // 128), device="cuda")
        out = fp8._scaled_mm(x, q, scale_inv)
        assert out.shape == (m, n) and out.dtype == torch.bfloat16
        with pytest.raises(RuntimeError, match="blockwise scaling"):
            fp8._scaled_mm(x, q, scale_inv, gemm_scale=scale_inv)


def test_fp8_linear_pads_rows_to_16_for_the_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the FP8 GEMM runs, a row count that is not a multiple of 16 is padded with zero rows and cut back; a
    stand-in GEMM (the dequantized product) shows the rows it is given and that the padding does not leak."""
    seen: list[int] = []

    def stand_in(x: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor, gemm_scale: object = None) -> torch.Tensor:
        seen.append(x.shape[0])
        return (x.float() @ _reference_dequantized(q, scale_inv).t()).to(x.dtype)

    monkeypatch.setattr(fp8, "_scaled_mm", stand_in)
    monkeypatch.setattr(fp8, "scaled_mm_works", lambda device: True)
    generator = torch.Generator().manual_seed(5)
    q, scale_inv = quantize_blockwise(torch.randn(256, 128, generator=generator) * 0.05)
    x = torch.randn(3, 7, 128, generator=generator)
    out = fp8_linear(x, q, scale_inv)
    assert seen == [32] and out.shape == (3, 7, 256)
    torch.testing.assert_close(out, x @ _reference_dequantized(q, scale_inv).t(), rtol=1e-5, atol=1e-5)
