"""The run's plan (`run.plan`): the parallel dimensions read from the config, the refit path, the engine's config
derived from the generation section, the check of the engine replicas a rank forms against the plan, and the plan
`prepare_run` hands to the ranks. Expected values are written here from the config each test builds."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from hf_mcore_bridge.convert.config_bridge import megatron_spec
from hf_mcore_bridge.convert.layout import Layout
from hf_mcore_bridge.engine import EngineConfig
from hf_mcore_bridge.errors import BridgeError
from hf_mcore_bridge.grpo.run.config import config_from_dict
from hf_mcore_bridge.grpo.run.plan import (
    Backend,
    RefitPath,
    RunPlan,
    engine_config,
    parallel_dims,
    refit_path,
)
from hf_mcore_bridge.models.tiny_models import tiny_config

from ..tiny_policy import build_tiny_policy

BASE: dict[str, Any] = {"policy": {"model_path": "/some/model"}, "data": {"task": "repeat_digit"}}
DTENSOR = ["policy.megatron_cfg.enabled=false", "policy.dtensor_cfg.enabled=true"]
DENSE = megatron_spec(tiny_config("LlamaForCausalLM"))
MOE = megatron_spec(tiny_config("Qwen3MoeForCausalLM"))


def test_megatron_dims_are_the_sections_sizes_over_the_clusters_ranks() -> None:
    config = config_from_dict(
        BASE,
        [
            "cluster.gpus_per_node=8",
            "policy.megatron_cfg.tensor_model_parallel_size=2",
            "policy.megatron_cfg.pipeline_model_parallel_size=2",
        ],
    )
    dims = parallel_dims(config)
    assert dims.backend is Backend.MEGATRON
    assert dims.layout == Layout(tp=2, pp=2)
    assert (dims.world, dims.dp, dims.tp, dims.pp, dims.cp, dims.ep) == (8, 2, 2, 2, 1, 1)
    assert (dims.engine_tp, dims.engine_replicas) == (2, 4)  # the engine's TP follows the policy's


def test_dtensor_dims_derive_the_shard_size_from_the_clusters_ranks() -> None:
    config = config_from_dict(BASE, [*DTENSOR, "cluster.gpus_per_node=4", "policy.dtensor_cfg.tensor_parallel_size=2"])
    dims = parallel_dims(config)
    assert dims.backend is Backend.DTENSOR
    assert (dims.world, dims.dp, dims.tp, dims.pp) == (4, 2, 2, 1)
    alone = parallel_dims(config_from_dict(BASE, [*DTENSOR, "generation.tensor_parallel_size=1"]))
    assert (alone.world, alone.dp, alone.engine_tp, alone.engine_replicas) == (1, 1, 1, 1)


def _dims(overrides: list[str]) -> Any:
    return parallel_dims(config_from_dict(BASE, ["cluster.gpus_per_node=2", *overrides]))


TP2 = ["policy.megatron_cfg.tensor_model_parallel_size=2"]


@pytest.mark.parametrize(
    ("overrides", "model", "backend", "expected"),
    [
        (TP2, DENSE, "embedded", RefitPath.SHARD_LOCAL),
        ([], DENSE, "embedded", RefitPath.FULL),  # TP 1: nothing to keep local
        (TP2, MOE, "embedded", RefitPath.FULL),  # experts are streamed whole
        (TP2, DENSE, "vllm", RefitPath.FULL),  # vLLM takes full tensors
        ([*TP2, "generation.tensor_parallel_size=1"], DENSE, "embedded", RefitPath.FULL),  # another engine TP
        ([*DTENSOR, "policy.dtensor_cfg.tensor_parallel_size=2"], DENSE, "embedded", RefitPath.FULL),  # FSDP2 shards
    ],
    ids=["tp2-dense", "tp1", "moe", "vllm", "engine-tp1", "dtensor"],
)
def test_the_refit_is_shard_local_only_where_the_engine_is_the_trainers_tp_group(
    overrides: list[str], model: Any, backend: str, expected: RefitPath
) -> None:
    assert refit_path(_dims(overrides), model, backend) is expected


def test_the_engine_config_is_the_generation_section_with_what_the_trainer_adds() -> None:
    config = config_from_dict(
        BASE,
        [
            "policy.dtype=bf16",
            "grpo.num_prompts_per_step=3",
            "grpo.num_generations_per_prompt=5",
            "grpo.val_num_prompts=4",
            "grpo.val_num_generations=2",
            "generation.max_model_len=300",
            "generation.kv_cache_memory_bytes=12345678",
            "generation.decode_attention=gather",
            "generation.flex_min_batch=7",
            "generation.torch_compile=false",
            "generation.precision=fp8",
            "generation.kv_cache_dtype=fp8",
            "generation.kv_cache_scale=0.5",
        ],
    )
    engine = engine_config(config, "cpu")
    assert engine == EngineConfig(
        dtype=torch.bfloat16,
        device="cpu",
        max_num_seqs=15,  # the step's 3 x 5 samples (more than validation's 4 x 2)
        max_model_len=300,
        max_num_batched_tokens=8192,
        kv_cache_memory_bytes=12345678,
        use_cuda_graphs=True,
        decode_attention="gather",
        flex_min_batch=7,
        torch_compile=False,
        fp8_weights=True,
        kv_cache_dtype="fp8",
        kv_cache_scale=0.5,
    )
    long = engine_config(config_from_dict(BASE, ["generation.max_model_len=10000"]), "cpu")
    assert (long.max_num_batched_tokens, long.fp8_weights, long.dtype) == (10000, False, torch.float32)


def test_the_engine_takes_exactly_these_generation_keys_by_name() -> None:
    """A generation key named like an engine field is passed through as it is: a new one must be meant to."""
    from hf_mcore_bridge.grpo.run.config import GenerationConfig

    shared = {f.name for f in dataclasses.fields(GenerationConfig)} & {f.name for f in dataclasses.fields(EngineConfig)}
    assert shared == {
        "max_model_len",
        "kv_cache_memory_bytes",
        "decode_attention",
        "flex_min_batch",
        "torch_compile",
        "kv_cache_dtype",
        "kv_cache_scale",
    }


def _replicas(size: int, tp: int, shared: bool) -> SimpleNamespace:
    return SimpleNamespace(size=size, tp=tp, shared=shared)


def test_a_rank_whose_engine_replicas_differ_from_the_plan_is_stopped() -> None:
    dims = _dims(TP2)
    local = RunPlan(dims, RefitPath.SHARD_LOCAL, EngineConfig(device="cpu"))
    local.check_replicas(_replicas(1, 2, shared=True))
    with pytest.raises(BridgeError, match="planned a shard-local refit, but this engine replica's ranks are not"):
        local.check_replicas(_replicas(1, 2, shared=False))
    with pytest.raises(BridgeError, match=r"formed 2 replicas of 1 ranks; the run planned \(1, 2\)"):
        local.check_replicas(_replicas(2, 1, shared=False))
    RunPlan(dims, RefitPath.FULL, EngineConfig(device="cpu")).check_replicas(_replicas(1, 2, shared=False))


def test_prepare_run_hands_the_ranks_the_plan(tmp_path: Path) -> None:
    policy = build_tiny_policy(tmp_path / "policy")
    config = config_from_dict(
        {
            "policy": {"model_path": str(policy), "megatron_cfg": {"tensor_model_parallel_size": 2}},
            "generation": {"max_model_len": 64, "stop_token_ids": [0]},
            "data": {"task": "repeat_digit"},
            "logger": {"log_dir": str(tmp_path / "run")},
        }
    )
    from hf_mcore_bridge.grpo.run.trainer import prepare_run

    plan = prepare_run(config).plan
    assert (plan.dims.layout, plan.dims.world, plan.dims.engine_tp) == (Layout(tp=2), 2, 2)
    assert plan.refit is RefitPath.SHARD_LOCAL  # a dense Llama, the embedded engine at the policy's TP
    assert (plan.engine.max_model_len, plan.engine.dtype) == (64, torch.float32)
    assert plan.engine_on("cpu").device == "cpu"


def test_a_gated_delta_net_model_is_planned_like_any_other() -> None:
    """Qwen3.5 trains (its refusals, sequence and context parallelism, are tested with its GRPO step)."""
    from hf_mcore_bridge.grpo.run.plan import plan_run

    config = config_from_dict(BASE)
    hybrid = megatron_spec(tiny_config("Qwen3_5ForCausalLM"))
    assert plan_run(config, parallel_dims(config), hybrid).dims == plan_run(config, parallel_dims(config), DENSE).dims
