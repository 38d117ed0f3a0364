"""The fast mixture-of-experts path: tokens sorted by expert on the device, then grouped GEMMs over the sorted rows.

`model.routed_experts` (the exact path) runs each active expert on its own rows, sized on the host: one host sync
per layer and a few kernels per expert, which a CUDA graph cannot capture. Here nothing leaves the device and
every shape depends only on the number of tokens, so a decode step with experts is captured like a dense one:

1. `expert_sort.sort_experts`: the T x k (token, expert) pairs are sorted by expert (stably); each expert's
   rows start at a multiple of `block_m` in a buffer of fixed capacity (T * k plus, per expert that can occur,
   up to `block_m - 1` padding rows), and a block -> expert table names the expert of every `block_m` rows
   (-1: past the last expert's rows). vLLM's `moe_align_block_size`: in torch ops (`sort="torch"`, the default)
   or in one Triton kernel launch (`sort="triton"`, opt-in until it is timed on a GPU; see `expert_sort`).
2. `fused_experts` (Triton, `fused_moe_kernel`): one program per (block of sorted rows, tile of output columns)
   looks its expert up in the table, so only the experts the batch routes to are read, each about once. The
   first GEMM reads x's rows through the pairs (token = pair // k) and computes gate and up together with the
   activation; the second multiplies by the down projection and the routing weight and writes each pair's row;
   the k rows of a token are then summed. `grouped_mm_experts` does the same with `torch._grouped_mm` over the
   padded sorted rows (group ends on the device) where torch has it (bf16 on CUDA; a reference loop on CPU), the
   activation and the biases in torch.

Both take the exact path's stacked parameters (`gate_up_proj` [E, 2F, H]: gate rows, then up rows; `down_proj`
[E, H, F]) and its options: expert biases (`gate_up_bias` [E, 2F], `down_bias` [E, H], added before the
activation and before the routing weight, as GPT-OSS does) and the clamped activation (`ExpertActivation`).

Numerics: products accumulate in float32. The Triton kernel computes the activation in float32 from the unrounded
products and rounds it once to the activations' dtype (the exact path rounds the products first), and rounds the
down product times the routing weight per pair; `grouped_mm_experts` rounds as the exact path does. A token's k
rows are summed with one rounding. In float32 both equal the exact path to rounding; in bf16 they are no further
from a float64 product than the exact path (tested on the GPU). CPU tensors run the kernel in Triton's interpreter
(`TRITON_INTERPRET=1`, as `triton_decode`), for tests only: its products are taken in float32 from the same
operands, and it converts float32 to bf16 by truncation, not rounding. Triton itself is imported only when the
kernel is first used.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from hf_mcore_bridge.engine.expert_sort import ExpertSort, check_sort, sort_experts
from hf_mcore_bridge.engine.options import MOE_KERNELS
from hf_mcore_bridge.engine.pointwise import silu_mul
from hf_mcore_bridge.engine.triton_decode import available as triton_available
from hf_mcore_bridge.engine.triton_decode import interpreted

GROUPED_MM_ALIGN = 16
"""Rows each expert's group is padded to for `torch._grouped_mm` (CUTLASS wants 16-byte aligned group starts)."""
SWIGLU_ALPHA = 1.702
"""GPT-OSS's slope of the clamped activation's sigmoid (`swiglu_alpha`)."""


@dataclass(frozen=True)
class ExpertActivation:
    """The experts' gated activation: silu(gate) * up, or with `limit` GPT-OSS's clamped one,
    (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = min(gate, limit)."""

    limit: float | None = None
    alpha: float = SWIGLU_ALPHA


SILU = ExpertActivation()


def gated_activation(gate_up: torch.Tensor, activation: ExpertActivation = SILU) -> torch.Tensor:
    """The activation of `[gate | up]` on the last dimension: [..., 2F] -> [..., F] (torch ops)."""
    if activation.limit is None:
        return silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=activation.limit)
    up = up.clamp(min=-activation.limit, max=activation.limit)
    return (up + 1) * (gate * torch.sigmoid(gate * activation.alpha))


@dataclass(frozen=True)
class Tiles:
    """The Triton kernel's tile: `block_m` sorted rows (one expert's) by `block_n` output columns, `block_k` deep;
    `num_warps` and `num_stages` as Triton takes them (ignored by the interpreter)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16 (tl.dot's smallest tile), got {value}")


DECODE_TILES = Tiles(16, 64, 128, num_warps=4, num_stages=3)
"""Few rows per expert (decode): the smallest row block, so that an expert's weights are read once per tile of
columns with little padding (the step is bound by the weights' bytes)."""
DECODE_DOWN_TILES = DECODE_TILES
"""The down product's tile at decode (its depth is the expert width, often a few hundred)."""
PREFILL_TILES = Tiles(64, 128, 64, num_warps=8, num_stages=3)
"""Many rows per expert (prefill): larger row blocks, each weight tile reused over 64 rows."""
FLOAT32_BLOCK_K = 32
"""`block_k` for 4-byte operands: the tiles above, in float32, would need more shared memory than an SM has over
three pipeline stages (gate and up tiles both)."""
INTERPRETER_TILES = Tiles(16, 64, 64)
"""Triton's interpreter (CPU tests): few programs (each costs milliseconds there), few wasted rows."""


def default_tiles(pairs: int, num_experts: int, dtype: torch.dtype = torch.bfloat16, down: bool = False) -> Tiles:
    """The tile for `pairs` (token, expert) pairs over `num_experts` experts: `DECODE_TILES` (`DECODE_DOWN_TILES`
    for the down product, `down`) where experts get fewer than 16 rows on average, else `PREFILL_TILES` (vLLM's
    default rule, M <= E), with `FLOAT32_BLOCK_K` for float32 operands; `INTERPRETER_TILES` in Triton's
    interpreter."""
    if interpreted():
        return INTERPRETER_TILES
    decode = DECODE_DOWN_TILES if down else DECODE_TILES
    tiles = decode if pairs <= 16 * num_experts else PREFILL_TILES
    return replace(tiles, block_k=FLOAT32_BLOCK_K) if dtype.itemsize > 2 else tiles


@functools.cache
def _kernel() -> Any:
    import triton

    from hf_mcore_bridge.engine.fused_moe_kernel import fused_moe_kernel

    return triton.jit(fused_moe_kernel)


def _check_triton(what: str, device: torch.device) -> None:
    if not triton_available():
        raise ValueError(f"{what} needs Triton (shipped with torch's CUDA builds on Linux)")
    if device.type != "cuda" and not interpreted():
        raise ValueError(
            f"{what} runs on CUDA devices (on CPU only in Triton's interpreter, TRITON_INTERPRET=1, set before "
            "Triton is imported)"
        )


def grouped_mm_available() -> bool:
    """Whether this torch has `torch._grouped_mm`."""
    return hasattr(torch, "_grouped_mm")


def check_usable(kernel: str, device: torch.device, dtype: torch.dtype, sort: str = "torch") -> None:
    """Raises ValueError, naming the reason, where the MoE kernel `kernel` (`options.MOE_KERNELS`) or its sort by
    expert `sort` (`options.MOE_SORTS`) cannot run: Triton missing or a CPU device outside its interpreter (the
    Triton kernel or sort); `torch._grouped_mm` missing, or on CUDA a dtype other than bf16 (its only CUDA
    kernel)."""
    if kernel not in MOE_KERNELS:
        raise ValueError(f"moe_kernel must be one of {', '.join(MOE_KERNELS)}, got {kernel!r}")
    check_sort(sort)
    if kernel == "triton":
        _check_triton("moe_kernel triton", device)
    if sort == "triton":
        _check_triton("moe_sort triton", device)
    if kernel == "grouped_mm":
        if not grouped_mm_available():
            raise ValueError(f"moe_kernel grouped_mm needs torch._grouped_mm (torch {torch.__version__} has none)")
        if device.type == "cuda" and dtype != torch.bfloat16:
            raise ValueError(f"moe_kernel grouped_mm takes bfloat16 on CUDA, got {dtype}")


def fused_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    *,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    activation: ExpertActivation = SILU,
    tiles: Tiles | None = None,
    down_tiles: Tiles | None = None,
    sort: str = "torch",
) -> torch.Tensor:
    """Sum over each token's experts of weight * (down(act(gate_up(x) + gate_up_bias)) + down_bias), through the
    Triton grouped GEMM; [T, H] in x's dtype. `tiles` for the gate/up product and `down_tiles` for the down
    product (same `block_m`; default: `default_tiles`, and `tiles` for both where only it is given); `sort`: how
    the pairs are sorted by expert (`options.MOE_SORTS`, `expert_sort.sort_experts`).

    x: [T, H]; gate_up: [E, 2F, H]; down: [E, H, F]; weights, experts: [T, k]; biases [E, 2F] and [E, H].
    """
    tokens, hidden = x.shape
    num_experts, width = gate_up.shape[0], down.shape[2]
    top_k = experts.shape[1]
    if tiles is None:
        tiles, down_tiles = (
            default_tiles(tokens * top_k, num_experts, x.dtype),
            down_tiles or default_tiles(tokens * top_k, num_experts, x.dtype, down=True),
        )
    down_tiles = down_tiles or tiles
    if down_tiles.block_m != tiles.block_m:
        raise ValueError(f"both products sort by one block_m: {tiles.block_m} and {down_tiles.block_m}")
    order = sort_experts(experts, num_experts, tiles.block_m, sort)
    x = x.contiguous()
    hidden_act = torch.empty(tokens * top_k, width, dtype=x.dtype, device=x.device)
    grouped_gemm(x, gate_up, gate_up_bias, hidden_act, None, order, tiles, top_k, width, hidden, activation)
    per_pair = torch.empty(tokens * top_k, hidden, dtype=x.dtype, device=x.device)
    grouped_gemm(hidden_act, down, down_bias, per_pair, weights.flatten(), order, down_tiles, 1, hidden, width, SILU)
    return per_pair.view(tokens, top_k, hidden).sum(dim=1)


def grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    weights: torch.Tensor | None,
    order: ExpertSort,
    tiles: Tiles,
    a_div: int,
    n: int,
    k: int,
    activation: ExpertActivation,
) -> None:
    """One grouped GEMM: out[pair] = a[pair // a_div] @ b[expert].T (gated: gate and up rows of b, activated),
    times the pair's routing weight when `weights` is given."""
    if b.stride(2) != 1 or a.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("the grouped GEMM needs contiguous rows of its operands and output")
    gated = a_div != 1
    interpret = interpreted()
    fp32 = a.dtype == torch.float32
    grid = (order.block_expert.numel(), -(-n // tiles.block_n))
    launch: Callable[..., Any] = _kernel()[grid]
    launch(
        a,
        b,
        bias if bias is not None else b,
        out,
        weights if weights is not None else out,
        order.sorted_pairs,
        order.block_expert,
        order.num_pairs,
        n,
        k,
        float(activation.limit or 0.0),
        float(activation.alpha),
        a.stride(0),
        b.stride(0),
        b.stride(1),
        b.stride(2),
        bias.stride(0) if bias is not None else 0,
        out.stride(0),
        A_DIV=a_div,
        GATED=gated,
        CLAMPED=gated and activation.limit is not None,
        HAS_BIAS=bias is not None,
        MUL_WEIGHT=weights is not None,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        EVEN_K=k % tiles.block_k == 0,
        EVEN_N=n % tiles.block_n == 0,
        DOT_FP32=fp32 or interpret,
        PRECISION="ieee" if fp32 else None,  # no TF32 for float32 models
        **({} if interpret else {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages}),
    )


def grouped_mm_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    *,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    activation: ExpertActivation = SILU,
    sort: str = "torch",
) -> torch.Tensor:
    """`fused_experts` through `torch._grouped_mm` over the sorted rows, each expert's group padded to
    `GROUPED_MM_ALIGN` rows (padding rows repeat a real token's row and are dropped); the activation in torch;
    `sort` as `fused_experts`'. [T, H] in x's dtype."""
    tokens, hidden = x.shape
    num_experts, top_k = gate_up.shape[0], experts.shape[1]
    order = sort_experts(experts, num_experts, GROUPED_MM_ALIGN, sort)
    pairs = order.sorted_pairs
    real = pairs < order.num_pairs
    rows = torch.where(real, pairs // top_k, 0)
    row_expert = torch.searchsorted(order.group_ends, torch.arange(pairs.numel(), device=x.device), right=True)
    row_expert = row_expert.clamp(max=num_experts - 1)  # rows past the last group: never read back
    ends = order.group_ends.to(torch.int32)
    projected = torch._grouped_mm(x.index_select(0, rows), gate_up.transpose(1, 2), offs=ends)
    if gate_up_bias is not None:
        projected = projected + gate_up_bias.index_select(0, row_expert)
    out = torch._grouped_mm(gated_activation(projected, activation), down.transpose(1, 2), offs=ends)
    if down_bias is not None:
        out = out + down_bias.index_select(0, row_expert)
    row_weights = torch.cat([weights.flatten(), weights.new_zeros(1)]).index_select(0, pairs)
    out = (out * row_weights[:, None]).to(x.dtype)
    # every padding row lands in the extra row num_pairs, dropped
    per_pair = torch.empty(order.num_pairs + 1, hidden, dtype=x.dtype, device=x.device).index_copy_(0, pairs, out)
    return per_pair[: order.num_pairs].view(tokens, top_k, hidden).sum(dim=1)
