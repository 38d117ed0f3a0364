"""The fast mixture-of-experts path (`engine.fused_moe`): the Triton grouped GEMM (here in Triton's interpreter) and
`torch._grouped_mm` (its CPU loop) against the exact per-expert path in float32, at decode and prefill shapes
(experts of several blocks, widths that are not whole tiles, experts without tokens), with and without expert
biases and the clamped activation; both paths against transformers' own GPT-OSS experts; the sort by expert
against a reference written here; expert tensor parallelism (two half-width ranks sum to the whole, the down bias
added once); and a whole MoE decode step of every MoE architecture on meta tensors, which have no values: the fast
path reads nothing on the host and its shapes depend only on the batch (what a CUDA graph needs), where the exact
path cannot run at all. The GPU checks (bf16, graph capture, no synchronisation) are in `test_engine_gpu.py`."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import MOE_CONFIGS, tiny_engine_config
from transformers import GptOssConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

from hf_mcore_bridge.engine import Engine, EngineConfig, expert_sort, fused_moe, read_spec
from hf_mcore_bridge.engine.attention import DecodeMetadata
from hf_mcore_bridge.engine.expert_sort import sort_by_expert, sort_capacity
from hf_mcore_bridge.engine.fused_moe import (
    SILU,
    ExpertActivation,
    Tiles,
    check_usable,
    fused_experts,
    grouped_mm_experts,
)
from hf_mcore_bridge.engine.model import CausalLM, Experts, route, routed_experts
from hf_mcore_bridge.models.moe import MoeSpec
from hf_mcore_bridge.models.tiny_models import tiny_config

FAST = {"triton": fused_experts, "grouped_mm": grouped_mm_experts}
PATHS = {"exact": routed_experts, **FAST}
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
"""Where the Triton kernel runs: compiled on a GPU, else in Triton's interpreter (see conftest); the other paths run
on CPU (`torch._grouped_mm` takes only bf16 on CUDA)."""


def _device(kernel: str) -> str:
    return TRITON_DEVICE if kernel == "triton" else "cpu"


def _call(kernel: str, *args: object, **kwargs: object) -> torch.Tensor:
    """`kernel`'s path on its device (tensor arguments moved there), the result on CPU."""

    def move(value: object) -> object:
        return value.to(_device(kernel)) if isinstance(value, torch.Tensor) else value

    return PATHS[kernel](*map(move, args), **{k: move(v) for k, v in kwargs.items()}).cpu()


CASES = {
    # tokens, hidden, width, experts, top-k
    "decode": (6, 64, 48, 8, 2),  # fewer pairs than experts: some experts get none
    "prefill": (70, 80, 40, 4, 3),  # ~52 rows an expert (4 blocks of 16); 80 and 40 are not whole tiles of 64
}


def _case(tokens: int, hidden: int, width: int, experts: int, top_k: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    gate_up = 0.2 * torch.randn(experts, 2 * width, hidden, generator=gen)
    down = 0.2 * torch.randn(experts, hidden, width, generator=gen)
    gate_up_bias = 0.5 * torch.randn(experts, 2 * width, generator=gen)
    down_bias = 0.5 * torch.randn(experts, hidden, generator=gen)
    weights, chosen = route(torch.randn(tokens, experts, generator=gen), top_k, renormalize=True)
    return x, gate_up, down, gate_up_bias, down_bias, weights, chosen


@pytest.mark.parametrize("biased", [False, True])
@pytest.mark.parametrize("activation", [SILU, ExpertActivation(limit=0.5)], ids=["silu", "clamped"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kernel", FAST)
def test_fast_paths_equal_the_exact_path_in_float32(kernel, case, activation, biased):
    x, gate_up, down, gate_up_bias, down_bias, weights, chosen = _case(*CASES[case])
    options = dict(activation=activation)
    if biased:
        options |= dict(gate_up_bias=gate_up_bias, down_bias=down_bias)
    expected = routed_experts(x, gate_up, down, weights, chosen, **options)
    got = _call(kernel, x, gate_up, down, weights, chosen, **options)
    assert got.dtype == x.dtype and got.shape == x.shape
    # float32 to rounding: only the order of the products' sums differs
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize(
    "tiles, down_tiles",
    [(Tiles(16, 16, 32), Tiles(16, 64, 32)), (Tiles(16, 64, 32), Tiles(16, 32, 16))],
    ids=["unmasked-gate_up", "unmasked-down"],
)
def test_each_product_takes_its_own_tile_with_and_without_masks(tiles, down_tiles):
    """The Triton kernel with a tile for each product: a tile that divides its product's depth and columns loads
    the weights unmasked (`EVEN_K`, `EVEN_N`), the other masked (the decode case: hidden 64, width 48)."""
    x, gate_up, down, gate_up_bias, down_bias, weights, chosen = _case(*CASES["decode"])
    options = dict(gate_up_bias=gate_up_bias, down_bias=down_bias)
    expected = routed_experts(x, gate_up, down, weights, chosen, **options)
    got = _call("triton", x, gate_up, down, weights, chosen, tiles=tiles, down_tiles=down_tiles, **options)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    with pytest.raises(ValueError, match="one block_m"):
        _call("triton", x, gate_up, down, weights, chosen, tiles=tiles, down_tiles=Tiles(32, 16, 16))


def test_grouped_mm_in_bfloat16_stays_within_the_exact_paths_rounding():
    """bf16 operands: both paths against a float64 product of the same operands; the fast path is no further from
    it than the exact path. (The Triton kernel's bf16 check runs on the GPU, `test_engine_gpu.py`: Triton's
    interpreter converts float32 to bf16 by truncation, twice the error of the GPU's round-to-nearest.)"""
    kernel = "grouped_mm"
    x, gate_up, down, _, _, weights, chosen = (
        t.bfloat16() if t.is_floating_point() else t for t in _case(*CASES["prefill"])
    )
    reference = routed_experts(x.double(), gate_up.double(), down.double(), weights.double(), chosen)
    exact = (routed_experts(x, gate_up, down, weights, chosen).double() - reference).abs().max()
    fast = (FAST[kernel](x, gate_up, down, weights, chosen).double() - reference).abs().max()
    assert fast <= 1.5 * exact and fast < 2e-2 * reference.abs().max()


@pytest.mark.parametrize("kernel", ["exact", *FAST])
def test_biased_clamped_experts_equal_transformers_gpt_oss_experts(kernel):
    """transformers' `GptOssExperts` (interleaved gate/up columns, [E, H, 2F] weights) as the reference: its
    tensors de-interleaved into the engine's [E, 2F, H] gate-then-up layout; a limit low enough that the clamp
    bites on both gate and up."""
    config = GptOssConfig(
        hidden_size=64, intermediate_size=40, num_local_experts=8, num_experts_per_tok=3, swiglu_limit=0.6
    )
    hf = GptOssExperts(config)
    hf.limit = 0.6  # read by every transformers version's forward (some take it from the config, some fix it at 7)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in (hf.gate_up_proj, hf.down_proj, hf.gate_up_proj_bias, hf.down_proj_bias):
            p.copy_(0.15 * torch.randn(p.shape, generator=gen))
    x = torch.randn(29, 64, generator=gen)
    weights, chosen = route(torch.randn(29, 8, generator=gen), 3, renormalize=True)
    with torch.no_grad():
        expected = hf(x, chosen, weights)
        projected = x @ hf.gate_up_proj[0] + hf.gate_up_proj_bias[0]
    assert (projected > 0.6).any() and (projected < -0.6).any()  # the clamps change values
    gate_up = torch.cat((hf.gate_up_proj[..., ::2], hf.gate_up_proj[..., 1::2]), dim=2).transpose(1, 2)
    gate_up_bias = torch.cat((hf.gate_up_proj_bias[:, ::2], hf.gate_up_proj_bias[:, 1::2]), dim=1)
    down = hf.down_proj.transpose(1, 2)
    activation = ExpertActivation(hf.limit, hf.alpha)
    with torch.no_grad():
        operands = (x, gate_up.contiguous(), down.contiguous(), weights, chosen)
        options = dict(gate_up_bias=gate_up_bias, down_bias=hf.down_proj_bias, activation=activation)
        got = _call(kernel, *operands, **options)
        unclamped = _call(kernel, *operands, gate_up_bias=gate_up_bias)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(unclamped, expected, atol=1e-3)


@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_sort_groups_each_experts_pairs_in_order_on_block_boundaries(block_m):
    """Against a reference built here pair by pair: each expert's pairs, in their original order, from a multiple
    of `block_m`, the rest of its blocks padding; the block table names each block's expert, -1 past the last."""
    gen = torch.Generator().manual_seed(5)
    experts, tokens, top_k = 12, 9, 3
    candidates = torch.tensor([e for e in range(experts) if e != 7])  # expert 7 gets no pair
    chosen = torch.stack([candidates[torch.randperm(experts - 1, generator=gen)[:top_k]] for _ in range(tokens)])
    order = sort_by_expert(chosen, experts, block_m)
    flat = chosen.flatten().tolist()
    pairs = len(flat)
    assert order.sorted_pairs.numel() == sort_capacity(pairs, experts, block_m) == order.block_expert.numel() * block_m
    rows = order.sorted_pairs.tolist()
    start = 0
    for expert in range(experts):
        mine = [p for p in range(pairs) if flat[p] == expert]
        blocks = -(-len(mine) // block_m)
        assert rows[start : start + len(mine)] == mine, expert
        assert rows[start + len(mine) : start + blocks * block_m] == [pairs] * (blocks * block_m - len(mine))
        assert order.block_expert[start // block_m : start // block_m + blocks].tolist() == [expert] * blocks
        start += blocks * block_m
        assert order.group_ends[expert].item() == start
    assert rows[start:] == [pairs] * (len(rows) - start)
    assert order.block_expert[start // block_m :].tolist() == [-1] * ((len(rows) - start) // block_m)


def _moe_spec(**changes: object) -> MoeSpec:
    fields = dict(num_experts=8, ffn_hidden_size=48, topk=2, moe_layers=(True,), renormalize=True, aux_loss_coeff=0.0)
    return MoeSpec(**(fields | changes))  # type: ignore[arg-type]


@pytest.mark.parametrize("kernel", ["exact", *FAST])
def test_expert_tensor_parallel_halves_sum_to_the_whole_experts(kernel):
    """Two ranks, each with half of every expert's width (its gate and up columns and their biases, its input
    columns of down), summed, equal the whole experts; the down bias counts once (`adds_down_bias` on the first
    rank), and twice where both ranks add it."""
    moe = _moe_spec(expert_mlp_bias=True, swiglu_limit=0.5)
    x, gate_up, down, gate_up_bias, down_bias, weights, chosen = _case(*CASES["decode"])
    device = _device(kernel)
    x, weights, chosen = x.to(device), weights.to(device), chosen.to(device)
    whole = Experts(moe, 48, 64, torch.float32, device, kernel)
    for name, value in (("gate_up_proj", gate_up), ("down_proj", down)):
        getattr(whole, name).data.copy_(value)
    whole.gate_up_proj_bias.data.copy_(gate_up_bias)
    whole.down_proj_bias.data.copy_(down_bias)
    ranks = []
    for rank in range(2):
        cols = slice(24 * rank, 24 * (rank + 1))
        part = Experts(moe, 24, 64, torch.float32, device, kernel, adds_down_bias=rank == 0)
        part.gate_up_proj.data.copy_(torch.cat((gate_up[:, :48][:, cols], gate_up[:, 48:][:, cols]), dim=1))
        part.gate_up_proj_bias.data.copy_(torch.cat((gate_up_bias[:, :48][:, cols], gate_up_bias[:, 48:][:, cols]), 1))
        part.down_proj.data.copy_(down[:, :, cols])
        part.down_proj_bias.data.copy_(down_bias)
        ranks.append(part)
    expected = whole(x, weights, chosen)
    summed = ranks[0](x, weights, chosen) + ranks[1](x, weights, chosen)
    torch.testing.assert_close(summed, expected, rtol=1e-5, atol=1e-5)
    ranks[1].adds_down_bias = True
    twice = ranks[0](x, weights, chosen) + ranks[1](x, weights, chosen)
    once_more = (weights[..., None] * down_bias.to(device)[chosen]).sum(1)
    torch.testing.assert_close(twice - summed, once_more, rtol=1e-4, atol=1e-4)


def _meta_decode_step(spec, moe_kernel: str, rows: int, moe_sort: str = "torch") -> torch.Tensor:
    """Logits of one decode step of `rows` sequences of a model whose weights, cache and inputs are meta tensors."""
    model = CausalLM(spec, torch.bfloat16, "meta", 64, decode_kernel="gather", moe_kernel=moe_kernel, moe_sort=moe_sort)
    planes, heads, width = model.cache_entry
    cache = torch.empty(spec.num_layers, planes, 10, 4, heads, width, dtype=torch.bfloat16, device="meta")
    meta = DecodeMetadata(
        slot_mapping=torch.empty(rows, dtype=torch.int64, device="meta"),
        block_tables=torch.empty(rows, 3, dtype=torch.int64, device="meta"),
        context_lens=torch.empty(rows, dtype=torch.int64, device="meta"),
    )
    ids = torch.empty(rows, dtype=torch.int64, device="meta")
    return model(ids, torch.empty(rows, dtype=torch.int64, device="meta"), cache, meta)


META_MODELS = [*MOE_CONFIGS, "deepseek_v3"]


def _spec(name: str):
    return read_spec(tiny_config("DeepseekV3ForCausalLM") if name == "deepseek_v3" else MOE_CONFIGS[name]())


@pytest.mark.parametrize("name", META_MODELS)
def test_a_fast_moe_decode_step_needs_no_host_values(name, monkeypatch):
    """Meta tensors carry shapes and no values: a host sync (`.item()`, `.tolist()`, a count sized on the host)
    or a shape that depends on values cannot run on them. The whole decode step (routing, sort, grouped GEMMs,
    shared experts) runs with `grouped_mm`; with `triton` too, the kernel launches (which need real memory)
    recorded instead, each over a grid fixed by the number of pairs. The exact path fails on them."""
    spec = _spec(name)
    assert spec.moe is not None
    assert _meta_decode_step(spec, "grouped_mm", rows=5).shape == (5, spec.vocab_size)
    grids = []

    def record(a, b, bias, out, weights, order, tiles, a_div, n, k, activation):
        assert order.sorted_pairs.device.type == "meta" and out.device.type == "meta"
        grids.append((order.block_expert.numel(), -(-n // tiles.block_n)))

    monkeypatch.setattr(fused_moe, "grouped_gemm", record)
    assert _meta_decode_step(spec, "triton", rows=5).shape == (5, spec.vocab_size)
    pairs = 5 * spec.moe.topk
    tiles = fused_moe.default_tiles(pairs, spec.moe.num_experts, torch.bfloat16)
    blocks = sort_capacity(pairs, spec.moe.num_experts, tiles.block_m) // tiles.block_m
    assert len(grids) == 2 * sum(spec.moe.moe_layers) and {grid[0] for grid in grids} == {blocks}
    with pytest.raises(NotImplementedError):  # the exact path sizes each expert's rows on the host
        _meta_decode_step(spec, "exact", rows=5)


@pytest.mark.parametrize("name", META_MODELS)
def test_the_triton_sort_needs_no_host_values_either(name, monkeypatch):
    """As above with `moe_sort="triton"`: the sort's one launch a MoE layer recorded instead (it needs real
    memory), its outputs allocated on the device at sizes fixed by the number of pairs; through both fast kernels
    (the Triton GEMMs recorded too)."""
    spec = _spec(name)
    assert spec.moe is not None
    pairs, num_experts = 5 * spec.moe.topk, spec.moe.num_experts
    launches = []

    def record(flat, experts, order):
        assert flat.device.type == "meta" and order.sorted_pairs.device.type == "meta"
        shapes = tuple(t.shape[0] for t in (order.sorted_pairs, order.block_expert, order.group_ends))
        assert shapes == (sort_capacity(pairs, experts, order.block_m), shapes[0] // order.block_m, num_experts)
        launches.append((flat.numel(), experts, order.block_m))

    monkeypatch.setattr(expert_sort, "_launch", record)
    monkeypatch.setattr(fused_moe, "grouped_gemm", lambda *args: None)
    layers = sum(spec.moe.moe_layers)
    for kernel, block_m in (
        ("grouped_mm", fused_moe.GROUPED_MM_ALIGN),
        ("triton", fused_moe.INTERPRETER_TILES.block_m),
    ):
        launches.clear()
        assert _meta_decode_step(spec, kernel, rows=5, moe_sort="triton").shape == (5, spec.vocab_size)
        assert launches == [(pairs, num_experts, block_m)] * layers, kernel


def test_tiles_must_be_dot_sized_powers_of_two():
    Tiles(16, 32, 64)
    for bad in ((8, 32, 32), (16, 48, 32), (16, 32, 0)):
        with pytest.raises(ValueError, match="power of two"):
            Tiles(*bad)


def test_moe_kernel_choice_and_refusals(monkeypatch):
    assert EngineConfig(device="cpu").resolved_moe_kernel() == "exact"  # the exact path stays the CPU default
    assert EngineConfig(device="cpu", moe_kernel="grouped_mm").resolved_moe_kernel() == "grouped_mm"
    with pytest.raises(ValueError, match="moe_kernel must be one of auto, exact, triton, grouped_mm"):
        EngineConfig(moe_kernel="fused")
    with pytest.raises(ValueError, match="bfloat16"):
        check_usable("grouped_mm", torch.device("cuda"), torch.float32)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="interpreter"):
        check_usable("triton", torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="interpreter"):  # the engine checks its kernel when it is built
        Engine(MOE_CONFIGS["qwen3_moe"](), tiny_engine_config(moe_kernel="triton"))
    Engine(MOE_CONFIGS["qwen3_moe"](), tiny_engine_config(moe_kernel="grouped_mm"))
    monkeypatch.delattr(torch, "_grouped_mm")
    with pytest.raises(ValueError, match="_grouped_mm"):
        check_usable("grouped_mm", torch.device("cpu"), torch.float32)


def test_default_tiles_fit_an_sms_shared_memory(monkeypatch):
    """Outside the interpreter, for decode and prefill batches in bf16 and float32: the tile's pipelined operands
    (per stage the A rows and the gate and up weight tiles) fit the 227 KiB of shared memory a Hopper block may use,
    and decode takes the smallest row block."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for dtype in (torch.bfloat16, torch.float32):
        for pairs in (512, 65536):
            tiles = fused_moe.default_tiles(pairs, 128, dtype)
            per_stage = (tiles.block_m * tiles.block_k + 2 * tiles.block_k * tiles.block_n) * dtype.itemsize
            assert tiles.num_stages * per_stage <= 227 * 1024, (dtype, pairs, tiles)
    assert fused_moe.default_tiles(512, 128).block_m == 16 < fused_moe.default_tiles(65536, 128).block_m


def test_what_the_fast_path_refuses(monkeypatch):
    """An unknown kernel name (the engine's config, the experts module, the usability check), Triton missing, and
    operands whose rows are not contiguous (the kernel reads them as such)."""
    with pytest.raises(ValueError, match="moe_kernel must be one of"):
        Experts(_moe_spec(), 48, 64, torch.float32, "cpu", "fused")
    with pytest.raises(ValueError, match="moe_kernel must be one of"):
        check_usable("fused", torch.device("cpu"), torch.float32)
    x, gate_up, down, _, _, weights, chosen = _case(*CASES["decode"])
    with pytest.raises(ValueError, match="contiguous rows"):
        fused_experts(x, gate_up.transpose(1, 2).contiguous().transpose(1, 2), down, weights, chosen)
    monkeypatch.setattr(fused_moe, "triton_available", lambda: False)
    with pytest.raises(ValueError, match="needs Triton"):
        check_usable("triton", torch.device("cuda"), torch.bfloat16)
