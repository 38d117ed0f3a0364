"""Refit: the trained policy's weights, gathered over TP (and PP), streamed as HF-named tensors into the engine.

The stream is built from the SAME mapping table as conversion and export (`model_plan.placed_entries`, then
`entry.to_hf`), so refit cannot drift from the checkpoint converters. Each parameter of the local-spec
`GPTModel` is named in the table's terms by megatron-core's own key map (`sharded_state_dict_keys_map` of the
layer spec, the one its checkpoints use) and its global layer number; its TP shards are all-gathered by the
entry's parallel style (`gather_tp`, the inverse of `tensor_ops.shard_boxes`).

Checks, cheap by design: `checksums` of a few sampled HF tensors on the trainer side and as the engine holds
them after loading (float64 sums), compared by the caller.

Simplifications: every rank of a TP group gathers (the engine sits on global rank 0); with PP > 1 the other
stages' HF tensors reach rank 0 as pickled objects (`gather_object`), fine for small models, not for large ones;
data-parallel replicas are not deduplicated (DP is 1 in these worlds); MoE expert tensors are not handled.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from hf_mcore_bridge.config_bridge import ModelConfig
from hf_mcore_bridge.mapping_types import LAYER, Entry
from hf_mcore_bridge.mappings import get_architecture
from hf_mcore_bridge.model_plan import placed_entries
from hf_mcore_bridge.parallel_style import Parallel

__all__ = ["assemble_shards", "checksum", "checksums", "engine_tensor", "gather_tp", "hf_weights", "table_names"]


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


def gather_tp(local: torch.Tensor, parallel: Parallel) -> torch.Tensor:
    """All-gather one parameter over this rank's TP group and assemble it (collective over the TP group)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    size = parallel_state.get_tensor_model_parallel_world_size()
    if parallel is Parallel.REPLICATED or size == 1:
        return local.detach()
    shards = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(shards, local.detach().contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return assemble_shards(shards, parallel)


def table_names(module: torch.nn.Module) -> dict[str, tuple[str, int | None]]:
    """Local parameter name -> (table template name, global layer index or None) for a local-spec `GPTModel`."""
    names: dict[str, tuple[str, int | None]] = {}
    layers = module.decoder.layers if hasattr(module, "decoder") else []
    for name, _ in module.named_parameters():
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


def _local_hf_weights(
    module: torch.nn.Module, model_cfg: ModelConfig, padded_vocab: int
) -> Iterator[tuple[str, torch.Tensor]]:
    arch = get_architecture(model_cfg.architecture)
    if model_cfg.moe is not None:
        raise NotImplementedError("refit of mixture-of-experts policies is not implemented yet")
    dims = model_cfg.dims(padded_vocab)
    params = dict(module.named_parameters())
    by_template: dict[tuple[str, int | None], str] = {v: k for k, v in table_names(module).items()}
    for placed in placed_entries(arch, model_cfg):
        local_name = by_template.get((placed.template.mcore, placed.layer))
        if local_name is None:
            continue  # another pipeline stage holds it
        entry: Entry = placed.entry
        full = gather_tp(params[local_name], entry.parallel)
        yield from entry.to_hf(full, dims).items()


def hf_weights(
    module: torch.nn.Module, model_cfg: ModelConfig, padded_vocab: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """The whole model as (HF name, full tensor), on global rank 0; other ranks yield nothing.

    Collective: every rank must exhaust it.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    local = _local_hf_weights(module, model_cfg, padded_vocab)
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        if dist.get_rank() == 0:
            yield from local
        else:
            for _ in local:  # take part in the TP gathers
                pass
        return
    mine = [(n, t.clone()) for n, t in local] if parallel_state.get_tensor_model_parallel_rank() == 0 else []
    gathered: list[list[tuple[str, torch.Tensor]]] | None = [[] for _ in range(dist.get_world_size())]
    dist.gather_object(mine, gathered if dist.get_rank() == 0 else None, dst=0)
    if dist.get_rank() == 0 and gathered is not None:
        for part in gathered:
            yield from part


def engine_tensor(engine: object, hf_name: str) -> torch.Tensor:
    """The tensor the embedded engine holds for one HF name (a slice of a fused parameter where fused)."""
    return engine.model.hf_view(hf_name)  # type: ignore[attr-defined]


def checksum(tensor: torch.Tensor) -> float:
    """A position-weighted float64 sum (weights cycle 1..8 over the flattened tensor): cheap, and unlike a plain
    sum it changes when values are permuted (a transposed or mis-split tensor), not only when they change."""
    flat = tensor.detach().double().flatten()
    weights = torch.arange(flat.numel(), dtype=torch.float64, device=flat.device) % 8 + 1
    return float((flat * weights).sum())


def checksums(tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
    """`checksum` per named tensor."""
    return {name: checksum(tensor) for name, tensor in tensors}


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
