"""Refit: the trained policy's weights, gathered over TP, EP (and PP), streamed as HF-named tensors into the engine.

The full-tensor stream is the bridge API's (`bridge.export.export_hf_weights`, which the megatron backend calls):
built from the SAME mapping table as conversion and export (`model_plan.placed_entries`, then `entry.to_hf`), so
refit cannot drift from the checkpoint converters; TP / expert-TP shards all-gathered, experts broadcast from their
EP rank, one pipeline broadcast per tensor. Each parameter of the `GPTModel` is named in the table's terms by
megatron-core's own key map (`sharded_state_dict_keys_map` of the layer spec, the one its checkpoints use) and its
global layer number; its TP shards are all-gathered by the entry's parallel style (`gather_tp`, the inverse of
`tensor_ops.shard_boxes`). Those primitives on a live model are the bridge's (`bridge.parallel`, re-exported here).

Cost: the per-parameter plan (local parameter, table entry) is built once per module; TP shards arrive in one
`all_gather_into_tensor` each (column-parallel tensors are then views, not copies); phases are timed with CUDA
events rather than synchronisations (`PhaseTimes`), so the host runs ahead of the device's copies.

Checks, cheap by design: `tensor_checksums` (`refit_checksums`, which defines it) gives every tensor two 64-bit
columns of a hash that mixes each element's bit pattern with its position (not linear in the elements), read on
the device with no synchronisation. The caller checksums, for every HF tensor streamed, the part this rank's
engine must hold as the trainer's side works it out (`grpo.refit_reference`: cut from the full tensor by the
table's parallel styles and megatron-core's head / query-group split, or the trainer's own shard in a shard-local
refit; never by the engine's own slicing, so an engine rank keeping the wrong heads, KV heads or vocabulary block
shows), and every tensor as the engine holds it after loading (or after a replay), and compares them with one
synchronisation (`mismatched`): a lost, truncated, permuted, misplaced, mis-sliced or stale copy shows, and so do
the structured changes that cancel in linear sums (rows of equal sums swapped, [A, B, B, A] -> [B, A, A, B],
+1/-2/+1 ulp, paired sign flips). It cannot see a conversion that is wrong the same way on both sides (a swapped
q/k split, gate/up or expert order in the table), which the engine-vs-trainer log-prob gate sees
(`grpo.logprob_gate`). `finish_param_gather` first completes megatron-core's deferred parameter all-gather
(`overlap_param_gather`), else shards would be stale.

Shard-local refit (`shard_local_hf_weights`): where the engine is sharded over the trainer's own TP group (dense
models), each rank converts its own shards into its engine's parts with the same table, no all-gather but the
vocabulary's (with PP > 1 the ranks of one TP rank then exchange their stages' parts). Otherwise (the bridge's
stream) full tensors are made and each engine rank keeps its part of them.

Simplifications: every rank of a TP group receives every full tensor (each rank's engine keeps its part of them);
in a shard-local refit with PP > 1 the stages exchange their parts as pickled objects (`all_gather_object`), fine
for small models, not for large ones.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from weakref import WeakKeyDictionary

import torch

from hf_mcore_bridge.bridge.parallel import (
    assemble_shards,
    buckets,
    finish_param_gather,
    gather_tp,
    model_tensors,
    table_names,
    tp_gathers,
)
from hf_mcore_bridge.checkpoint.names import EXPERT
from hf_mcore_bridge.convert.model_plan import placed_entries
from hf_mcore_bridge.convert.placement import LOCAL_SPEC_MOE_NORM, MOE_PRE_MLP_NORM
from hf_mcore_bridge.grpo.refit.checksums import tensor_checksums
from hf_mcore_bridge.models.mapping_types import Dims, Entry, at_layer
from hf_mcore_bridge.models.parallel_style import Parallel
from hf_mcore_bridge.models.spec import ModelSpec

__all__ = [
    "Checksums",
    "PhaseTimes",
    "assemble_shards",
    "buckets",
    "finish_param_gather",
    "gather_tp",
    "mismatched",
    "model_tensors",
    "shard_local_hf_weights",
    "table_names",
    "tensor_checksums",
    "tp_gathers",
]


def _local_spec_key(template: str) -> str:
    """A table name as the local layer spec's key map names it (a MoE layer's pre-MLP norm differs)."""
    return template.replace(MOE_PRE_MLP_NORM, LOCAL_SPEC_MOE_NORM)


def _local_name(by_template: dict[tuple[str, int | None], str], template: str, layer: int | None) -> str | None:
    """The local parameter of a table entry: named as the table names it (Transformer Engine's spec), or as the
    local spec's key map does; None where another pipeline stage holds it."""
    return by_template.get((template, layer)) or by_template.get((_local_spec_key(template), layer))


class PhaseTimes:
    """Seconds per refit phase (`gather`, `transfer`, `produce`, `load`), measured without stalling the device.

    On CUDA a phase is bracketed by two events on the current stream and read once, in `totals`: its time is the
    device's time between the brackets (its kernels and collectives, and any host gap the device waited through).
    Elsewhere, host seconds. Phases may nest: `produce` (the stream's tensors, up to a bucket) holds the gathers
    and transfers it caused."""

    PHASES = ("gather", "transfer", "produce", "load")

    def __init__(self, events: bool = True) -> None:
        self._host: dict[str, float] = dict.fromkeys(self.PHASES, 0.0)
        self.counts: dict[str, int] = dict.fromkeys(self.PHASES, 0)
        """How many times each phase was entered (`gather`: tensors all-gathered)."""
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self._cuda = events and torch.cuda.is_available()
        """CUDA events bracket the phases (`events=False`: host seconds, e.g. while a refit is being recorded)."""

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name not in self._host:
            raise ValueError(f"unknown refit phase {name!r}; known: {self.PHASES}")
        self.counts[name] += 1
        if self._cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self._events.append((name, start, end))
            return
        started = time.perf_counter()
        try:
            yield
        finally:
            self._host[name] += time.perf_counter() - started

    def totals(self) -> dict[str, float]:
        """Seconds per phase (on CUDA this waits for the phases' last event)."""
        out = dict(self._host)
        for name, start, end in self._events:
            end.synchronize()
            out[name] += start.elapsed_time(end) / 1e3
        return out


@dataclass(frozen=True)
class _Step:
    """One local parameter's part of the stream: its table entry, and for a routed expert the entry of the expert
    of the same local index on each EP rank."""

    param: torch.Tensor
    entry: Entry
    communicates: bool
    """Whether producing it takes a collective (TP, expert-TP or EP gathers)."""
    expert_entries: tuple[Entry, ...] | None = None


_PLANS: WeakKeyDictionary[torch.nn.Module, list[_Step]] = WeakKeyDictionary()


def _plan(module: torch.nn.Module, model_cfg: ModelSpec) -> list[_Step]:
    """This stage's parameters in table order, with their entries: built once per module (a refit per step)."""
    from megatron.core import parallel_state

    cached = _PLANS.get(module)
    if cached is not None:
        return cached
    by_template: dict[tuple[str, int | None], str] = {v: k for k, v in table_names(module).items()}
    params = model_tensors(module)
    ep = parallel_state.get_expert_model_parallel_world_size()
    per_rank = model_cfg.moe.num_experts // ep if model_cfg.moe else 0
    steps: list[_Step] = []
    for placed in placed_entries(model_cfg):
        if placed.expert is None:
            local_name = _local_name(by_template, placed.template.mcore, placed.layer)
            if local_name is not None:  # else another pipeline stage holds it
                steps.append(_Step(params[local_name], placed.entry, tp_gathers(placed.entry.parallel)))
            continue
        if placed.expert >= per_rank:
            continue  # gathered with the local expert of the same index on the other EP ranks
        local_name = by_template.get((placed.template.mcore.replace(EXPERT, str(placed.expert)), placed.layer))
        if local_name is not None:
            experts = tuple(at_layer(placed.template, placed.layer, r * per_rank + placed.expert) for r in range(ep))
            communicates = tp_gathers(placed.entry.parallel, expert=True) or ep > 1
            steps.append(_Step(params[local_name], placed.entry, communicates, experts))
    _PLANS[module] = steps
    return steps


def shard_local_hf_weights(
    module: torch.nn.Module,
    model_cfg: ModelSpec,
    padded_vocab: int,
    times: PhaseTimes | None = None,
    names: Collection[str] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """This rank's tensor-parallel part of every HF tensor, straight from its own megatron-core shards through the
    mapping table (`entry.to_hf` with the rank's head counts): for an engine sharded over the trainer's own TP
    group (`engine.tp_shards` splits heads, query groups, MLP widths and rows as megatron-core does). Needs a
    dense model (the caller checks). No all-gather, except the vocabulary-parallel tensors: megatron-core splits
    the padded vocabulary, the engine the vocabulary itself, so those come whole (the engine slices them). With
    PP > 1 each stage's engine (its TP group) needs every stage's layers: the ranks of one TP rank exchange their
    parts over the pipeline group (`transfer`), so each receives only its own part of the other stages' tensors.
    `times` collects the vocabulary gathers (`gather`) and that exchange. `names`: only the table entries that yield
    one of them (a fused entry whole)."""
    from megatron.core import parallel_state

    times = times or PhaseTimes()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    dims = model_cfg.dims(padded_vocab)
    local = dataclasses.replace(  # Gated DeltaNet's heads split as attention's (`engine.gated_delta`: by key heads)
        dims,
        num_attention_heads=dims.num_attention_heads // tp,
        num_query_groups=dims.num_query_groups // tp,
        linear_key_heads=dims.linear_key_heads // tp,
        linear_value_heads=dims.linear_value_heads // tp,
    )
    parts = _shard_local_parts(module, model_cfg, dims, local, tp, times, names)
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        yield from parts
        return
    yield from _exchange_stages(module, parts, times)


def _shard_local_parts(
    module: torch.nn.Module,
    model_cfg: ModelSpec,
    dims: Dims,
    local: Dims,
    tp: int,
    times: PhaseTimes,
    names: Collection[str] | None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """This stage's part of `shard_local_hf_weights`."""
    for step in _plan(module, model_cfg):
        if names is not None and not set(step.entry.hf_sources) & set(names):
            continue
        if step.expert_entries is not None:
            raise ValueError("a shard-local refit covers dense models only")
        parallel = step.entry.parallel
        if parallel is Parallel.VOCAB and tp > 1:
            with times.phase("gather"):
                full = gather_tp(step.param, parallel)
            yield from step.entry.to_hf(full, dims).items()
            continue
        yield from step.entry.to_hf(step.param.detach(), local).items()


def _exchange_stages(
    module: torch.nn.Module, local: Iterable[tuple[str, torch.Tensor]], times: PhaseTimes
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every pipeline stage's tensors on every rank of this rank's pipeline group, in stage order (pickled over
    `all_gather_object`: fine for small models, not for large ones)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    device = next(module.parameters()).device
    mine = [(name, tensor.cpu().clone()) for name, tensor in local]
    group = parallel_state.get_pipeline_model_parallel_group()
    stages: list[list[tuple[str, torch.Tensor]]] = [[] for _ in range(dist.get_world_size(group))]
    with times.phase("transfer"):
        dist.all_gather_object(stages, mine, group=group)
    for part in stages:
        for name, tensor in part:
            yield name, tensor.to(device)


@dataclass(frozen=True)
class Checksums:
    """Checksums of named tensors as a refit streamed them (`values` rows in `names` order; device tensors, so
    reading them is the caller's one synchronisation). A recorded refit's replay rewrites `values` and `sources`
    in place."""

    names: tuple[str, ...]
    values: torch.Tensor
    """[len(names), 2] int64: `tensor_checksums` of each tensor as streamed, in the engine's dtype (rows compared
    with `mismatched`)."""
    sources: torch.Tensor | None = None
    """`tensor_checksums` of the trainer tensors the stream read (`refit_sources`), as it read them; None where
    the refit communicates (it is then never recorded)."""


def mismatched(names: Sequence[str], sent: torch.Tensor, held: torch.Tensor) -> list[str]:
    """The names whose checksum rows differ (one synchronisation when they all agree)."""
    if torch.equal(sent, held.to(sent.device)):
        return []
    differs = (sent != held.to(sent.device)).any(1).tolist()
    return [name for name, bad in zip(names, differs, strict=True) if bad]
