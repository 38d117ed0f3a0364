"""Refit: the trained policy's weights, gathered over TP, EP (and PP), streamed as HF-named tensors into the engine.

The stream is built from the SAME mapping table as conversion and export (`model_plan.placed_entries`, then
`entry.to_hf`), so refit cannot drift from the checkpoint converters. Each parameter of the local-spec
`GPTModel` is named in the table's terms by megatron-core's own key map (`sharded_state_dict_keys_map` of the
layer spec, the one its checkpoints use) and its global layer number; its TP shards are all-gathered by the
entry's parallel style (`gather_tp`, the inverse of `tensor_ops.shard_boxes`).

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
vocabulary's (with PP > 1 the ranks of one TP rank then exchange their stages' parts). Otherwise (`hf_weights`)
full tensors are made and each engine rank keeps its part of them.

Simplifications: every rank of a TP group gathers (each rank's engine keeps its part of the full tensors); with
PP > 1 the stages exchange their HF tensors (or parts) as pickled objects (`all_gather_object`), fine for small
models, not for large ones; a routed expert's weight is gathered over expert TP, then all-gathered over EP local
index by local index (every EP rank receives every expert: simple, and one expert tensor per EP rank in flight).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from weakref import WeakKeyDictionary

import torch

from hf_mcore_bridge.checkpoint.names import EXPERT, LAYER
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
    "finish_param_gather",
    "gather_experts",
    "gather_tp",
    "hf_weights",
    "mismatched",
    "shard_local_hf_weights",
    "table_names",
    "tensor_checksums",
    "tp_gathers",
]


def assemble_shards(shards: list[torch.Tensor], parallel: Parallel) -> torch.Tensor:
    """The global tensor from the TP shards in rank order (pure; the inverse of megatron-core's sharding)."""
    if parallel is Parallel.REPLICATED or (len(shards) == 1 and parallel is not Parallel.GATED_COLUMN):
        return shards[0]
    if parallel in (Parallel.COLUMN, Parallel.VOCAB):
        return torch.cat(shards, dim=0)
    if parallel is Parallel.ROW:
        return torch.cat(shards, dim=1)
    if parallel is Parallel.GATED_COLUMN:  # each rank holds [gate_r; up_r]
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    raise ValueError(f"unknown parallel style {parallel}")


def _tp_group(expert: bool) -> tuple[int, object]:
    """(size, group) of this rank's TP group, or of its expert-TP group for a routed expert's weight."""
    from megatron.core import parallel_state

    if expert:
        return (
            parallel_state.get_expert_tensor_parallel_world_size(),
            parallel_state.get_expert_tensor_parallel_group(),
        )
    return parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_group()


def gather_tp(local: torch.Tensor, parallel: Parallel, expert: bool = False) -> torch.Tensor:
    """All-gather one parameter over this rank's TP group (the expert-TP group for a routed expert's weight) and
    assemble it (collective over that group). One `all_gather_into_tensor`; a column-parallel tensor is then a
    view of the gathered buffer, with no further copy."""
    import torch.distributed as dist

    if not tp_gathers(parallel, expert):
        return local.detach()
    size, group = _tp_group(expert)
    gathered = local.new_empty((size * local.shape[0], *local.shape[1:]))  # the shards one after another
    dist.all_gather_into_tensor(gathered, local.detach().contiguous(), group=group)
    if parallel in (Parallel.COLUMN, Parallel.VOCAB):
        return gathered
    return assemble_shards(list(gathered.chunk(size, dim=0)), parallel)


def tp_gathers(parallel: Parallel, expert: bool = False) -> bool:
    """Whether `gather_tp` communicates for a tensor of this style on this rank."""
    return parallel is not Parallel.REPLICATED and _tp_group(expert)[0] > 1


def gather_experts(local: torch.Tensor) -> list[torch.Tensor]:
    """This local expert's tensor from every expert-parallel rank, in EP rank order (collective over the EP group):
    EP rank r holds global experts `r * local_count ...`, so entry r is global expert `r * local_count + j`."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    size = parallel_state.get_expert_model_parallel_world_size()
    if size == 1:
        return [local]
    everyone = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(everyone, local.contiguous(), group=parallel_state.get_expert_model_parallel_group())
    return everyone


def model_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A module's parameters and persistent buffers by local name: what the mapping table covers (megatron-core
    keeps the router's `expert_bias` as a buffer)."""
    saved = set(module.state_dict())
    buffers = {name: buffer for name, buffer in module.named_buffers() if name in saved}
    return {**dict(module.named_parameters()), **buffers}


def table_names(module: torch.nn.Module) -> dict[str, tuple[str, int | None]]:
    """Local parameter (or persistent buffer) name -> (table template name, global layer index or None) for a
    `GPTModel` of either spec (the local spec's names pass through its `sharded_state_dict_keys_map`; Transformer
    Engine's need none)."""
    names: dict[str, tuple[str, int | None]] = {}
    layers = module.decoder.layers if hasattr(module, "decoder") else []
    for name in model_tensors(module):
        if not name.startswith("decoder.layers."):
            names[name] = (name, None)
            continue
        index, rest = name.removeprefix("decoder.layers.").split(".", 1)
        layer = layers[int(index)]
        for old, new in layer.submodules_config.sharded_state_dict_keys_map.items():
            if rest.startswith(old):
                rest = new + rest[len(old) :]
                break
        names[name] = (f"decoder.layers.{LAYER}.{rest}", layer.layer_number - 1)
    return names


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


def _local_hf_weights(
    module: torch.nn.Module, model_cfg: ModelSpec, padded_vocab: int, times: PhaseTimes
) -> Iterator[tuple[str, torch.Tensor]]:
    """This pipeline stage's HF tensors, gathered over TP, expert TP and EP (collective over those groups)."""

    dims = model_cfg.dims(padded_vocab)
    for step in _plan(module, model_cfg):
        param, parallel = step.param, step.entry.parallel
        if step.expert_entries is None:
            if step.communicates:
                with times.phase("gather"):
                    full = gather_tp(param, parallel)
            else:
                full = param.detach()
            yield from step.entry.to_hf(full, dims).items()
            continue
        if step.communicates:
            with times.phase("gather"):
                experts = gather_experts(gather_tp(param, parallel, expert=True))
        else:
            experts = [param.detach()]
        for entry, tensor in zip(step.expert_entries, experts, strict=True):
            yield from entry.to_hf(tensor, dims).items()


def finish_param_gather(model: torch.nn.Module) -> None:
    """Completes the parameter all-gather that megatron-core's `DistributedDataParallel` defers past
    `optimizer.step()` (collective over the data-parallel group; call it on every rank before a refit).

    With the distributed optimizer and `ddp.overlap_param_gather`, a step updates only this rank's shard of the
    parameter buffer; the other ranks' shards arrive in the next forward's pre-hooks. A refit right after the
    step would stream stale shards. This runs the gather now, synchronously (megatron-core's own
    `start_param_sync(force_sync=True)`, which also waits on one already in flight); the next forward's hooks
    then find it done. Nothing to do without that combination, or with one data-parallel rank."""
    from megatron.core import parallel_state

    ddp_config = getattr(model, "ddp_config", None)
    if ddp_config is None or not (ddp_config.use_distributed_optimizer and ddp_config.overlap_param_gather):
        return
    if parallel_state.get_data_parallel_world_size(with_context_parallel=True) > 1:
        model.start_param_sync(force_sync=True)


def hf_weights(
    module: torch.nn.Module, model_cfg: ModelSpec, padded_vocab: int, times: PhaseTimes | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The whole model as (HF name, full tensor), on every rank (each rank's engine loads its part of them).

    Collective: every rank must exhaust it. After the TP / EP gathers every rank holds its pipeline stage's
    tensors in full; with PP > 1 the stages exchange theirs over the pipeline group (`all_gather_object`, in stage
    order). `times` collects the time of the TP/EP gathers (`gather`) and of that exchange (`transfer`).
    """
    from megatron.core import parallel_state

    times = times or PhaseTimes()
    local = _local_hf_weights(module, model_cfg, padded_vocab, times)
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        yield from local
        return
    yield from _exchange_stages(module, local, times)


def shard_local_hf_weights(
    module: torch.nn.Module, model_cfg: ModelSpec, padded_vocab: int, times: PhaseTimes | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """This rank's tensor-parallel part of every HF tensor, straight from its own megatron-core shards through the
    mapping table (`entry.to_hf` with the rank's head counts): for an engine sharded over the trainer's own TP
    group (`engine.tp_shards` splits heads, query groups, MLP widths and rows as megatron-core does). Needs a
    dense model (the caller checks). No all-gather, except the vocabulary-parallel tensors: megatron-core splits
    the padded vocabulary, the engine the vocabulary itself, so those come whole (the engine slices them). With
    PP > 1 each stage's engine (its TP group) needs every stage's layers: the ranks of one TP rank exchange their
    parts over the pipeline group (`transfer`), so each receives only its own part of the other stages' tensors.
    `times` collects the vocabulary gathers (`gather`) and that exchange."""
    from megatron.core import parallel_state

    times = times or PhaseTimes()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    dims = model_cfg.dims(padded_vocab)
    local = dataclasses.replace(
        dims, num_attention_heads=dims.num_attention_heads // tp, num_query_groups=dims.num_query_groups // tp
    )
    parts = _shard_local_parts(module, model_cfg, dims, local, tp, times)
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        yield from parts
        return
    yield from _exchange_stages(module, parts, times)


def _shard_local_parts(
    module: torch.nn.Module, model_cfg: ModelSpec, dims: Dims, local: Dims, tp: int, times: PhaseTimes
) -> Iterator[tuple[str, torch.Tensor]]:
    """This stage's part of `shard_local_hf_weights`."""
    for step in _plan(module, model_cfg):
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


def buckets(stream: Iterable[tuple[str, torch.Tensor]], limit_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group a stream of named tensors into lists of at most `limit_bytes` (a larger tensor forms its own list)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in stream:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > limit_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket
