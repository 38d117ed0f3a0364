"""A live megatron-core model as a stream of full HF tensors, on every rank, one tensor in flight at a time.

The stream follows the mapping table (`model_plan.placed_entries`: layer by layer, experts in global order) and
ends in the table's own export direction (`entry.to_hf`), so it is the same conversion as the file export, the
trainer's refit and the engine's loading. Per table entry:

1. the pipeline stage that holds it makes the whole megatron-core tensor: its tensor-parallel shards all-gathered
   (`parallel.gather_tp`; a routed expert's over expert TP, by the expert-parallel rank that holds it, which then
   broadcasts it over the expert-parallel group);
2. with PP > 1 that stage broadcasts it over the pipeline group (one tensor, not the stage: memory holds one whole
   tensor and its HF pieces, whatever the model's size);
3. every rank splits it into HF tensors, casts them (`dtype`; tensors the table keeps in float32 stay so) or
   quantizes the linear layers' weights to 128 x 128 FP8 blocks with `weight_scale_inv` (`fp8`, computed scales
   of `fp8_scale_format`; `fp8_checkpoint.Fp8Export`).

Which stage holds what, with its whole shape and dtype, is exchanged once per model (`ExportPlan`, small Python
objects over the expert-parallel, then the pipeline group) and cached; so every rank also knows every tensor's
name, shape and dtype before any is made (`ExportPlan.specs`, which `save_hf` shards files with).

Collective over every rank of the model: each must exhaust the stream (or none start it). Yielded tensors may
share storage with the model's parameters (where nothing was gathered, cast or split): use them before the next
optimizer step, or clone them. A model wrapped in megatron-core's `DistributedDataParallel` with the overlapped
parameter all-gather is synchronised first (`parallel.finish_param_gather`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol
from weakref import WeakKeyDictionary

from hf_mcore_bridge.bridge.parallel import buckets, finish_param_gather, gather_tp, tp_gathers
from hf_mcore_bridge.bridge.plan import Held, Ranks, as_chunks, bare, build_plan, parallel_ranks
from hf_mcore_bridge.checkpoint import dtypes
from hf_mcore_bridge.convert.model_plan import Placed, placed_entries
from hf_mcore_bridge.convert.placement import part_rows
from hf_mcore_bridge.errors import BridgeError
from hf_mcore_bridge.models.mapping_types import Dims, LayerKind, keeps_float32
from hf_mcore_bridge.models.parallel_style import Parallel
from hf_mcore_bridge.models.spec import ModelSpec
from hf_mcore_bridge.models.tensor_ops import global_shape

if TYPE_CHECKING:
    import torch

    from hf_mcore_bridge.convert.fp8_checkpoint import Fp8Export

Spec = tuple[str, tuple[int, ...], "torch.dtype"]
"""(HF name, shape, dtype) of one streamed tensor."""


class Phases(Protocol):
    """Times named phases of the stream (`grpo.refit.PhaseTimes`): `gather` (TP / expert-TP all-gathers and
    the expert-parallel broadcasts) and `transfer` (the pipeline broadcasts)."""

    def phase(self, name: str) -> AbstractContextManager[None]: ...


class _Untimed:
    def phase(self, name: str) -> AbstractContextManager[None]:
        return nullcontext()


@dataclass(frozen=True)
class Step:
    """One table entry of the stream."""

    placed: Placed
    shape: tuple[int, ...]
    """The whole megatron-core tensor's shape (gathered over TP, or expert TP)."""
    dtype: torch.dtype
    stage: int
    """The pipeline rank that holds it."""
    held: Held | None
    """This rank's tensor, where this rank holds it (its stage, and for a routed expert its expert-parallel rank)."""
    experts_per_rank: int = 1

    @property
    def owner(self) -> int:
        """The expert-parallel rank of a routed expert's tensor (0 for any other)."""
        return 0 if self.placed.expert is None else self.placed.expert // self.experts_per_rank


@dataclass(frozen=True)
class ExportPlan:
    """Every tensor of the stream in order, where it is held, and the dimensions its transforms need."""

    steps: tuple[Step, ...]
    dims: Dims
    ranks: Ranks
    device: torch.device

    def specs(self, dtype: torch.dtype | None = None, fp8: Fp8Export | None = None) -> list[Spec]:
        """(HF name, shape, dtype) of every tensor the stream yields with these options, in its order."""
        out: list[Spec] = []
        for step in self.steps:
            kind = _out_dtype(step, dtype)
            for name, shape in step.placed.entry.hf_shapes(step.shape, self.dims).items():
                if fp8 is None:
                    out.append((name, tuple(shape), kind))
                    continue
                out += [(n, tuple(s), d.torch) for n, s, d in fp8.specs(name, tuple(shape), dtypes.of(kind))]
        return out


_PLANS: WeakKeyDictionary[Any, tuple[tuple[Any, ...], ExportPlan]] = WeakKeyDictionary()


def export_plan(models: Any, model_cfg: ModelSpec) -> ExportPlan:
    """The plan of `models` (collective with EP > 1 or PP > 1 when it is made; kept for the same chunks, model
    and device after, so that a refit per step exchanges nothing but tensors)."""
    chunks = [bare(m) for m in as_chunks(models)]
    key = (*(id(c) for c in chunks), model_cfg, next(chunks[0].parameters()).device)
    cached = _PLANS.get(chunks[0])
    if cached is not None and cached[0] == key:
        return cached[1]
    plan = _make_plan(chunks, model_cfg)
    _PLANS[chunks[0]] = (key, plan)
    return plan


def _make_plan(chunks: list[Any], model_cfg: ModelSpec) -> ExportPlan:
    ranks = parallel_ranks()
    local = build_plan(chunks, model_cfg, ranks)
    placed = placed_entries(model_cfg)
    position = {(p.template, p.layer, p.expert): i for i, p in enumerate(placed)}
    mine: dict[int, tuple[tuple[int, ...], Any]] = {}
    held_at: dict[int, Held] = {}
    for held in local.held:
        i = position[(held.placed.template, held.placed.layer, held.placed.expert)]
        size, _ = ranks.split(held.expert)
        mine[i] = (global_shape(tuple(held.tensor.shape), held.parallel, size), held.tensor.dtype)
        held_at[i] = held
    stages, problem = _exchanged(mine, local.problem(model_cfg.architecture), ranks)
    missing = [p.mcore_name for i, p in enumerate(placed) if i not in stages and p.template.layers is not LayerKind.MTP]
    if problem is None and missing:
        problem = f"no rank holds {len(missing)} tensor(s) of the {model_cfg.architecture} table, e.g. {missing[0]}"
    if problem is not None:  # on every rank alike, before any tensor is exchanged
        raise BridgeError(problem)
    per_rank = model_cfg.moe.num_experts // ranks.ep if model_cfg.moe else 1
    steps = []
    for i in sorted(stages):
        stage, (shape, dtype) = stages[i]
        steps.append(Step(placed[i], shape, dtype, stage, held_at.get(i), per_rank))
    vocab = next((s.shape[0] for s in steps if s.placed.entry.parallel is Parallel.VOCAB), model_cfg.vocab_size)
    device = next(chunks[0].parameters()).device
    return ExportPlan(tuple(steps), model_cfg.dims(vocab), ranks, device)


Holding = dict[int, tuple[tuple[int, ...], Any]]
"""Entry index -> (whole shape, dtype) of the entries a rank holds."""


def _exchanged(mine: Holding, problem: str | None, ranks: Ranks) -> tuple[dict[int, tuple[int, Any]], str | None]:
    """Entry index -> (pipeline rank holding it, (shape, dtype)) for every entry some rank holds (this rank's
    expert-parallel peers' joined first, then every stage's over the pipeline group), and the first problem any of
    those ranks found with its part of the model (`Plan.problem`), so that all refuse together."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    stage, problems = dict(mine), [problem]
    if ranks.ep > 1:
        peers: list[tuple[Holding, str | None]] = [({}, None)] * ranks.ep
        dist.all_gather_object(peers, (mine, problem), group=parallel_state.get_expert_model_parallel_group())
        for held, found in peers:
            stage.update(held)
            problems.append(found)
    everyone: list[tuple[Holding, str | None]] = [(stage, next((p for p in problems if p), None))]
    if ranks.pp > 1:
        everyone = [({}, None)] * ranks.pp
        group = parallel_state.get_pipeline_model_parallel_group()
        dist.all_gather_object(everyone, (stage, next((p for p in problems if p), None)), group=group)
    where: dict[int, tuple[int, Any]] = {}
    for pp_rank, (held, found) in enumerate(everyone):
        problems.append(found)
        where.update({i: (pp_rank, meta) for i, meta in held.items()})
    return where, next((p for p in problems if p), None)


def export_hf_weights(
    models: Any,
    model_cfg: ModelSpec,
    *,
    dtype: torch.dtype | None = None,
    fp8: bool = False,
    fp8_scale_format: str = "ue8m0",
    phases: Phases | None = None,
    names: Collection[str] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The whole model as (HF name, full tensor), on every rank (see the module docstring). `names`: only the table
    entries that yield one of them (a fused entry whole), nothing gathered for the others."""
    for model in as_chunks(models):
        finish_param_gather(model)
    plan = export_plan(models, model_cfg)
    quantizer = fp8_export(plan, fp8_scale_format) if fp8 else None
    timer = phases or _Untimed()
    for step in plan.steps:
        if names is not None and not set(step.placed.hf_names()) & set(names):
            continue
        whole = _whole(step, plan, timer)
        for name, tensor in step.placed.entry.to_hf(whole, plan.dims).items():
            yield from _finished(name, tensor, step, dtype, quantizer)


def fp8_export(plan: ExportPlan, scale_format: str) -> Fp8Export:
    """Which of the plan's tensors become FP8 blocks (the linear layers' weights), with scales of `scale_format`
    (`ue8m0`: powers of two, or `float32`) computed from the values."""
    from hf_mcore_bridge.convert.fp8_checkpoint import Fp8Export

    return Fp8Export((step.placed.entry for step in plan.steps), scale_format)


def _out_dtype(step: Step, dtype: torch.dtype | None) -> torch.dtype:
    return step.dtype if dtype is None or keeps_float32(step.placed.template) else dtype


def _finished(
    name: str, tensor: torch.Tensor, step: Step, dtype: torch.dtype | None, quantizer: Fp8Export | None
) -> Iterator[tuple[str, torch.Tensor]]:
    tensor = tensor.to(_out_dtype(step, dtype))
    if quantizer is None:
        yield name, tensor
        return
    for out, value in quantizer.tensors(name, tensor):  # quantized on the host, a span of rows at a time
        yield out, value.to(tensor.device)


def _whole(step: Step, plan: ExportPlan, timer: Phases) -> torch.Tensor:
    """The whole megatron-core tensor of `step`, on every rank (collective as the module docstring says)."""
    from megatron.core import parallel_state

    ranks, expert = plan.ranks, step.placed.expert is not None
    whole = None
    if step.stage == ranks.pp_rank:
        if step.held is not None:
            if tp_gathers(step.held.parallel, expert):
                with timer.phase("gather"):
                    parts = part_rows(step.placed.template.mcore, plan.dims)
                    whole = gather_tp(step.held.tensor, step.held.parallel, expert, parts)
            else:
                whole = step.held.tensor.detach()
        if expert and ranks.ep > 1:
            with timer.phase("gather"):
                group = parallel_state.get_expert_model_parallel_group()
                whole = _broadcast(whole, step, plan.device, step.owner, group)
    if ranks.pp > 1:
        with timer.phase("transfer"):
            whole = _broadcast(whole, step, plan.device, step.stage, parallel_state.get_pipeline_model_parallel_group())
    assert whole is not None
    return whole


def _broadcast(tensor: torch.Tensor | None, step: Step, device: torch.device, source: int, group: Any) -> torch.Tensor:
    """`tensor` from the group's rank `source` on every rank of `group` (received into a new tensor where None).
    Contiguous: gloo sends the storage as it lies."""
    import torch
    import torch.distributed as dist

    tensor = torch.empty(step.shape, dtype=step.dtype, device=device) if tensor is None else tensor.contiguous()
    dist.broadcast(tensor, src=dist.get_global_rank(group, source), group=group)
    return tensor


def export_hf_weights_bucketed(
    models: Any, model_cfg: ModelSpec, bucket_bytes: int, **options: Any
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """`export_hf_weights` in lists of at most `bucket_bytes` (a larger tensor makes a list of its own), for
    consumers that load several tensors per call; a list is held only until the next is asked for."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    yield from buckets(export_hf_weights(models, model_cfg, **options), bucket_bytes)
