"""Grouped-GEMM experts for megatron-core's local layer spec, through `torch._grouped_mm` (no Transformer Engine).

megatron-core's local spec runs a MoE layer's experts as `SequentialMLP` (two GEMMs per local expert, after a host
sync for the per-expert row counts); its grouped-GEMM experts need Transformer Engine (`TEGroupedMLP`) or the
separately built `grouped_gemm` package (the legacy `GroupedMLP`, whose parameters are laid out differently).
`GroupedExperts` is `SequentialMLP` (same parameters, names, sharded state dict and checkpoints) whose forward runs
all local experts as two grouped GEMMs over the expert-sorted rows (`torch._grouped_mm` with on-device offsets):

- `GroupedGemm`, an autograd function: `out[rows of e] = x[rows of e] @ w_e^T` for the experts' weights `w_e` [N, K]
  stacked on the fly; its backward stacks them again rather than saving the stacked copy (so a layer's activations
  do not hold a second copy of its expert weights), and computes the input's gradient with a grouped GEMM and the
  weights' with the grouped GEMM over rows (`_grouped_mm` of two 2-D operands, offsets along the reduced dimension);
  each expert's gradient reaches its own parameter, so megatron-core's DDP hooks, expert-parallel gradient groups
  and optimizer see what they see under `SequentialMLP`.
- the activation between them is the expert MLP's: SwiGLU weighted by the routing probabilities, through
  megatron-core's own fused `weighted_bias_swiglu_impl` where `bias_activation_fusion` is on, else in torch as its
  `MLP` does (silu(gate) * up, times the probabilities, in the input's dtype).

LoRA adapters on the experts (`megatron.lora`: a `lora` holder on each expert's `linear_fc1` / `linear_fc2`, whose
forward hook `SequentialMLP`'s forward would fire) are added here as two more grouped GEMMs per linear:
s * (x A_e^T) B_e^T over each expert's rows, A_e [rank, in] and B_e [out, rank]; where the rank's rows are not
16-byte multiples the experts run `SequentialMLP`'s forward (and the hooks) instead.

Under expert tensor parallelism each rank holds column shards of fc1 and row shards of fc2 and megatron-core leaves
the reduction to the token dispatcher, so the local grouped GEMMs compute exactly what the local `SequentialMLP` does;
the adapters' rank-r activations are reduced over the expert tensor-parallel group as on `SequentialMLP`
(`megatron.lora_expert_tp`).

Experts this does not cover run `SequentialMLP`'s own forward (`grouped_supported` says why): biased experts,
GPT-OSS's clamped activation, activations other than SwiGLU, FP8 / FP4, probabilities applied on the input, widths
whose rows are not 16-byte multiples, a torch without `_grouped_mm`. `use_grouped_experts` puts the module into a
local spec where the config asks for grouped GEMM (`moe_grouped_gemm`, which on the local spec would otherwise
build the legacy `GroupedMLP`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.experts import SequentialMLP

ALIGN_BYTES = 16
"""`torch._grouped_mm` needs every row stride a multiple of 16 bytes and, on CUDA, for the weight gradient's 2-D x 2-D
product, every group's row count too: each expert's rows are placed from a multiple of it (`aligned_rows`)."""


def grouped_mm_available() -> bool:
    """Whether this torch has `torch._grouped_mm`."""
    return hasattr(torch, "_grouped_mm")


def aligned_rows(counts: torch.Tensor, rows: int, align: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Where the `rows` expert-sorted rows go when each expert's group starts at a multiple of `align` rows.

    `counts` [E]: rows per expert (on the rows' device). Returns `dest` [rows] (each row's place), the groups' ends
    [E] (int32, cumulative; the last group also takes the buffer's slack, zero rows) and the buffer's row count
    `rows + E * (align - 1)` rounded up to `align`: a bound known without reading `counts` on the host. Every group
    then holds a multiple of `align` rows, as `torch._grouped_mm` needs on CUDA (16 bytes of the reduced dimension
    per group in the weight gradient's product)."""
    experts = counts.numel()
    padded = (counts + align - 1) // align * align
    ends = torch.cumsum(padded, 0)
    capacity = -(-(rows + experts * (align - 1)) // align) * align
    expert_of_row = torch.repeat_interleave(torch.arange(experts, device=counts.device), counts, output_size=rows)
    shift = (ends - padded) - (torch.cumsum(counts, 0) - counts)  # padded start - packed start, per expert
    dest = torch.arange(rows, device=counts.device) + shift[expert_of_row]
    ends = torch.cat((ends[:-1], ends.new_full((1,), capacity)))
    return dest, ends.to(torch.int32), capacity


class GroupedGemm(torch.autograd.Function):
    """`out` [T, N]: for each expert e, its rows of `x` [T, K] (rows `offsets[e-1]:offsets[e]`, cumulative int32
    `offsets` [E] on `x`'s device, the last one T) times `weights[e]` [N, K] transposed. On CUDA each group's rows
    must be a multiple of 16 bytes of `x`'s dtype (`aligned_rows`)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, offsets: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, offsets, *weights)
        return torch._grouped_mm(x, torch.stack(weights).transpose(1, 2), offs=offsets)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, offsets, *weights = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = torch._grouped_mm(grad, torch.stack(weights), offs=offsets)
        grad_weights: tuple[torch.Tensor | None, ...] = (None,) * len(weights)
        if any(ctx.needs_input_grad[2:]):
            # [E, N, K]: per expert, its grad rows^T @ its x rows
            stacked = torch._grouped_mm(grad.t().contiguous(), x, offs=offsets)
            grad_weights = tuple(stacked.unbind(0))
        return (grad_x, None, *grad_weights)


def grouped_supported(config: Any, expert: torch.nn.Module) -> str | None:
    """None where `GroupedExperts` can run these experts as grouped GEMMs, else why not (one phrase)."""
    if not grouped_mm_available():
        return f"torch {torch.__version__} has no torch._grouped_mm"
    if not (config.gated_linear_unit and config.activation_func is F.silu):
        return "an activation other than SwiGLU"
    if getattr(config, "activation_func_clamp_value", None) is not None or getattr(config, "glu_linear_offset", 0):
        return "a clamped or offset gated activation"
    if expert.linear_fc1.bias is not None or expert.linear_fc2.bias is not None:
        return "biased experts"
    if config.fp8 or getattr(config, "fp4", None):
        return "FP8 / FP4 experts"
    if config.moe_apply_probs_on_input or getattr(config, "use_te_activation_func", False):
        return "probabilities applied on the input, or Transformer Engine's activation"
    fc1, fc2 = expert.linear_fc1.weight, expert.linear_fc2.weight
    if any((dim * fc1.element_size()) % ALIGN_BYTES for dim in (*fc1.shape, *fc2.shape)):
        return f"expert widths {tuple(fc1.shape)} / {tuple(fc2.shape)} not multiples of {ALIGN_BYTES} bytes"
    return None


class GroupedExperts(SequentialMLP):
    """`SequentialMLP` whose forward runs the local experts as two grouped GEMMs where `grouped_supported`."""

    def __init__(self, num_local_experts: int, config: Any, submodules: MLPSubmodules, *args: Any, **kwargs: Any):
        super().__init__(num_local_experts, config, submodules, *args, **kwargs)
        self.unsupported = grouped_supported(self.config, self.local_experts[0])
        """Why these experts run `SequentialMLP`'s forward instead (None: they run as grouped GEMMs)."""

    def forward(
        self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor, permuted_probs: torch.Tensor
    ) -> tuple[torch.Tensor, None]:
        if self.sequential_reason() is not None:
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        fc1_adapters, fc2_adapters = self._adapters("linear_fc1"), self._adapters("linear_fc2")
        x = permuted_local_hidden_states
        counts = tokens_per_expert.to(device=x.device, dtype=torch.int64)
        dest, offsets, capacity = aligned_rows(counts, x.shape[0], ALIGN_BYTES // x.element_size())
        # each expert's rows from a multiple of the alignment on; the zero rows between groups add nothing
        padded = x.new_zeros(capacity, x.shape[1]).index_copy(0, dest, x)
        probs = permuted_probs.new_zeros(capacity).index_copy(0, dest, permuted_probs)
        fc1 = GroupedGemm.apply(padded, offsets, *(expert.linear_fc1.weight for expert in self.local_experts))
        if fc1_adapters:
            fc1 = fc1 + _lora_delta(padded, offsets, fc1_adapters).to(fc1.dtype)
        hidden = self._weighted_swiglu(fc1, probs)
        out = GroupedGemm.apply(hidden, offsets, *(expert.linear_fc2.weight for expert in self.local_experts))
        if fc2_adapters:
            out = out + _lora_delta(hidden, offsets, fc2_adapters).to(out.dtype)
        return out.index_select(0, dest), None

    def sequential_reason(self) -> str | None:
        """Why the forward runs `SequentialMLP`'s (None: grouped GEMMs): `unsupported`, or LoRA adapters whose rank
        is not a multiple of 16 bytes (the rank-r activation's rows)."""
        if self.unsupported is not None:
            return self.unsupported
        for linear in ("linear_fc1", "linear_fc2"):
            holders = self._adapters(linear)
            a = holders[0].lora_a[0] if holders else None
            if a is not None and (a.shape[0] * a.element_size()) % ALIGN_BYTES:
                return f"LoRA rank {a.shape[0]} not a multiple of {ALIGN_BYTES} bytes"
        return None

    def _adapters(self, linear: str) -> list[Any] | None:
        """The LoRA holders (`megatron.lora.LinearAdapters`) of every local expert's `linear`; None without."""
        holders = [getattr(getattr(expert, linear), "lora", None) for expert in self.local_experts]
        return holders if all(h is not None for h in holders) else None

    def _weighted_swiglu(self, fc1: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """What megatron-core's expert `MLP` does between its two linear layers, with `per_token_scale=probs`."""
        if self.config.bias_activation_fusion:
            from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl

            return weighted_bias_swiglu_impl(
                fc1, None, probs.unsqueeze(-1), self.config.activation_func_fp8_input_store
            )
        gate, up = torch.chunk(fc1, 2, dim=-1)
        return (F.silu(gate) * up * probs.unsqueeze(-1)).to(fc1.dtype)


def _lora_delta(x: torch.Tensor, offsets: torch.Tensor, holders: list[Any]) -> torch.Tensor:
    """s * B_e A_e applied to each expert's rows of `x`: two grouped GEMMs through the rank-r activation, which
    under expert tensor parallelism is reduced over its group as `SequentialMLP`'s adapters reduce it
    (`megatron.lora_expert_tp`; every rank of the group holds the same rows in the same groups)."""
    from hf_mcore_bridge.megatron.lora_expert_tp import column_low, row_output
    from hf_mcore_bridge.models.parallel_style import Parallel

    first = holders[0]
    group, size = first.tp_group, first.tp[1]

    def low(v: torch.Tensor) -> torch.Tensor:
        return GroupedGemm.apply(v, offsets, *(holder.lora_a[0] for holder in holders))

    def up(v: torch.Tensor) -> torch.Tensor:
        return first.scale * GroupedGemm.apply(v, offsets, *(holder.lora_b[0] for holder in holders))

    if first.parallel is Parallel.ROW:
        return row_output(x, low, up, group, size)
    return up(column_low(x, low, group, size))


def use_grouped_experts(spec: Any) -> Any:
    """`spec` with the experts of every MoE layer as `GroupedExperts`, where the local spec built `SequentialMLP`
    or megatron-core's legacy `GroupedMLP` (given `SequentialMLP`'s submodules: the local column- and row-parallel
    linear layers). megatron-core 0.16 names the MoE layer and its experts by `ModuleSpec`s, later versions by
    builders (`functools.partial` of the class); both are rewritten."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.moe import experts as experts_module
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.spec_utils import ModuleSpec

    replaced = tuple(c for c in (SequentialMLP, getattr(experts_module, "GroupedMLP", None)) if c is not None)
    for layer in getattr(spec, "layer_specs", None) or [spec]:
        mlp = layer.submodules.mlp
        if isinstance(mlp, ModuleSpec) and mlp.module is MoELayer:
            moe = mlp.submodules
        elif isinstance(mlp, functools.partial) and mlp.func is MoELayer:  # megatron-core 0.17+: a builder
            moe = mlp.keywords["submodules"]
        else:
            continue
        experts = moe.experts
        if isinstance(experts, ModuleSpec) and experts.module in replaced:
            submodules = experts.submodules
            if not isinstance(submodules, MLPSubmodules):  # the legacy GroupedMLP has none
                submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
            moe.experts = ModuleSpec(module=GroupedExperts, submodules=submodules)
        elif isinstance(experts, functools.partial) and experts.func is SequentialMLP:
            moe.experts = functools.partial(GroupedExperts, *experts.args, **experts.keywords)
    return spec
