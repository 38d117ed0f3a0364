"""LoRA adapters on megatron-core's tensor-parallel linears, one adapter per HF projection (1:1 with PEFT's).

A targeted projection W (out x in) computes W x + s B A x, s = alpha / rank. Where the adapters sit on a rank:

- column-parallel linear (q/k/v in the fused `linear_qkv`, gate/up in `linear_fc1`, any `Parallel.COLUMN` entry):
  A (rank x in) whole on every rank, as the base layer's input is; B split by output rows like the base weight,
  each rank holding the rows of its projection that its shard of the fused weight holds. Which local output row
  of the fused weight is which projection's row comes from the mapping table's own transform (`entry.to_mcore` on
  row indices, then `tensor_ops.rank_shard` in the entry's parallel style), so an adapter's rows are where
  megatron-core puts that projection's rows (per query group for q/k/v, [gate_r; up_r] for gate/up).
- row-parallel linear (`o_proj`, `down_proj`): A split by input columns like the base weight, B whole.

Communication: a replicated factor's gradient (A of a column-parallel linear, B of a row-parallel one) is a sum
over the tensor-parallel ranks. Rather than reduce those gradients after the backward, the rank-r activation is
reduced: for a column-parallel linear `copy_to_tensor_model_parallel_region` on A x (forward: nothing, backward:
an all-reduce of a [tokens, n * rank] gradient, n the projections fused there), for a row-parallel one
`reduce_from_tensor_model_parallel_region` on A_local x_local (forward: an all-reduce of [tokens, rank], backward:
nothing). That is rank / hidden of the base layer's own all-reduce, and every gradient is then complete on every
rank (replicated factors equal everywhere without a further reduction).

Sequence parallelism (`sequence_parallel` on the linear, dense linears only): a column-parallel input is this rank's
chunk of the sequence [s / tp, b, in] (dim 0, also for packed [t, 1, in] rows), which the base layer all-gathers;
the adapter computes A x on the chunk and `gather_from_sequence_parallel_region` gathers [s, b, n * rank] (backward:
a reduce-scatter) before B_local. A row-parallel output is reduce-scattered to [s / tp, b, out]: the adapter
reduce-scatters A_local x_local ([s, b, rank] partial sums, `reduce_scatter_to_sequence_parallel_region`, backward:
an all-gather) to [s / tp, b, rank] before B. Communication stays rank-sized; the replicated factors (A of a
column-parallel linear, B of a row-parallel one) then see this rank's tokens alone, so their gradients are partial
sums over TP: they are marked `sequence_parallel = True`, megatron-core's mark for its norms' weights, and
`finalize_model_grads` (the trainer's, after DDP's reduction, with or without the distributed optimizer) all-reduces
them over the tensor-parallel group. A plain backward without it leaves them partial. Routed experts' linears
exchange their tokens through the token dispatcher and are not sequence-split: their adapters are as without it.

Routed experts (`experts.gate_up_proj`, `experts.down_proj`, PEFT's `target_parameters`): one adapter per expert on
its `linear_fc1` (over the fused [gate; up] rows together, as PEFT's adapter of the fused `gate_up_proj`) or
`linear_fc2`, on the experts this rank holds (expert parallelism splits them, each rank keeping its own experts'
adapters, like their weights, marked as expert parameters for megatron-core's DDP and optimizer). Under expert tensor
parallelism (which must be 1 or the tensor parallelism: `ETP_RULE`, ValueError otherwise) they are split as the
expert's weights: B of `linear_fc1` by rows (each rank its [gate_r; up_r] of the fused rows), A of `linear_fc2` by
columns, the other factor whole; their rank-r activations are reduced over the expert tensor-parallel group under
the token dispatcher's conventions (`lora_expert_tp`: partial sums it adds up). An expert adapter's name is
`<fused HF tensor>[<global expert>]` (`model.layers.0.mlp.experts.gate_up_proj[3]`, `lora_experts`);
`full_adapters` gathers them over the expert tensor- and expert-parallel groups.
`SequentialMLP`'s experts add the product through the same forward hook as dense linears; `GroupedExperts` runs it
as two more grouped GEMMs per linear (`grouped_experts`).

Assumes and refuses: attention, dense MLP and routed-expert linears only (shared experts, multi-latent attention's
projections and the vocabulary layers are refused by name; so are the dense MLP names on a mixture-of-experts model,
which PEFT reads as the experts' there: `MLP_PROJECTIONS`). Dropout (`LoraConfig.dropout`) on each adapter's input in
training mode only, PEFT's semantics (`megatron.lora_dropout`: each projection of a fused linear its own mask; a
row-parallel input's mask cut from one of the whole width, a sequence-parallel column input's from one of the whole
sequence, alike on every tensor-parallel rank); not on experts' adapters (PEFT's
`target_parameters` adapters have none: ValueError). Every base parameter is frozen
(`requires_grad=False`): megatron-core's `DistributedDataParallel` and optimizer then hold the adapters alone.

Checkpoints: an adapted linear's sharded state dict holds its adapters beside its weight (`<linear>.lora.lora_a.<i>`,
`lora_b.<i>`), the split factor sharded on the axis it is split on, the replicated one replicated; so each adapter's
global tensor is PEFT's A or B of that projection (stacked over layers as the weight is), whatever the layout, and a
checkpoint reloads at any TP and PP (`checkpoint_adapters` reads them back by HF module name). An expert's adapters
go through megatron-core's `SequentialMLP` sharded state dict (which `GroupedExperts` keeps) beside the expert's
weights: on the global expert axis (`mlp.experts.experts.linear_fc1.lora.lora_a.0` [experts, rank, in]), so an
expert-parallel layout reloads at another; B of `linear_fc1` is stored as megatron-core stores the fused gate/up
weight (its gate half and up half sharded separately: `gate_up`), so its global tensor is PEFT's [gate; up] at any
expert tensor parallelism.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import MethodType
from typing import Any

import torch

from hf_mcore_bridge.megatron.lora_config import EXPERT_PROJECTIONS, LoraConfig
from hf_mcore_bridge.megatron.lora_experts import expert_name, expert_target, fused_expert_template, is_expert
from hf_mcore_bridge.models.mapping_types import Direct, Entry, FusedGateUp, FusedQKV, LayerKind
from hf_mcore_bridge.models.parallel_style import Parallel
from hf_mcore_bridge.models.spec import ModelSpec
from hf_mcore_bridge.models.tensor_ops import global_shape, rank_shard

__all__ = [
    "LinearAdapters",
    "adapted_weights",
    "adapter_modules",
    "add_lora",
    "full_adapters",
    "merged",
    "set_adapters",
    "targeted_entries",
]

LAYER_PREFIX = "decoder.layers.{layer}."
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
"""The dense MLP names of `PROJECTIONS`: on a mixture-of-experts model PEFT (transformers 5, peft 0.21's
`convert_peft_config_for_transformers`) turns them into `target_parameters` of the routed experts' fused tensors
(`gate_up_proj` at rank 2r) and adapts no dense MLP with them, so `add_lora` refuses them on such a model."""
_COLUMN_STYLES = (Parallel.COLUMN, Parallel.GATED_COLUMN)
ETP_RULE = (
    "expert tensor parallelism 1 or equal to the tensor parallelism: megatron-core's gradient norm counts a"
    " replicated expert factor on tensor-parallel rank 0, once per expert tensor-parallel group only where the two"
    " groups are the same ranks"
)


def projection(hf_name: str) -> str:
    """The HF projection of a weight's name: `model.layers.{layer}.self_attn.q_proj.weight` -> `q_proj`."""
    return hf_name.rsplit(".", 2)[-2]


class LinearAdapters(torch.nn.Module):
    """The adapters of one megatron-core linear: one (A, B) pair per HF projection it computes, this rank's parts.

    `names[i]` is the HF module name of pair i (`model.layers.0.self_attn.q_proj`, PEFT's without its prefix; an
    expert's: `expert_name`); `lora_a[i]` and `lora_b[i]` are its local A and B. `rows` (column-parallel only) maps
    the linear's local output rows to the rows of the adapters' concatenated outputs. `weights`: the HF weight names
    the linear's (merged) weight is streamed as. `expert`: the linear is a routed expert's (whole at expert tensor
    parallelism 1; its adapters are expert parameters)."""

    def __init__(
        self,
        names: tuple[str, ...],
        a: list[torch.Tensor],
        b: list[torch.Tensor],
        parallel: Parallel,
        rows: torch.Tensor | None,
        scale: float,
        tp_group: Any,
        weights: tuple[str, ...] = (),
        expert: bool = False,
        dropout: float = 0.0,
        tp: tuple[int, int] = (0, 1),
        sequence_parallel: bool = False,
        gate_up: bool = False,
    ) -> None:
        super().__init__()
        self.names = names
        self.weights = weights
        self.expert = expert
        self.gate_up = gate_up
        """One adapter over a fused [gate; up] weight (an expert's `linear_fc1`): each rank's rows of B are
        megatron-core's [gate_r; up_r] of it, stored in checkpoints as that weight is (gate half, up half)."""
        self.dropout = dropout
        """Dropout probability on each adapter's input in training mode (`megatron.lora_dropout`)."""
        self.tp = tp
        """(this rank, the tensor-parallel size): which columns of a whole-width mask a row-parallel input keeps."""
        self.parallel = parallel
        self.sequence_parallel = sequence_parallel
        """The linear runs under sequence parallelism: a column-parallel input (a row-parallel output) is this rank's
        chunk of the sequence (dim 0)."""
        self.scale = scale
        self.tp_group = tp_group
        self.lora_a = torch.nn.ParameterList([torch.nn.Parameter(t) for t in a])
        self.lora_b = torch.nn.ParameterList([torch.nn.Parameter(t) for t in b])
        self.register_buffer("rows", rows, persistent=False)
        self._identity: tuple[torch.Tensor | None, bool] = (None, False)
        """(the `rows` it was computed for, whether they are 0, 1, 2, ...: no reordering needed)."""
        _mark_split(self)

    def add_to(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """`out` + s * B A x for this rank: the local output rows of a column-parallel linear, or the whole
        (reduced) output of a row-parallel one; x: [..., in_local], under sequence parallelism [s / tp, b, in]
        (column-parallel) or [s, b, in / tp] (row-parallel), out: [..., out_local]. The rank-r product is added
        by one GEMM into `out` (`addmm`), so the adapters add no full-width pass over the output."""
        from megatron.core.tensor_parallel import (
            copy_to_tensor_model_parallel_region,
            gather_from_sequence_parallel_region,
            reduce_from_tensor_model_parallel_region,
            reduce_scatter_to_sequence_parallel_region,
        )

        linear = torch.nn.functional.linear
        if self.expert:  # the token dispatcher's conventions under expert tensor parallelism (`lora_expert_tp`)
            from hf_mcore_bridge.megatron.lora_expert_tp import column_low, row_output

            (a,), (b,) = self.lora_a, self.lora_b
            group, size = self.tp_group, self.tp[1]
            if self.parallel is Parallel.ROW:
                delta = row_output(x, lambda h: linear(h, a), lambda low: self.scale * linear(low, b), group, size)
            else:
                low = column_low(x, lambda v: linear(v, a), group, size)
                delta = (self.scale * linear(low, b)).index_select(-1, self.rows)
            return out + delta.to(out.dtype)
        if self.parallel is Parallel.ROW:
            (a,), (b,) = self.lora_a, self.lora_b
            low = linear(self._input(x), a)  # partial sums over this rank's input columns
            if self.sequence_parallel:  # [s, b, rank] -> this rank's [s / tp, b, rank], as the base output
                low = reduce_scatter_to_sequence_parallel_region(low, group=self.tp_group)
            else:
                low = reduce_from_tensor_model_parallel_region(low, group=self.tp_group)
        else:
            if self.dropout > 0 and self.training:  # PEFT: each projection drops its own mask of the shared input
                low = torch.cat([linear(self._input(x), a) for a in self.lora_a], dim=-1)
            else:
                low = linear(x, torch.cat(list(self.lora_a)))
            if self.sequence_parallel:  # [s / tp, b, n * rank] -> [s, b, n * rank], as the base layer gathers x
                low = gather_from_sequence_parallel_region(low, group=self.tp_group)
            else:
                low = copy_to_tensor_model_parallel_region(low, group=self.tp_group)
            b = self.output_b()
        flat = torch.addmm(
            out.reshape(-1, out.shape[-1]),
            low.reshape(-1, low.shape[-1]).to(out.dtype),
            b.to(out.dtype).t(),
            alpha=self.scale,
        )
        return flat.view(out.shape)

    def output_b(self) -> torch.Tensor:
        """A column-parallel linear's B of all its projections as one [out_local, n * rank] matrix: local output
        row i holds its projection's B row in that projection's rank columns (a block-diagonal B with its rows in
        the linear's local row order, `rows`)."""
        if len(self.lora_b) == 1:
            (b,) = self.lora_b
        else:
            b = torch.block_diag(*self.lora_b)
        if self._identity[0] is not self.rows:  # once per `rows` tensor (a comparison on the host)
            self._identity = (self.rows, torch.equal(self.rows.cpu(), torch.arange(len(self.rows))))
        return b if self._identity[1] else b.index_select(0, self.rows)

    def whole_keep_mask(self, x: torch.Tensor) -> torch.Tensor:
        """A dropout mask for the whole input of which `x` is this rank's part (all of it on a column-parallel
        linear, or under sequence parallelism its sequence chunk; a column block on a row-parallel one), drawn
        alike on every tensor-parallel rank."""
        from hf_mcore_bridge.megatron.lora_dropout import keep_mask

        shape = list(x.shape)
        if self.parallel is Parallel.ROW:
            shape[-1] *= self.tp[1]
        elif self.sequence_parallel:
            shape[0] *= self.tp[1]
        return keep_mask(tuple(shape), self.dropout, x)

    def _input(self, x: torch.Tensor) -> torch.Tensor:
        """The adapter's input: `x`, or in training mode with dropout `x` dropped by this rank's part of a mask."""
        if self.dropout == 0 or not self.training:
            return x
        from hf_mcore_bridge.megatron.lora_dropout import dropped

        mask = self.whole_keep_mask(x)
        rank = self.tp[0]
        if self.parallel is Parallel.ROW:
            width = x.shape[-1]
            mask = mask[..., rank * width : (rank + 1) * width]
        elif self.sequence_parallel:
            length = x.shape[0]
            mask = mask[rank * length : (rank + 1) * length]
        return dropped(x, mask, self.dropout)

    def weight_delta(self) -> torch.Tensor:
        """s * B A as this rank's part of the linear's weight (its local rows, or its local columns)."""
        if self.parallel is Parallel.ROW:
            (a,), (b,) = self.lora_a, self.lora_b
            return self.scale * (b @ a)
        parts = torch.cat([b @ a for a, b in zip(self.lora_a, self.lora_b, strict=True)])
        return self.scale * parts.index_select(0, self.rows)


def _mark_split(holder: LinearAdapters) -> None:
    """megatron-core's tensor-parallel attributes on each factor: the split ones (B of a column-parallel linear by
    rows, A of a row-parallel one by columns) counted on every rank, the replicated ones on TP rank 0 only, as its
    gradient norm (hence clipping) and checkpoints count a base layer's weight and its replicated norms. Under
    sequence parallelism the replicated factors see this rank's tokens alone: they are marked `sequence_parallel`,
    as megatron-core marks its norms' weights, so that `finalize_model_grads` sums their gradients over TP."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    row = holder.parallel is Parallel.ROW
    # an expert's factors: counted as megatron-core counts its experts' weights (tensor-parallel, of the expert
    # groups: `allreduce` False puts them in DDP's expert buffers, reduced over the expert-data group); under expert
    # tensor parallelism its replicated factor (A of fc1, B of fc2) as a replicated one, on TP rank 0 (expert
    # tensor parallelism equals tensor parallelism there: the groups are the same ranks)
    whole = holder.expert and holder.tp[1] == 1
    for a, b in zip(holder.lora_a, holder.lora_b, strict=True):
        set_tensor_model_parallel_attributes(a, is_parallel=row or whole, dim=1, stride=1)
        set_tensor_model_parallel_attributes(b, is_parallel=not row or whole, dim=0, stride=1)
        if holder.expert:
            a.allreduce = b.allreduce = False
        replicated = b if row else a
        replicated.sequence_parallel = holder.sequence_parallel


def _hook(linear: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    """Adds the adapters' product to a megatron-core linear's output `(output, bias)`."""
    x = args[0] if args else kwargs["input_"]
    out, bias = output
    return linear.lora.add_to(out, x), bias


def _sharded_state_dict(
    linear: torch.nn.Module, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
) -> dict[str, Any]:
    """megatron-core's sharded state dict of a column- or row-parallel linear (as its own method builds it) with
    its adapters' split factors sharded on their axis: B of a column-parallel linear by rows, A of a row-parallel
    one by columns. (megatron-core's method would mark them replicated, keeping TP rank 0's part alone.)"""
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

    holder = linear.lora
    if holder.parallel is Parallel.ROW:
        axes = {"weight": 1, "lora.lora_a.0": 1}
    else:
        axes = {"weight": 0, "bias": 0, **{f"lora.lora_b.{i}": 0 for i in range(len(holder.lora_b))}}
    state = make_sharded_tensors_for_checkpoint(
        linear.state_dict(prefix="", keep_vars=True),
        prefix,
        axes,
        sharded_offsets,
        tp_group=linear.tp_group,
        dp_cp_group=ensure_metadata_has_dp_cp_group(metadata)["dp_cp_group"],
    )
    if holder.gate_up:  # B's local rows are [gate_r; up_r]: stored as megatron-core stores the fused weight's
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

        key = f"{prefix}lora.lora_b.0"
        singleton = (metadata or {}).get("singleton_local_shards", False)
        state[key] = apply_swiglu_sharded_factory(state[key], sharded_offsets, singleton)
    return state


def targeted_entries(model_cfg: ModelSpec, lora: LoraConfig) -> Iterator[Entry]:
    """The table's per-layer linear entries with at least one targeted projection; others are refused by name.
    `PROJECTIONS` names match dense linears only; routed experts' linears are targeted by `EXPERT_PROJECTIONS`."""
    for entry in model_cfg.table():
        if not entry.mcore.startswith(LAYER_PREFIX) or not entry.mcore.endswith(".weight"):
            continue
        if is_expert(entry):
            target = expert_target(entry)
            if target is not None and target in lora.target_modules:
                fused_expert_template(entry, model_cfg)
                yield entry
            continue
        hit = [projection(s) for s in entry.hf_sources if projection(s) in lora.target_modules]
        if not hit:
            continue
        what = f"LoRA on {', '.join(entry.hf_sources)} ({entry.mcore})"
        if ".shared_experts." in entry.mcore:
            raise ValueError(f"{what}: adapters on shared experts are not implemented")
        if not isinstance(entry, Direct | FusedQKV | FusedGateUp) or entry.parallel not in (
            *_COLUMN_STYLES,
            Parallel.ROW,
        ):
            raise ValueError(f"{what}: only dense column- and row-parallel linears take adapters")
        if len(hit) != len(entry.hf_sources):
            raise ValueError(
                f"{what}: target all of {[projection(s) for s in entry.hf_sources]} or none (they share one"
                " megatron-core linear; targeting part of them is not implemented)"
            )
        yield entry


def initial_a(name: str, shape: tuple[int, int], lora: LoraConfig) -> torch.Tensor:
    """A's whole initial value, the same on every rank: seeded by `lora.seed` and the adapter's name."""
    generator = torch.Generator().manual_seed(lora.seed * 1_000_003 + zlib.crc32(name.encode()))
    a = torch.empty(shape)
    if lora.init == "gaussian":
        return a.normal_(0.0, 1.0 / lora.rank, generator=generator)
    bound = 1.0 / math.sqrt(shape[1])  # kaiming_uniform_(a=sqrt(5)): gain sqrt(1/3), bound gain * sqrt(3 / fan_in)
    return a.uniform_(-bound, bound, generator=generator)


def column_rows(entry: Entry, out_rows: Mapping[str, int], dims: Any, tp: int, rank: int) -> torch.Tensor:
    """For a column-parallel entry: each local output row's index into the concatenation of its projections'
    local rows (projection order `entry.hf_sources`, each rank holding the `rank`-th of `tp` equal row chunks of
    each). ValueError: a layout where some rank's rows of a projection are not one such chunk."""
    offsets, start = {}, 0
    for source in entry.hf_sources:
        offsets[source], start = start, start + out_rows[source]
    coded = {s: (offsets[s] + torch.arange(out_rows[s]))[:, None] for s in entry.hf_sources}
    local = rank_shard(entry.to_mcore(coded, dims), entry.parallel, tp, rank)[:, 0]
    position = torch.empty_like(local)
    concatenated = 0
    for source in entry.hf_sources:
        chunk = out_rows[source] // tp
        first = offsets[source] + rank * chunk
        mine = (local >= offsets[source]) & (local < offsets[source] + out_rows[source])
        if not torch.equal(local[mine], torch.arange(first, first + chunk)):
            raise ValueError(f"{source}: rank {rank}'s rows of {entry.mcore} are not its {rank}-th of {tp} chunks")
        position[mine] = local[mine] - first + concatenated
        concatenated += chunk
    return position


def _linear(layer: torch.nn.Module, entry: Entry, expert: int | None = None) -> torch.nn.Module:
    path = entry.mcore.removeprefix(LAYER_PREFIX).removesuffix(".weight")
    linear = layer.get_submodule(path if expert is None else path.format(expert=expert))
    what = f"LoRA on {entry.mcore}"
    if getattr(linear, "gather_output", False) or (expert is None and getattr(linear, "explicit_expert_comm", False)):
        raise ValueError(f"{what}: a linear that gathers its output or is an expert's is not implemented")
    return linear


def _local_experts(layer: torch.nn.Module, entry: Entry) -> tuple[int, int]:
    """(first global expert, local expert count) of a MoE layer's experts on this rank. ValueError: experts
    other than megatron-core's `SequentialMLP` (or `GroupedExperts`), or expert tensor parallelism other than 1 or
    the tensor parallelism (`ETP_RULE`)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.experts import SequentialMLP

    experts = layer.get_submodule("mlp.experts")
    what = f"LoRA on {entry.mcore}"
    if not isinstance(experts, SequentialMLP):
        raise ValueError(f"{what}: adapters on {type(experts).__name__} experts are not implemented (SequentialMLP)")
    etp = parallel_state.get_expert_tensor_parallel_world_size()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if etp not in (1, tp):
        raise ValueError(
            f"{what}: adapters on experts at expert tensor parallelism {etp} with tensor parallelism {tp}"
            f" are not implemented ({ETP_RULE})"
        )
    count = experts.num_local_experts
    return parallel_state.get_expert_model_parallel_rank() * count, count


def _expert_adapters(
    entry: Entry, linear: torch.nn.Module, layer_index: int, expert: int, model_cfg: ModelSpec, lora: LoraConfig
) -> LinearAdapters:
    """One expert's adapter on its linear, PEFT's per-expert slices of its `target_parameters` adapter of the fused
    tensor: A (rank x in), B (out x rank), split over the expert tensor-parallel group as the weight is (B of fc1 by
    rows, each rank its [gate_r; up_r] of the fused [gate; up] rows; A of fc2 by columns; `lora_expert_tp`)."""
    from megatron.core import parallel_state

    etp = parallel_state.get_expert_tensor_parallel_world_size()
    rank = parallel_state.get_expert_tensor_parallel_rank()
    weight = linear.weight
    name = expert_name(fused_expert_template(entry, model_cfg).format(layer=layer_index), expert)
    out_rows, columns = weight.shape  # this rank's
    row = entry.parallel is Parallel.ROW
    if row:
        a = rank_shard(initial_a(name, (lora.rank, columns * etp), lora), Parallel.ROW, etp, rank)
    else:
        a = initial_a(name, (lora.rank, columns), lora)
    a = a.to(device=weight.device, dtype=weight.dtype)
    b = torch.zeros(out_rows, lora.rank, device=weight.device, dtype=weight.dtype)
    rows = None if row else torch.arange(out_rows, device=weight.device)
    sources = tuple(s.format(layer=layer_index, expert=expert) for s in entry.hf_sources)
    style = Parallel.ROW if row else Parallel.COLUMN
    group = getattr(linear, "tp_group", None)
    return LinearAdapters(
        (name,),
        [a],
        [b],
        style,
        rows,
        lora.scale,
        group,
        weights=sources,
        expert=True,
        tp=(rank, etp),
        gate_up=not row,
    )


def _adapters_for(
    entry: Entry, linear: torch.nn.Module, layer_index: int, model_cfg: ModelSpec, lora: LoraConfig
) -> LinearAdapters:
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    weight = linear.weight
    dims = model_cfg.dims(model_cfg.vocab_size)
    names = tuple(s.removesuffix(".weight").format(layer=layer_index) for s in entry.hf_sources)
    whole = global_shape(tuple(weight.shape), entry.parallel, tp)
    if entry.parallel is Parallel.ROW:
        a = rank_shard(initial_a(names[0], (lora.rank, whole[1]), lora), Parallel.ROW, tp, rank)
        b = torch.zeros(whole[0], lora.rank)
        a_list, b_list, rows = [a], [b], None
    else:
        out_rows = {s: n[0] for s, n in entry.hf_shapes(whole, dims).items()}
        a_list = [initial_a(n, (lora.rank, whole[1]), lora) for n in names]
        b_list = [torch.zeros(out_rows[s] // tp, lora.rank) for s in entry.hf_sources]
        rows = column_rows(entry, out_rows, dims, tp, rank).to(weight.device)
    cast = [t.to(device=weight.device, dtype=weight.dtype) for t in (*a_list, *b_list)]
    style = Parallel.ROW if entry.parallel is Parallel.ROW else Parallel.COLUMN
    group = getattr(linear, "tp_group", None)
    weights = tuple(s.format(layer=layer_index) for s in entry.hf_sources)
    return LinearAdapters(
        names,
        cast[: len(a_list)],
        cast[len(a_list) :],
        style,
        rows,
        lora.scale,
        group,
        weights=weights,
        dropout=lora.dropout,
        tp=(rank, tp),
        sequence_parallel=bool(getattr(linear, "sequence_parallel", False)) and tp > 1,
    )


def add_lora(model: torch.nn.Module, model_cfg: ModelSpec, lora: LoraConfig) -> list[LinearAdapters]:
    """Freeze every parameter of `model` (a `GPTModel` stage of the local spec) and give each targeted linear of
    its decoder layers adapters (as its submodule `lora`; a forward hook adds their product). Collective-free;
    every rank calls it alike. ValueError: a target that is not implemented (named)."""
    if not 0 <= lora.dropout < 1:
        raise ValueError(f"LoRA dropout {lora.dropout}: must be in [0, 1)")
    if lora.dropout and any(t in lora.target_modules for t in EXPERT_PROJECTIONS):
        raise ValueError(f"LoRA dropout {lora.dropout} on experts' adapters: not implemented (PEFT has none there)")
    dense_mlp = [t for t in MLP_PROJECTIONS if t in lora.target_modules]
    if dense_mlp and model_cfg.moe is not None:
        raise ValueError(
            f"LoRA on {', '.join(dense_mlp)} of {model_cfg.architecture}, a mixture-of-experts model: on such"
            " models PEFT (transformers 5) reads these target_modules as the routed experts' fused tensors"
            " (Qwen2/3-MoE, DeepSeek-V3, GLM-4.5, ...), not as dense or shared-expert MLPs, so those adapters would"
            " not load in PEFT; adapters on a MoE model's dense MLPs are not implemented (for the experts target"
            f" {', '.join(EXPERT_PROJECTIONS)})"
        )
    entries = list(targeted_entries(model_cfg, lora))
    missing = [t for t in EXPERT_PROJECTIONS if t in lora.target_modules and not any(map(expert_target, entries))]
    if missing and model_cfg.moe is None:
        raise ValueError(f"LoRA on {missing[0]}: {model_cfg.architecture} is a dense model (no routed experts)")
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    added = []
    for layer in getattr(getattr(model, "decoder", None), "layers", []):
        index = layer.layer_number - 1
        kind = model_cfg.layer_kind(index)
        for entry in entries:
            if entry.layers not in (LayerKind.ALL, kind):
                continue
            if is_expert(entry):
                first, count = _local_experts(layer, entry)
                for local in range(count):
                    linear = _linear(layer, entry, local)
                    linear.lora = _expert_adapters(entry, linear, index, first + local, model_cfg, lora)
                    linear.register_forward_hook(_hook, with_kwargs=True)
                    linear.sharded_state_dict = MethodType(_sharded_state_dict, linear)
                    added.append(linear.lora)
                continue
            linear = _linear(layer, entry)
            linear.lora = _adapters_for(entry, linear, index, model_cfg, lora)
            linear.register_forward_hook(_hook, with_kwargs=True)
            linear.sharded_state_dict = MethodType(_sharded_state_dict, linear)
            added.append(linear.lora)
    if not added:
        raise ValueError(f"LoRA: no linear of this model matches target_modules {list(lora.target_modules)}")
    return added


def adapter_modules(model: torch.nn.Module) -> list[LinearAdapters]:
    """Every `LinearAdapters` of `model` (looked through wrappers such as DDP), in module order."""
    return [m for m in model.modules() if isinstance(m, LinearAdapters)]


def adapted_weights(model: torch.nn.Module) -> set[str]:
    """The HF weight names of every adapted linear of the whole model (`LinearAdapters.weights`: what a refit of the
    merged weights must stream), gathered over the pipeline stages and the expert-parallel group (each holds its own
    layers' and experts' adapters). Collective over both groups: every rank calls it alike."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    adapted = {name for holder in adapter_modules(model) for name in holder.weights}
    groups = (
        (parallel_state.get_pipeline_model_parallel_world_size(), parallel_state.get_pipeline_model_parallel_group),
        (parallel_state.get_expert_model_parallel_world_size(), parallel_state.get_expert_model_parallel_group),
    )
    for size, group in groups:
        if size > 1:
            parts: list[Any] = [None] * size
            dist.all_gather_object(parts, adapted, group=group())
            adapted = set().union(*parts)
    return adapted


def _gather(local: torch.Tensor, axis: int, group: Any) -> torch.Tensor:
    import torch.distributed as dist

    size = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
    if size == 1:
        return local.detach().clone()
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local.detach().contiguous(), group=group)
    return torch.cat(parts, dim=axis)


def full_adapters(adapters: list[LinearAdapters], grad: bool = False) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """HF module name (an expert's: `expert_name`) -> (A, B) whole, gathered over the tensor-parallel group, the
    experts' over the expert-parallel group (on the CPU there), or their gradients (`grad=True`; zeros where none).
    Collective over the tensor-parallel group (and the expert-parallel one, with expert adapters): every rank calls
    it alike."""

    def value(p: torch.Tensor) -> torch.Tensor:
        if not grad:
            return p.detach()
        return p.grad.detach() if p.grad is not None else torch.zeros_like(p)

    result = {}
    for holder in adapters:
        row = holder.parallel is Parallel.ROW
        for name, a, b in zip(holder.names, holder.lora_a, holder.lora_b, strict=True):
            whole_a = _gather(value(a), 1, holder.tp_group) if row else value(a).clone()
            whole_b = value(b).clone() if row else _gather(value(b), 0, holder.tp_group)
            if holder.gate_up and holder.tp[1] > 1:  # [gate_0; up_0; gate_1; up_1; ...] -> [gate; up]
                parts = whole_b.chunk(2 * holder.tp[1])
                whole_b = torch.cat((*parts[0::2], *parts[1::2]))
            result[name] = (whole_a, whole_b)
    if any(holder.expert for holder in adapters):
        result |= _gather_experts({n for h in adapters if h.expert for n in h.names}, result)
    return result


def _gather_experts(
    names: set[str], mine: dict[str, tuple[torch.Tensor, torch.Tensor]]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Every expert-parallel rank's expert adapters (the named ones of `mine`), on the CPU. Collective over the
    expert-parallel group."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if parallel_state.get_expert_model_parallel_world_size() == 1:
        return {}
    local = {n: (a.cpu(), b.cpu()) for n, (a, b) in mine.items() if n in names}
    parts: list[Any] = [None] * parallel_state.get_expert_model_parallel_world_size()
    dist.all_gather_object(parts, local, group=parallel_state.get_expert_model_parallel_group())
    return {name: pair for part in parts for name, pair in part.items()}


def set_adapters(adapters: list[LinearAdapters], values: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy whole (A, B) pairs by HF module name into this rank's parts (a PEFT adapter's, say). KeyError: an
    adapter of the model missing from `values`."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for holder in adapters:
            row = holder.parallel is Parallel.ROW
            for name, a, b in zip(holder.names, holder.lora_a, holder.lora_b, strict=True):
                whole_a, whole_b = values[name]
                if holder.expert:  # split over the expert tensor-parallel group: A of fc2 by columns, B of fc1 by
                    mine, size = holder.tp  # rows, [gate_r; up_r] of the fused [gate; up] rows
                    a.copy_(whole_a.chunk(size, dim=1)[mine] if row else whole_a)
                    halves = (whole_b,) if row else whole_b.chunk(2)
                    b.copy_(whole_b if row else torch.cat([h.chunk(size)[mine] for h in halves]))
                    continue
                a.copy_(rank_shard(whole_a, Parallel.ROW, tp, rank) if row else whole_a)
                b.copy_(whole_b if row else whole_b.chunk(tp, dim=0)[rank])


@contextmanager
def merged(model: torch.nn.Module) -> Iterator[None]:
    """Inside, every adapted linear of `model` holds W + s B A in its weight (each rank its own part), e.g. for the
    refit or an export to stream the merged weights under HF names through the mapping table; on leaving, the
    weights are put back exactly (from copies, not by subtracting). Run no forward inside: the adapters' hooks
    would add their product a second time. Not collective."""
    linears = [m for m in model.modules() if isinstance(getattr(m, "lora", None), LinearAdapters)]
    saved = []
    try:
        with torch.no_grad():
            for linear in linears:
                saved.append(linear.weight.detach().clone())
                linear.weight.add_(linear.lora.weight_delta().to(linear.weight.dtype))
        yield
    finally:
        with torch.no_grad():
            for linear, weight in zip(linears, saved, strict=False):
                linear.weight.copy_(weight)
