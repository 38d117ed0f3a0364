"""The sort by expert as one Triton kernel (`engine.expert_sort.sort_by_expert_triton`, here in Triton's interpreter)
against a reference written here with plain Python loops, field by field (`torch.equal`), and against the torch
sort (`sort_by_expert`): experts without pairs, more experts than pairs, one expert taking every pair, a single
expert, block_m 1, 4 and 16; one kernel launch, the torch sort above the kernel's size limits; the fast MoE paths
with the Triton sort against the exact path; the `moe_sort` choice and its refusals. Sizes stay small: the
interpreter's `tl.sort` costs seconds at a few hundred pairs. The GPU checks (decode sizes, graph capture) are in
`test_engine_gpu.py`."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import MOE_CONFIGS, engine_from_hf, hf_greedy, random_prompts, tiny_engine_config

from hf_mcore_bridge.engine import Engine, EngineConfig, SamplingParams, expert_sort, fused_moe
from hf_mcore_bridge.engine import engine as engine_module
from hf_mcore_bridge.engine.expert_sort import sort_by_expert, sort_by_expert_triton, sort_experts
from hf_mcore_bridge.engine.fused_moe import check_usable, fused_experts, grouped_mm_experts
from hf_mcore_bridge.engine.model import Experts, route, routed_experts
from hf_mcore_bridge.models.moe import MoeSpec

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
"""Compiled on a GPU, else in Triton's interpreter (see conftest)."""
FIELDS = ("sorted_pairs", "block_expert", "group_ends")


def reference_sort(experts: list[list[int]], num_experts: int, block_m: int) -> dict[str, torch.Tensor]:
    """The sort, pair by pair: each expert's pairs in their order from a multiple of `block_m`, its last block
    filled with padding (the value `pairs`), every block named by its expert; then padding up to the capacity
    (every pair plus `block_m - 1` rows per expert that can occur, in whole blocks), its blocks named -1."""
    flat = [expert for token in experts for expert in token]
    pairs = len(flat)
    rows: list[int] = []
    block_expert: list[int] = []
    group_ends: list[int] = []
    for expert in range(num_experts):
        mine = [pair for pair in range(pairs) if flat[pair] == expert]
        blocks = -(-len(mine) // block_m)
        rows += mine + [pairs] * (blocks * block_m - len(mine))
        block_expert += [expert] * blocks
        group_ends.append(len(rows))
    capacity = -(-(pairs + min(num_experts, pairs) * (block_m - 1)) // block_m) * block_m
    rows += [pairs] * (capacity - len(rows))
    block_expert += [-1] * (capacity // block_m - len(block_expert))
    return {
        "sorted_pairs": torch.tensor(rows, dtype=torch.int64),
        "block_expert": torch.tensor(block_expert, dtype=torch.int64),
        "group_ends": torch.tensor(group_ends, dtype=torch.int64),
    }


def _routing(tokens: int, top_k: int, num_experts: int, seed: int, avoid: tuple[int, ...] = ()) -> torch.Tensor:
    """[tokens, top_k] distinct experts per token, never one of `avoid`."""
    gen = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(num_experts) if e not in avoid])
    return torch.stack([allowed[torch.randperm(len(allowed), generator=gen)[:top_k]] for _ in range(tokens)])


ROUTINGS = {
    # tokens, top-k, experts, avoided experts: 27 pairs, expert 7 and 11 without pairs
    "some-empty": (lambda: _routing(9, 3, 12, seed=1, avoid=(7, 11)), 12),
    # 6 pairs over 40 experts (more than a warp's 32 histogram bins): most experts empty, capacity from the pairs
    "more-experts-than-pairs": (lambda: _routing(3, 2, 40, seed=2), 40),
    # every pair to expert 5, 16 pairs (a power of two: no padding lanes)
    "one-expert-takes-all": (lambda: torch.full((16, 1), 5, dtype=torch.int64), 8),
    "single-expert": (lambda: torch.zeros(5, 1, dtype=torch.int64), 1),
    "decode-like": (lambda: _routing(8, 8, 64, seed=3), 64),  # 64 pairs, top-8 of 64
}


@pytest.mark.parametrize("block_m", [1, 4, 16])
@pytest.mark.parametrize("routing", ROUTINGS)
def test_triton_sort_equals_a_loop_reference_and_the_torch_sort(routing, block_m):
    make, num_experts = ROUTINGS[routing]
    chosen = make()
    expected = reference_sort(chosen.tolist(), num_experts, block_m)
    got = sort_by_expert_triton(chosen.to(DEVICE), num_experts, block_m)
    torch_sort = sort_by_expert(chosen, num_experts, block_m)
    assert (got.num_pairs, got.block_m) == (chosen.numel(), block_m)
    for field in FIELDS:
        assert torch.equal(getattr(got, field).cpu(), expected[field]), field
        assert torch.equal(getattr(torch_sort, field), expected[field]), field


def test_the_triton_sort_is_one_launch_and_falls_back_above_its_limits(monkeypatch):
    """One launch of one program within the limits; above `MAX_SORT_PAIRS` or `MAX_SORT_EXPERTS` (each lowered
    here, alone, just below the case's size) no launch, the torch sort's result (equal to the reference)."""
    launches = []
    kernel = expert_sort._kernel()

    class Counting:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(expert_sort, "_kernel", Counting)
    chosen = _routing(4, 2, 5, seed=4)  # 8 pairs over 5 experts
    expected = reference_sort(chosen.tolist(), 5, 4)
    for max_pairs, max_experts, launched in ((8, 5, [(1,)]), (7, 5, []), (8, 4, [])):
        monkeypatch.setattr(expert_sort, "MAX_SORT_PAIRS", max_pairs)
        monkeypatch.setattr(expert_sort, "MAX_SORT_EXPERTS", max_experts)
        launches.clear()
        got = sort_by_expert_triton(chosen.to(DEVICE), 5, 4)
        assert launches == launched, (max_pairs, max_experts)
        assert all(torch.equal(getattr(got, f).cpu(), expected[f]) for f in FIELDS)


def _experts_case(tokens: int = 6, hidden: int = 64, width: int = 48, experts: int = 8, top_k: int = 2):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=gen)
    gate_up = 0.2 * torch.randn(experts, 2 * width, hidden, generator=gen)
    down = 0.2 * torch.randn(experts, hidden, width, generator=gen)
    biases = dict(
        gate_up_bias=0.5 * torch.randn(experts, 2 * width, generator=gen),
        down_bias=0.5 * torch.randn(experts, hidden, generator=gen),
    )
    weights, chosen = route(torch.randn(tokens, experts, generator=gen), top_k, renormalize=True)
    return (x, gate_up, down, weights, chosen), biases


@pytest.mark.parametrize("kernel", ["triton", "grouped_mm"])
def test_fast_paths_with_the_triton_sort_equal_the_exact_path(kernel):
    """Both fast paths sorting through the Triton kernel (grouped_mm on CPU: `torch._grouped_mm`'s loop), biased,
    against the exact per-expert loop in float32; the `Experts` module passes its `sort` on."""
    operands, biases = _experts_case()
    expected = routed_experts(*operands, **biases)
    device = DEVICE if kernel == "triton" else "cpu"
    moved = [t.to(device) for t in operands]
    fast = {"triton": fused_experts, "grouped_mm": grouped_mm_experts}[kernel]
    got = fast(*moved, **{k: v.to(device) for k, v in biases.items()}, sort="triton").cpu()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    moe = MoeSpec(num_experts=8, ffn_hidden_size=48, topk=2, moe_layers=(True,), renormalize=True, aux_loss_coeff=0.0)
    module = Experts(moe, 48, 64, torch.float32, device, kernel, sort="triton")
    module.gate_up_proj.data.copy_(operands[1])
    module.down_proj.data.copy_(operands[2])
    calls = []
    real = expert_sort.sort_by_expert_triton
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(expert_sort, "sort_by_expert_triton", lambda *a: calls.append(a) or real(*a))
        got = module(moved[0], moved[3], moved[4]).cpu()
    assert len(calls) == 1
    torch.testing.assert_close(got, routed_experts(*operands), rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_bad_moe_sort_values_are_refused_in_one_line(monkeypatch):
    """Every place that takes a sort names the choices in one line; the Triton sort needs Triton, and on CPU its
    interpreter, as the Triton kernel does."""
    message = "moe_sort must be one of torch, triton, got 'fast'"
    moe = MoeSpec(num_experts=8, ffn_hidden_size=48, topk=2, moe_layers=(True,), renormalize=True, aux_loss_coeff=0.0)
    with pytest.raises(ValueError) as err:
        EngineConfig(moe_sort="fast")
    assert str(err.value) == "moe_sort must be one of auto, torch, triton, got 'fast'"
    refusals = (
        lambda: Experts(moe, 48, 64, torch.float32, "cpu", "triton", sort="fast"),
        lambda: check_usable("grouped_mm", torch.device("cpu"), torch.float32, sort="fast"),
        lambda: sort_experts(torch.zeros(2, 1, dtype=torch.int64), 4, 4, "fast"),
    )
    for refuse in refusals:
        with pytest.raises(ValueError) as err:
            refuse()
        assert str(err.value) == message
    assert EngineConfig(device="cpu").resolved_moe_sort() == "torch"  # `auto`: the Triton sort on CUDA only
    assert EngineConfig(device="cpu", moe_sort="triton").resolved_moe_sort() == "triton"
    monkeypatch.setattr(engine_module, "triton_available", lambda: True)
    assert EngineConfig(device="cuda").resolved_moe_sort() == "triton"
    monkeypatch.setattr(engine_module, "triton_available", lambda: False)
    assert EngineConfig(device="cuda").resolved_moe_sort() == "torch"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="moe_sort triton runs on CUDA devices"):
        check_usable("grouped_mm", torch.device("cpu"), torch.float32, sort="triton")
    with pytest.raises(ValueError, match="moe_sort triton runs on CUDA"):  # the engine checks it when it is built
        Engine(MOE_CONFIGS["qwen3_moe"](), tiny_engine_config(moe_kernel="grouped_mm", moe_sort="triton"))
    check_usable("grouped_mm", torch.device("cpu"), torch.float32, sort="torch")
    monkeypatch.setattr(fused_moe, "triton_available", lambda: False)
    with pytest.raises(ValueError, match="moe_sort triton needs Triton"):
        check_usable("grouped_mm", torch.device("cuda"), torch.bfloat16, sort="triton")


def test_an_engine_with_the_triton_sort_generates_transformers_tokens(get_hf_model):
    """Qwen3-MoE's tiny model through `EngineConfig(moe_sort="triton")` (with `torch._grouped_mm`'s CPU loop, the
    cheaper fast kernel in the interpreter): every `Experts` module sorts through the kernel, prefill and decode
    give transformers' greedy tokens."""
    model = get_hf_model("qwen3_moe")
    engine = engine_from_hf(model, moe_kernel="grouped_mm", moe_sort="triton")
    assert {m.sort for m in engine.model.modules() if isinstance(m, Experts)} == {"triton"}
    prompt = random_prompts([7], seed=23)[0]
    (output,) = engine.generate([prompt], SamplingParams(n=1, temperature=0.0, max_tokens=4))
    assert output.samples[0].token_ids == hf_greedy(model, prompt, 4)
