"""Primitives on a live megatron-core model that the bridge's load and export (and the GRPO refit) share.

- Names: a `GPTModel`'s parameters and persistent buffers (`model_tensors`) in the mapping table's terms
  (`table_names`: megatron-core's own checkpoint key map of each layer spec and the global layer number).
- Tensor parallelism: one parameter's TP shards all-gathered and assembled by its table entry's parallel style
  (`gather_tp`, one `all_gather_into_tensor`; `assemble_shards` is the pure inverse of megatron-core's sharding).
- megatron-core's `DistributedDataParallel` with the overlapped parameter all-gather: completing it before the
  weights are read (`finish_param_gather`).
- `buckets`: a stream of named tensors in lists of bounded size.

The caller has initialised megatron-core's `parallel_state`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from hf_mcore_bridge.checkpoint.names import LAYER
from hf_mcore_bridge.models.parallel_style import Parallel


def assemble_shards(shards: list[torch.Tensor], parallel: Parallel, parts: tuple[int, ...] = ()) -> torch.Tensor:
    """The global tensor from the TP shards in rank order (pure; the inverse of megatron-core's sharding). `parts`:
    the row counts of a tensor of several parts (`Parallel.COLUMN_PARTS`, each rank holding its rows of each)."""
    if parallel is Parallel.REPLICATED or (len(shards) == 1 and parallel is not Parallel.GATED_COLUMN):
        return shards[0]
    if parallel is Parallel.COLUMN_PARTS:
        tp = len(shards)
        if not parts or any(rows % tp for rows in parts):
            raise ValueError(f"parts {parts} do not split over {tp} ranks")
        pieces = [shard.split([rows // tp for rows in parts]) for shard in shards]
        return torch.cat([pieces[rank][part] for part in range(len(parts)) for rank in range(tp)], dim=0)
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


def gather_tp(
    local: torch.Tensor, parallel: Parallel, expert: bool = False, parts: tuple[int, ...] = ()
) -> torch.Tensor:
    """All-gather one parameter over this rank's TP group (the expert-TP group for a routed expert's weight) and
    assemble it (collective over that group; `parts` as `assemble_shards`). One `all_gather_into_tensor`; a
    column-parallel tensor is then a view of the gathered buffer, with no further copy."""
    import torch.distributed as dist

    if not tp_gathers(parallel, expert):
        return local.detach()
    size, group = _tp_group(expert)
    gathered = local.new_empty((size * local.shape[0], *local.shape[1:]))  # the shards one after another
    dist.all_gather_into_tensor(gathered, local.detach().contiguous(), group=group)
    if parallel in (Parallel.COLUMN, Parallel.VOCAB):
        return gathered
    return assemble_shards(list(gathered.chunk(size, dim=0)), parallel, parts)


def tp_gathers(parallel: Parallel, expert: bool = False) -> bool:
    """Whether `gather_tp` communicates for a tensor of this style on this rank."""
    return parallel is not Parallel.REPLICATED and _tp_group(expert)[0] > 1


def model_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A module's parameters and persistent buffers by local name: what the mapping table covers (megatron-core
    keeps the router's `expert_bias` as a buffer). LoRA adapters (`megatron.lora`) are no table's: left out (a
    stream of the merged weights is made inside `megatron.lora.merged`)."""
    from hf_mcore_bridge.megatron.lora import LinearAdapters

    saved = set(module.state_dict())
    adapters = {id(p) for m in module.modules() if isinstance(m, LinearAdapters) for p in m.parameters()}
    buffers = {name: buffer for name, buffer in module.named_buffers() if name in saved}
    params = {name: p for name, p in module.named_parameters() if id(p) not in adapters}
    return {**params, **buffers}


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
