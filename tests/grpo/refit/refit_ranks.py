"""Rank functions for the refit-check tests: a GRPO rank with its refit deliberately broken, and a DP2 world for the
deferred parameter all-gather. They run in spawned processes, so each applies its patches inside the rank.

Corruptions touch the refit's stream only (the bridge's `export.export_hf_weights`, which the megatron backend
streams, and `refit.stream.shard_local_hf_weights`, after the mapping table's `to_hf`), its recording, one rank's
engine copy right after loading (`rank1_copy`), or the engine's own slicing (`engine_head_shift`,
`engine_kv_wrong_rank`: `shifted_head_shard`, `kv_on_wrong_rank`, also used in-process by `test_reference.py`); the
trainer's model and its checkpoint are untouched.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

DOWN = "model.layers.1.mlp.down_proj.weight"


def varied_reward(completion: str, answer: str) -> float:
    """Rewards that differ within a group, so the first step moves the weights (a stale copy then differs)."""
    return float(sum(map(ord, completion)) % 5)


def varied_reward_on_odd_answers(completion: str, answer: str) -> float:
    """`varied_reward` for prompts whose answer is an odd digit, 0 for the others: groups of even answers have no
    reward variance (dynamic sampling drops them)."""
    return varied_reward(completion, answer) if int(answer) % 2 else 0.0


def _corrupt(
    stream: Iterator[tuple[str, torch.Tensor]], kinds: set[str], hf_config: dict[str, Any]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream with each fault of `kinds` (`grpo.refit.faults`: q/k and gate/up in layer 1, experts in the first
    MoE layer)."""
    from hf_mcore_bridge.grpo.refit.faults import FAULTS, inject

    for kind in sorted(kinds & set(FAULTS)):  # the others (`stale_...`, `rank1_copy`) break something else
        stream = inject(stream, kind, hf_config)
    return stream


def _recordable(monkeypatch_target: Any) -> None:
    """Let the refit be recorded on CPU (it needs no collective at world size 1; only CUDA is assumed away)."""
    monkeypatch_target.refit_sources = lambda self: list(self.policy.module.parameters())


class _StaleEngineCopy:
    """A recording whose replay copies the engine's weights from a stale buffer (those of the refit before)."""

    def __init__(self, engine_model: Any, fn: Any) -> None:
        self.stale = {n: p.detach().clone() for n, p in engine_model.named_parameters()}
        self.model = engine_model
        self.sent = fn()  # the capture's stand-in: the stream and its checksums as recorded

    def replay(self) -> None:
        for name, param in self.model.named_parameters():
            param.data.copy_(self.stale[name])


class _StaleSources:
    """A recording that read a stale copy of the trainer's weights (the initial ones); its replay runs nothing."""

    def __init__(self, params: list[torch.nn.Parameter], stale: list[torch.Tensor], fn: Any) -> None:
        fresh = [p.data for p in params]
        for param, old in zip(params, stale, strict=True):
            param.data = old
        try:
            self.sent = fn()
        finally:
            for param, new in zip(params, fresh, strict=True):
                param.data = new

    def replay(self) -> None:
        pass


def shifted_head_shard(original: Any) -> Any:
    """The engine's `head_shard` with every rank's block of query heads shifted by one head (rank 0's forward, the
    others' back, so each stays inside the tensor): a wrong head split, the same in the engine's load and in its
    `Target.shard`. Every rank is wrong, so each fails its own check (none waits on a collective a failed one left)."""

    def head_shard(num_heads: int, head_dim: int, tp: Any, dim: int = 0) -> Any:
        shard = original(num_heads, head_dim, tp, dim)
        return dataclasses.replace(shard, start=shard.start + (head_dim if tp.rank == 0 else -head_dim))

    return head_shard


def kv_on_wrong_rank(original: Any) -> Any:
    """The engine's `kv_shard` giving every rank the KV heads of the rank half the group away (at TP2 the two
    ranks' KV groups exchanged; at TP4 with two KV heads, ranks 0 and 1 given head 1 and ranks 2 and 3 head 0):
    KV groups replicated to the wrong ranks."""
    from hf_mcore_bridge.engine.tp_shards import TPRank

    def kv_shard(num_kv_heads: int, head_dim: int, tp: Any) -> Any:
        return original(num_kv_heads, head_dim, TPRank(tp.size, (tp.rank + tp.size // 2) % tp.size))

    return kv_shard


ENGINE_SLICING = {
    "engine_head_shift": ("head_shard", shifted_head_shard),
    "engine_kv_wrong_rank": ("kv_shard", kv_on_wrong_rank),
}
"""Corruption kind -> (the engine model's slicing function replaced, its replacement's factory)."""


def corrupted_rank(kind: str, config: Any, prepared: Any) -> None:
    """`trainer._train_rank` with the refit broken as `kind` says: `qk`, `gate_up`, `experts` (the stream; joined
    by `+` for several), `later_...` (the same from the second refit on: the first step's rollouts are sound),
    `stale_engine`, `stale_sources` (the recording), `vllm_qk` (`qk` behind a vLLM engine replaced by the
    embedded one, whose tensors `readable_tensor` cannot read), `engine_head_shift`, `engine_kv_wrong_rank` (the
    engine's own slicing, `ENGINE_SLICING`; the stream is sound)."""
    import hf_mcore_bridge.engine
    from hf_mcore_bridge.bridge import export
    from hf_mcore_bridge.engine import model as engine_model
    from hf_mcore_bridge.grpo.backends.megatron import backend
    from hf_mcore_bridge.grpo.refit import stream as refit
    from hf_mcore_bridge.grpo.refit.replay import RefitReplay
    from hf_mcore_bridge.grpo.run import trainer

    if kind in ENGINE_SLICING:
        function, mutated = ENGINE_SLICING[kind]
        setattr(engine_model, function, mutated(getattr(engine_model, function)))
        trainer._train_rank(config, prepared)
        return

    kinds = set(kind.removeprefix("vllm_").removeprefix("later_").split("+"))
    refits = [0]

    def corrupting(original: Any) -> Any:
        def corrupted(*args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
            refits[0] += 1
            later = kind.startswith("later_") and refits[0] == 1  # `later_`: the initial refit is left intact
            stream = original(*args, **kwargs)
            return stream if later else _corrupt(stream, kinds, prepared.hf_config)

        return corrupted

    # both streams: full tensors, and each rank's own parts (an engine sharded over the trainer's TP group)
    export.export_hf_weights = corrupting(export.export_hf_weights)
    refit.shard_local_hf_weights = corrupting(refit.shard_local_hf_weights)
    if kind == "vllm_qk":
        hf_mcore_bridge.engine.VllmEngine = _EmbeddedAsVllm
    if kind.startswith("stale_"):
        _recordable(backend.MegatronBackend)
        built: dict[str, Any] = {}
        build_backend = trainer.build_backend

        def keep(*args: Any) -> Any:
            built["policy"] = build_backend(*args)
            params = list(built["policy"].policy.module.parameters())
            built["initial"] = [p.detach().clone() for p in params]
            return built["policy"]

        trainer.build_backend = keep
        init = trainer._RankContext.__init__

        def with_stale_recorder(ctx: Any, *args: Any) -> None:
            init(ctx, *args)

            def record(fn: Any) -> tuple[Any, Any]:
                if kind == "stale_engine":
                    recording: Any = _StaleEngineCopy(ctx.engine.model, fn)
                else:
                    params = list(built["policy"].policy.module.parameters())
                    recording = _StaleSources(params, built["initial"], fn)
                return recording, recording.sent

            ctx.refit_replay = RefitReplay(recorder=record)

        trainer._RankContext.__init__ = with_stale_recorder
    if kind == "rank1_copy":
        _break_rank1_copy(trainer)
    trainer._train_rank(config, prepared)


def _break_rank1_copy(trainer: Any) -> None:
    """On rank 1 only: one element of the engine's part of `DOWN` changed right after it is loaded (a copy gone
    wrong on a rank other than 0, where the transfer check must run too)."""
    import torch.distributed as dist

    init = trainer._RankContext.__init__

    def with_bad_copy(ctx: Any, *args: Any) -> None:
        init(ctx, *args)
        if dist.get_rank() != 1:
            return
        load = ctx.engine.load_weights

        def load_badly(weights: Any, *more: Any, **kw: Any) -> Any:
            weights = list(weights)
            done = load(weights, *more, **kw)
            if any(name == DOWN for name, _ in weights):
                ctx.engine.model.hf_view(DOWN)[0, 0] += 1e-3
            return done

        ctx.engine.load_weights = load_badly

    trainer._RankContext.__init__ = with_bad_copy


class _EmbeddedAsVllm:
    """Stands in for `VllmEngine` (vLLM is not installed here): the embedded engine, taking and giving token ids."""

    def __init__(self, model_dir: Path, config: Any, **_: Any) -> None:
        from hf_mcore_bridge.engine import Engine

        self._engine = Engine(json.loads((Path(model_dir) / "config.json").read_text()), config, tokenizer=None)

    def generate(self, prompts: Any, params: Any) -> Any:
        return self._engine.generate(prompts, params)

    def load_weights(self, weights: Any) -> Any:
        return self._engine.load_weights(weights)


def param_gather_rank(checkpoint_dir: str, out_file: str) -> None:
    """DP2: megatron-core's DDP with the distributed optimizer's buffers and `overlap_param_gather`, after a step
    that (as the distributed optimizer's does) updated only this rank's shard of the parameter buffer. Rank 0
    saves whether the refit stream equals the post-step weights (set directly, no gather) without and with
    `finish_param_gather` (as the megatron backend's `hf_weights` runs it)."""
    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    from hf_mcore_bridge.bridge.export import export_hf_weights
    from hf_mcore_bridge.checkpoint.megatron_dirs import read_common
    from hf_mcore_bridge.convert.config_bridge import from_megatron_args
    from hf_mcore_bridge.convert.layout import Layout
    from hf_mcore_bridge.grpo.backends.megatron.backend import MegatronBackend
    from hf_mcore_bridge.grpo.backends.megatron.policy import Policy
    from hf_mcore_bridge.megatron.model import build_gpt_model, load_distributed_checkpoint
    from hf_mcore_bridge.megatron.world import device

    args = read_common(Path(checkpoint_dir))["args"]
    model_cfg = from_megatron_args(args)
    gpt = build_gpt_model(model_cfg, Layout(), torch.float32, args.padded_vocab_size, device=device())
    load_distributed_checkpoint(gpt, Path(checkpoint_dir))
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_param_gather=True)
    model = DistributedDataParallel(config=gpt.config, ddp_config=ddp_config, module=gpt)
    size, rank = dist.get_world_size(), dist.get_rank()
    buffers = [bucket.param_data for group in model.bucket_groups for bucket in group.buckets]
    expected = []
    for buffer in buffers:  # the post-step weights: every rank's shard moved by its own step
        full = buffer.clone()
        for r, shard in enumerate(shard_buffer(full, size)):
            shard.add_(0.5 * (r + 1))
        expected.append(full)
        shard_buffer(buffer, size)[rank].add_(0.5 * (rank + 1))  # this rank's step

    def stream() -> list[tuple[str, torch.Tensor]]:
        return [(name, tensor.clone()) for name, tensor in export_hf_weights([gpt], model_cfg)]

    stale = stream()
    # the trainer's refit stream: the megatron backend's `hf_weights`, which runs `finish_param_gather` first
    policy = Policy(model, None, None, model_cfg, args.padded_vocab_size, torch.float32)
    backend = MegatronBackend(policy, None, None, {})  # type: ignore[arg-type]  # section, layout: not read here
    fresh = [(name, tensor.clone()) for name, tensor in backend.hf_weights()]
    gathered = all(torch.equal(b, e) for b, e in zip(buffers, expected, strict=True))
    for buffer, full in zip(buffers, expected, strict=True):
        buffer.copy_(full)
    direct = stream()

    def same(a: list[tuple[str, torch.Tensor]], b: list[tuple[str, torch.Tensor]]) -> bool:
        if [n for n, _ in a] != [n for n, _ in b]:
            return False
        return all(torch.equal(x, y) for (_, x), (_, y) in zip(a, b, strict=True))

    if rank == 0:
        torch.save(
            {"tensors": len(direct), "gathered": gathered, "stale": same(stale, direct), "fresh": same(fresh, direct)},
            out_file,
        )


def shard_local_rank(hf_dirs: list[str], out_file: str) -> None:
    """TP2, random megatron-core weights per architecture: the shard-local stream (each rank's own shards through
    the table) against the engine's own slices (`tp_shards`) of the gathered full tensors and against the refit
    check's reference cut on the trainer's side (`refit.reference`), and an engine loaded from it with
    `parts=True`. Rank 0 saves, per directory, the comparison's counts."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from hf_mcore_bridge.bridge.export import export_hf_weights
    from hf_mcore_bridge.convert.config_bridge import megatron_spec, padded_vocab
    from hf_mcore_bridge.convert.layout import Layout
    from hf_mcore_bridge.engine import Engine, EngineConfig
    from hf_mcore_bridge.grpo.refit.reference import EnginePartReference
    from hf_mcore_bridge.grpo.refit.stream import shard_local_hf_weights
    from hf_mcore_bridge.grpo.run.generation import engine_part
    from hf_mcore_bridge.megatron.model import build_gpt_model

    results = {}
    for directory in hf_dirs:
        hf_config = json.loads((Path(directory) / "config.json").read_text())
        model_cfg = megatron_spec(hf_config)
        layout = Layout(tp=2)
        vocab = padded_vocab(model_cfg, layout)
        torch.manual_seed(0)
        gpt = build_gpt_model(model_cfg, layout, torch.float32, vocab, device=torch.device("cpu"))
        full = {name: tensor.clone() for name, tensor in export_hf_weights([gpt], model_cfg)}
        parts = [(name, tensor.clone()) for name, tensor in shard_local_hf_weights(gpt, model_cfg, vocab)]
        config = EngineConfig(dtype=torch.float32, device="cpu", max_num_seqs=2, max_model_len=32)
        engine = Engine(hf_config, config, tp_group=parallel_state.get_tensor_model_parallel_group())
        wanted = {name: engine_part(engine, name, tensor) for name, tensor in full.items()}
        equal = [torch.equal(engine_part(engine, name, part), wanted[name]) for name, part in parts]
        reference = EnginePartReference(model_cfg, 2, parallel_state.get_tensor_model_parallel_rank())
        # megatron-core's own TP2 shards (in HF terms) against the reference cut from the gathered tensors, summed
        # over both ranks
        split = [(name, part) for name, part in parts if part.shape != full[name].shape]
        same = sum(torch.equal(reference.part(name, full[name]), part) for name, part in split)
        cut = torch.tensor([same, len(split)])
        dist.all_reduce(cut)
        whole = sorted(name for name, part in parts if part.shape == full[name].shape)
        engine.load_weights(parts, parts=True)
        held = [torch.equal(engine.model.hf_view(name), wanted[name]) for name in engine.model.targets]
        results[Path(directory).name] = {
            "same_names": [n for n, _ in parts] == list(full),
            "equal": sum(equal),
            "reference_equal": int(cut[0]),
            "reference_count": int(cut[1]),
            "count": len(parts),
            "whole": whole,
            "names": sorted(full),
            "engine_equal": sum(held),
            "engine_count": len(held),
        }
    if dist.get_rank() == 0:
        torch.save(results, out_file)
