"""The experts as torch grouped GEMMs on megatron-core's local spec (`grouped_experts`).

References: per-expert products written here (the autograd function, forward and backward), megatron-core's own
`SequentialMLP` (the module, at expert tensor parallelism 2: each rank's column and row shards), and a whole tiny
Qwen3-MoE `GPTModel` built by the project's layer spec with `moe_grouped_gemm` off (logits and every gradient).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_mcore_bridge.convert.layout import Layout
from hf_mcore_bridge.megatron.world import run_world

pytest.importorskip("megatron.core")

ROWS = (3, 0, 5, 2)
"""Rows per local expert: one expert gets none; `GroupedExperts` places each group at a multiple of 16 bytes."""
GEMM_ROWS = (8, 0, 16, 8)
"""Rows per expert given to `GroupedGemm` itself: groups of whole 16-byte multiples, as it takes them."""


def _per_expert(x: torch.Tensor, weights: list[torch.Tensor], rows: tuple[int, ...]) -> torch.Tensor:
    return torch.cat([part @ w.t() for part, w in zip(x.split(list(rows)), weights, strict=True)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemm_matches_per_expert_products_forward_and_backward(dtype):
    from hf_mcore_bridge.megatron.grouped_experts import GroupedGemm

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(sum(GEMM_ROWS), 32, generator=gen).to(dtype)
    weights = [torch.randn(16, 32, generator=gen).to(dtype) for _ in GEMM_ROWS]
    grad = torch.randn(sum(GEMM_ROWS), 16, generator=gen).to(dtype)
    offsets = torch.cumsum(torch.tensor(GEMM_ROWS), 0).to(torch.int32)

    ours = [t.clone().requires_grad_() for t in (x, *weights)]
    out = GroupedGemm.apply(ours[0], offsets, *ours[1:])
    out.backward(grad)
    ref = [t.clone().requires_grad_() for t in (x, *weights)]
    expected = _per_expert(ref[0], ref[1:], GEMM_ROWS)
    expected.backward(grad)

    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(out, expected, **tol)
    for got, want in zip(ours, ref, strict=True):
        torch.testing.assert_close(got.grad, want.grad, **tol)
    assert ours[2].grad.abs().max() == 0  # the expert without rows gets a zero gradient


def test_aligned_rows_start_every_group_at_a_multiple_of_the_alignment():
    """Each row's place, written here with a loop: expert e's rows follow the groups before it, each rounded up to
    the alignment; the last group ends at the buffer's end (its slack: zero rows)."""
    from hf_mcore_bridge.megatron.grouped_experts import aligned_rows

    counts, align = (3, 0, 5, 8, 1), 4
    dest, ends, capacity = aligned_rows(torch.tensor(counts), sum(counts), align)
    places, start = [], 0
    for count in counts:
        places += range(start, start + count)
        start += -(-count // align) * align
    assert dest.tolist() == places
    assert capacity == -(-(sum(counts) + len(counts) * (align - 1)) // align) * align == 32
    assert ends.tolist() == [4, 4, 12, 20, 32] and ends.dtype == torch.int32


def test_use_grouped_experts_rewrites_both_spec_styles():
    """megatron-core 0.16's `ModuleSpec`s and later versions' builders (`functools.partial`), as their local specs
    name a MoE layer's experts."""
    import functools

    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    from hf_mcore_bridge.megatron.grouped_experts import GroupedExperts, use_grouped_experts

    linears = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    old = MoESubmodules(experts=ModuleSpec(module=SequentialMLP, submodules=linears))
    new = MoESubmodules(experts=functools.partial(SequentialMLP, submodules=linears))
    layers = [ModuleSpec(module=MoELayer, submodules=old), functools.partial(MoELayer, submodules=new)]
    block = type(
        "Block", (), {"layer_specs": [type("Layer", (), {"submodules": type("S", (), {"mlp": m})})() for m in layers]}
    )
    use_grouped_experts(block)
    assert old.experts.module is GroupedExperts and old.experts.submodules is linears
    assert new.experts.func is GroupedExperts and new.experts.keywords == {"submodules": linears}


def test_experts_it_does_not_cover_are_named():
    """Experts the grouped GEMMs do not cover run `SequentialMLP`'s forward; `grouped_supported` names why."""
    from hf_mcore_bridge.megatron.grouped_experts import grouped_supported

    def expert(bias: bool = False, width: int = 48) -> torch.nn.Module:
        module = torch.nn.Module()
        module.linear_fc1 = torch.nn.Linear(64, 2 * width, bias=bias)
        module.linear_fc2 = torch.nn.Linear(width, 64, bias=bias)
        return module

    config = _config(Layout())
    assert grouped_supported(config, expert()) is None
    assert grouped_supported(config, expert(bias=True)) == "biased experts"
    assert grouped_supported(config, expert(width=42)).startswith("expert widths (84, 64) / (64, 42)")
    assert grouped_supported(_config(Layout(), activation_func_clamp_value=7.0), expert()) == (
        "a clamped or offset gated activation"
    )
    assert grouped_supported(_config(Layout(), gated_linear_unit=False), expert()) == "an activation other than SwiGLU"


def _config(layout: Layout, **changes: object):
    from megatron.core.transformer import TransformerConfig

    fields = dict(
        num_layers=1,
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=64,
        moe_ffn_hidden_size=48,
        num_moe_experts=len(ROWS),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        bias_activation_fusion=False,
        use_cpu_initialization=True,
        tensor_model_parallel_size=layout.tp,
        expert_tensor_parallel_size=layout.expert_tp,
    )
    return TransformerConfig(**{**fields, **changes})


def _module_pair(config) -> tuple[torch.nn.Module, torch.nn.Module]:
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP

    from hf_mcore_bridge.megatron.grouped_experts import GroupedExperts

    groups = ProcessGroupCollection.use_mpu_process_groups()
    submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    torch.manual_seed(1)
    reference = SequentialMLP(len(ROWS), config, submodules, groups)
    grouped = GroupedExperts(len(ROWS), config, submodules, groups)
    grouped.load_state_dict(reference.state_dict())
    return reference, grouped


def _run(module: torch.nn.Module, x: torch.Tensor, probs: torch.Tensor, grad: torch.Tensor):
    x = x.clone().requires_grad_()
    out, bias = module(x, torch.tensor(ROWS), probs)
    assert bias is None
    out.backward(grad)
    return out.detach(), x.grad, {name: p.grad for name, p in module.named_parameters()}


def _modules_rank() -> None:
    """Each rank: its shards of the experts (fc1 columns, fc2 rows at expert TP 2) through `SequentialMLP` and
    `GroupedExperts`, the same weights, rows, probabilities and output gradient."""
    layout = Layout(tp=2)
    gen = torch.Generator().manual_seed(2)
    x, probs = torch.randn(10, 64, generator=gen), torch.rand(10, generator=gen)
    grad = torch.randn(10, 64, generator=gen)
    reference, grouped = _module_pair(_config(layout))
    assert grouped.unsupported is None
    assert grouped.local_experts[0].linear_fc2.weight.shape == (64, 24)  # a row shard: expert TP is on
    for got, want in zip(_run(grouped, x, probs, grad), _run(reference, x, probs, grad), strict=True):
        if isinstance(want, dict):
            assert got.keys() == want.keys()
            for name in want:
                torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5, msg=name)
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _models_rank(architecture: str = "Qwen3MoeForCausalLM", sequence_parallel: bool = True) -> None:
    """A whole tiny MoE `GPTModel` (Qwen3-MoE; Qwen3.5 MoE, whose hybrid spec takes no sequence parallelism) from
    the project's layer spec, with and without `moe_grouped_gemm`: the experts' module, the parameter names, the
    logits and every gradient."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    from hf_mcore_bridge.convert.config_bridge import transformer_config_kwargs
    from hf_mcore_bridge.megatron.grouped_experts import GroupedExperts
    from hf_mcore_bridge.megatron.model import gpt_model, transformer_config
    from hf_mcore_bridge.models.spec import ModelSpec
    from hf_mcore_bridge.models.tiny_models import tiny_config

    spec = ModelSpec.from_hf(tiny_config(architecture))
    models = []
    for grouped in (False, True):
        kwargs = transformer_config_kwargs(spec, Layout(tp=2 if sequence_parallel else 1), torch.float32)
        kwargs.update(use_cpu_initialization=True, sequence_parallel=sequence_parallel, moe_grouped_gemm=grouped)
        torch.manual_seed(3)
        models.append(gpt_model(transformer_config(kwargs), spec, -(-spec.vocab_size // 128) * 128))
    reference, ours = models
    ours.load_state_dict(reference.state_dict())
    experts = {type(m) for m in ours.modules() if isinstance(m, SequentialMLP)}
    assert experts == {GroupedExperts} and {type(m) for m in reference.modules() if isinstance(m, SequentialMLP)} == {
        SequentialMLP
    }
    assert all(m.unsupported is None for m in ours.modules() if isinstance(m, GroupedExperts))
    tokens = torch.randint(0, spec.vocab_size, (2, 12), generator=torch.Generator().manual_seed(4))
    positions = torch.arange(12).expand(2, 12)
    outputs = []
    for model in models:
        logits = model(tokens, positions, attention_mask=None)
        logits.float().pow(2).mean().backward()
        outputs.append((logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (want, want_grads), (got, got_grads) = outputs
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert got_grads.keys() == want_grads.keys()
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def _both_ranks() -> None:
    _modules_rank()
    _models_rank()


@pytest.mark.slow
def test_grouped_experts_equal_sequential_mlp_at_expert_tp2_and_in_a_whole_model():
    run_world(_both_ranks, Layout(tp=2))


def _hybrid_rank() -> None:
    _models_rank("Qwen3_5MoeForCausalLM", sequence_parallel=False)


@pytest.mark.slow
def test_grouped_experts_in_a_hybrid_gated_delta_net_model():
    """Qwen3.5 MoE's hybrid spec (Gated DeltaNet layers beside gated attention) takes the grouped experts too; one
    rank: megatron-core refuses MoE under TP without sequence parallelism, which Gated DeltaNet layers do not take."""
    run_world(_hybrid_rank, Layout())


def _cuda_rank() -> None:
    """On the GPU, in bf16, through megatron-core's fused weighted SwiGLU (`bias_activation_fusion`, as the trainer
    runs): `GroupedExperts` against `SequentialMLP`, 128 experts of Qwen3-30B-A3B's width at 4096 routed rows."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP

    from hf_mcore_bridge.megatron.grouped_experts import GroupedExperts

    experts, hidden, width, rows = 16, 2048, 768, 4096
    config = _config(
        Layout(),
        hidden_size=hidden,
        num_attention_heads=32,
        ffn_hidden_size=width,
        moe_ffn_hidden_size=width,
        num_moe_experts=experts,
        bias_activation_fusion=True,
        bf16=True,
        params_dtype=torch.bfloat16,
    )
    groups = ProcessGroupCollection.use_mpu_process_groups()
    submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    reference = SequentialMLP(experts, config, submodules, groups).cuda()
    grouped = GroupedExperts(experts, config, submodules, groups).cuda()
    grouped.load_state_dict(reference.state_dict())
    gen = torch.Generator().manual_seed(5)
    counts = torch.multinomial(torch.ones(experts), rows, replacement=True, generator=gen).bincount(minlength=experts)
    x = torch.randn(rows, hidden, generator=gen).to("cuda", torch.bfloat16)
    probs = torch.rand(rows, generator=gen).cuda()
    grad = torch.randn(rows, hidden, generator=gen).to("cuda", torch.bfloat16)
    results = []
    for module in (reference, grouped):
        xi = x.clone().requires_grad_()
        out, _ = module(xi, counts, probs)
        out.backward(grad)
        results.append((out.float(), xi.grad.float(), [p.grad.float() for p in module.parameters()]))
    (want, want_dx, want_dw), (got, got_dx, got_dw) = results
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got_dx, want_dx, rtol=2e-2, atol=2e-2)
    for g, w in zip(got_dw, want_dw, strict=True):
        torch.testing.assert_close(g, w, rtol=2e-2, atol=5e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_grouped_experts_equal_sequential_mlp_in_bf16_on_cuda():
    run_world(_cuda_rank, Layout())
