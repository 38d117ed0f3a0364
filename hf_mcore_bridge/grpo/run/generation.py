"""The trainer's rollout engine: the embedded engine, or vLLM behind the same calls (`generation.backend`).

`build_engine` makes the configured one on every rank: the world's ranks form engine replicas of
`generation.tensor_parallel_size` consecutive ranks each (`EngineReplicas`), sharded over megatron-core's (or the
DTensor mesh's) tensor-parallel group where that is the same set of ranks, else over a group made for it. Each
replica generates the rollouts of its share of the step's prompts (`prompt_share`: whole prompts, so whole
groups); a prompt's samples draw the random numbers of its index in the whole step (`first_index`), so rollouts do
not depend on the number of replicas. Both take text prompts, return `RequestOutput`s with each sample's text, hand
each sample to an `on_sample` callback (the embedded engine as soon as the sample is finished, vLLM when its batch
is), take refits through `load_weights` (HF names, full tensors) and are checked after each refit.

- `embedded`: `hf_mcore_bridge.engine.Engine`, with the run's tokenizer; its weights come only from refits.
- `vllm`: one `VllmEngine` per replica (needs vLLM and a GPU; in a world of several ranks through vLLM's
  `external_launcher` executor, one vLLM worker in each rank's process, at the replica's TP with one vLLM
  data-parallel rank per replica; untested against vLLM itself), started on a directory holding the HF config and
  tokenizer and vLLM's `load_format="dummy"`, so its weights, too, come only from refits (through vLLM's own
  `load_weights`).
  vLLM does not tokenize here (`skip_tokenizer_init`): prompts go in as the run tokenizer's ids and completions are
  decoded by it, so both backends see the same tokens. vLLM's parameters are not readable the way the embedded
  engine's are (its own fused, sharded layout), so its refits get no per-tensor check (`readable_tensor` and
  `engine_tensor_names` return None); the log-prob gate (`logprob_gate`: each step's rollouts and the probe
  prompt, engine vs trainer) covers both backends alike.

vLLM is not installed on this project's machines: the `vllm` path is exercised by its wiring test and the gate's
test with vLLM's engine replaced by the embedded one, never against vLLM itself.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "VLLM_MODEL_DIR",
    "EngineReplicas",
    "VllmGeneration",
    "build_engine",
    "engine_part",
    "engine_replicas",
    "engine_tensor_names",
    "prompt_share",
    "readable_tensor",
    "request_seed",
]

VLLM_MODEL_DIR = "vllm_model"
"""The directory (in the run's log directory) vLLM is started on: config and tokenizer, no weights."""


class VllmGeneration:
    """`VllmEngine` with the run's tokenizer on both sides of `generate`."""

    def __init__(self, engine: Any, tokenizer: Any) -> None:
        self.engine, self.tokenizer = engine, tokenizer

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: Any,
        first_index: int | None = None,
        on_sample: Callable[[int, Any], None] | None = None,
    ) -> list[Any]:
        """As `Engine.generate`. vLLM draws per request from the request's own seed, so with `first_index` given a
        seeded `params` becomes one seed per prompt from (seed, `first_index + i`): the same samples however the
        prompts are split over replicas. `on_sample` sees every sample, in prompt order, once vLLM's `generate` has
        returned them all (it returns a batch at once: nothing to overlap)."""
        ids = [list(self.tokenizer.encode(p).ids) if isinstance(p, str) else list(p) for p in prompts]
        if first_index is not None and getattr(params, "seed", None) is not None:
            params = [
                dataclasses.replace(params, seed=request_seed(params.seed, first_index + i)) for i in range(len(ids))
            ]
        outputs = [
            dataclasses.replace(
                out,
                samples=[dataclasses.replace(s, text=self.tokenizer.decode(list(s.token_ids))) for s in out.samples],
            )
            for out in self.engine.generate(ids, params)
        ]
        if on_sample is not None:
            for i, out in enumerate(outputs):
                for sample in out.samples:
                    on_sample(i, sample)
        return outputs

    def load_weights(self, weights: Any) -> Any:
        return self.engine.load_weights(weights)


def request_seed(seed: int, index: int) -> int:
    """The seed of request `index` of a batch seeded with `seed` (non-negative, below 2**63)."""
    return (seed * 1_000_003 + index) % (1 << 63)


@dataclass(frozen=True)
class EngineReplicas:
    """How the world's ranks form engine replicas: `size` replicas of `tp` consecutive ranks; this rank is rank
    `tp_rank` of replica `replica`, whose ranks share `group` (None at TP 1: no collective)."""

    tp: int
    size: int
    replica: int
    tp_rank: int
    group: Any
    shared: bool
    """Whether `group` is the trainer's own tensor-parallel group (the same ranks)."""


def engine_replicas(tp: int, trainer_group: Any) -> EngineReplicas:
    """This rank's engine replica (collective once: every rank must call it). The trainer's tensor-parallel group
    is used where on every rank it holds exactly the replica's ranks; otherwise every replica gets a new group
    (all ranks create all of them, as `new_group` requires)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if tp < 1 or world % tp:
        raise ValueError(f"generation.tensor_parallel_size={tp} must divide the world's {world} ranks")
    replica, tp_rank = divmod(rank, tp)
    if tp == 1:
        return EngineReplicas(1, world, replica, 0, None, False)
    mine = list(range(replica * tp, (replica + 1) * tp))
    same = trainer_group is not None and dist.get_process_group_ranks(trainer_group) == mine
    agree = torch.tensor([int(same)])
    if dist.get_backend() == "nccl":
        agree = agree.cuda()
    dist.all_reduce(agree, op=dist.ReduceOp.MIN)
    if int(agree.item()):
        return EngineReplicas(tp, world // tp, replica, tp_rank, trainer_group, True)
    group = None
    for first in range(0, world, tp):
        made = dist.new_group(list(range(first, first + tp)))
        if first == replica * tp:
            group = made
    return EngineReplicas(tp, world // tp, replica, tp_rank, group, False)


def prompt_share(count: int, replicas: int, replica: int) -> tuple[int, int]:
    """[start, end) of the prompts replica `replica` of `replicas` generates: consecutive, whole prompts (so whole
    groups), sizes differing by at most one."""
    base, extra = divmod(count, replicas)
    start = replica * base + min(replica, extra)
    return start, start + base + (replica < extra)


def build_engine(
    backend: str, hf_config: dict[str, Any], engine_config: Any, tokenizer: Any, log_dir: Path, tp_group: Any = None
) -> Any:
    """The rollout engine of `generation.backend` (`embedded` or `vllm`), without weights until the first refit;
    `tp_group`: the replica's tensor-parallel group (None: one rank)."""
    if backend == "embedded":
        from hf_mcore_bridge.engine import Engine

        return Engine(hf_config, engine_config, tokenizer=tokenizer, tp_group=tp_group)
    if backend != "vllm":
        raise ValueError(f"unknown generation backend {backend!r}")
    from hf_mcore_bridge.engine import VllmEngine

    model_dir = log_dir / VLLM_MODEL_DIR
    if not dist.is_initialized() or dist.get_rank() == 0:  # one writer; the log directory is shared storage
        model_dir.mkdir(parents=True, exist_ok=True)
        (model_dir / "config.json").write_text(json.dumps(hf_config, indent=2))
        tokenizer.save(str(model_dir / "tokenizer.json"))
    if dist.is_initialized():
        dist.barrier()
    world = dist.get_world_size() if dist.is_initialized() else 1
    tp = 1 if tp_group is None else dist.get_world_size(tp_group)
    extra: dict[str, Any] = {}
    if world > 1:
        # every rank runs one vLLM worker in its own process over the ranks' torch.distributed world as it is
        # (vLLM's `external_launcher`: its TP x DP must be that world; each DP rank is a replica fed its own prompts)
        extra = {"tensor_parallel_size": tp, "distributed_executor_backend": "external_launcher"}
        if world > tp:
            extra["data_parallel_size"] = world // tp
    engine = VllmEngine(model_dir, engine_config, load_format="dummy", skip_tokenizer_init=True, **extra)
    return VllmGeneration(engine, tokenizer)


def engine_part(engine: Any, hf_name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The part of a streamed HF tensor this rank's engine keeps by its own slicing (its tensor-parallel shard of a
    full tensor; a tensor already of the part's size, as a shard-local refit streams it, or any tensor at TP 1 or
    where the engine does not say, as it is). Not the refit check's reference, which must not come from the
    engine's slicing (`refit.reference`); for comparing the engine with that reference in tests."""
    target = getattr(getattr(engine, "model", None), "targets", {}).get(hf_name)
    shard = getattr(target, "shard", None)
    if shard is None or shard.size == shard.full or tensor.dim() <= shard.dim or tensor.shape[shard.dim] != shard.full:
        return tensor
    return shard.take(tensor, hf_name)


def readable_tensor(engine: Any, hf_name: str) -> torch.Tensor | None:
    """The tensor an engine holds for one HF name, where it can be read (the embedded engine, a name it holds);
    else None."""
    names = engine_tensor_names(engine)
    return engine.model.hf_view(hf_name) if names is not None and hf_name in names else None


def engine_tensor_names(engine: Any) -> AbstractSet[str] | None:
    """Every HF name whose tensor the engine holds (the embedded engine; a view, not a copy), or None where it
    does not say."""
    model = getattr(engine, "model", None)
    targets = getattr(model, "targets", None)
    return targets.keys() if hasattr(model, "hf_view") and targets is not None else None
