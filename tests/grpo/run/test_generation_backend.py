"""The trainer's rollout engines: the vLLM path's wiring (vLLM itself is not installed here, so its engine is
replaced where noted) and its tokenizer handling against the embedded engine's own."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

import hf_mcore_bridge.engine
from hf_mcore_bridge.engine import Engine, EngineConfig, SamplingParams
from hf_mcore_bridge.grpo.errors import GRPOConfigError
from hf_mcore_bridge.grpo.run.config import config_from_dict
from hf_mcore_bridge.grpo.run.generation import VLLM_MODEL_DIR, VllmGeneration, build_engine, readable_tensor

from ..tiny_policy import build_tiny_policy

CONFIG = EngineConfig(
    dtype=torch.float32, device="cpu", max_num_seqs=8, max_model_len=64, kv_cache_memory_bytes=1 << 20
)


def _engine(policy: Path, tokenizer: Tokenizer | None) -> Engine:
    engine = Engine(json.loads((policy / "config.json").read_text()), CONFIG, tokenizer=tokenizer)
    engine.load_weights(load_file(policy / "model.safetensors").items())
    return engine


def test_vllm_wrapper_tokenizes_and_decodes_as_the_embedded_engine_does(tmp_path: Path) -> None:
    """Prompts go in as the run tokenizer's ids and completions are decoded by it: the same tokens and texts as
    the embedded engine given text (here the engine behind the wrapper is an embedded one without a tokenizer)."""
    policy = build_tiny_policy(tmp_path / "policy", seed=1)
    tokenizer = Tokenizer.from_file(str(policy / "tokenizer.json"))
    prompts = ["Repeat the digit 3 . Answer :", "Say 7 ."]
    params = SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=5, logprobs=True)
    expected = _engine(policy, tokenizer).generate(prompts, params)
    handed: list[tuple[int, Any]] = []
    got = VllmGeneration(_engine(policy, None), tokenizer).generate(
        prompts, params, on_sample=lambda i, sample: handed.append((i, sample))
    )
    # every sample handed over once, as returned (vLLM's batch returns at once: in prompt order, after it)
    assert handed == [(i, sample) for i, out in enumerate(got) for sample in out.samples]
    for want, have in zip(expected, got, strict=True):
        assert have.prompt_token_ids == want.prompt_token_ids
        assert [s.token_ids for s in have.samples] == [s.token_ids for s in want.samples]
        assert [s.text for s in have.samples] == [s.text for s in want.samples]
        assert all(s.text is not None for s in have.samples)


def test_build_engine_starts_vllm_on_config_and_tokenizer_without_weights(tmp_path: Path, monkeypatch) -> None:
    calls: list[dict[str, Any]] = []

    class Recorder:  # stands in for VllmEngine: records how the trainer starts it
        def __init__(self, model_dir: Path, config: EngineConfig, **kwargs: Any) -> None:
            calls.append({"dir": Path(model_dir), "config": config, **kwargs})

    monkeypatch.setattr(hf_mcore_bridge.engine, "VllmEngine", Recorder)
    policy = build_tiny_policy(tmp_path / "policy")
    tokenizer = Tokenizer.from_file(str(policy / "tokenizer.json"))
    hf_config = json.loads((policy / "config.json").read_text())
    engine = build_engine("vllm", hf_config, CONFIG, tokenizer, tmp_path / "logs")
    (call,) = calls
    assert call["dir"] == tmp_path / "logs" / VLLM_MODEL_DIR
    assert json.loads((call["dir"] / "config.json").read_text()) == hf_config
    assert (call["dir"] / "tokenizer.json").is_file() and not list(call["dir"].glob("*.safetensors"))
    assert call["config"] is CONFIG and call["load_format"] == "dummy" and call["skip_tokenizer_init"]
    assert isinstance(engine, VllmGeneration) and readable_tensor(engine, "model.norm.weight") is None
    embedded = build_engine("embedded", hf_config, CONFIG, tokenizer, tmp_path / "logs")
    assert readable_tensor(embedded, "model.norm.weight") is not None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["generation.backend=vllm", "generation.top_p=0.9"], "top_p=1 and top_k=0"),
        (["generation.backend=vllm"], "needs the 'vllm' package"),
    ],
)
def test_vllm_generation_is_refused_where_it_cannot_run(overrides: list[str], message: str) -> None:
    base = {"policy": {"model_path": "/m"}, "data": {"task": "repeat_digit"}}
    with pytest.raises(GRPOConfigError, match=message):
        config_from_dict(base, overrides).validate()


def test_build_engine_starts_one_vllm_per_replica_over_its_tensor_parallel_ranks(tmp_path: Path, monkeypatch) -> None:
    """In a world of several ranks every rank starts one vLLM worker with vLLM's `external_launcher` executor, at
    the replica's TP and as many data-parallel ranks as there are replicas (vLLM's TP x DP is the world); a
    single process starts it without (vLLM's engine replaced by a recorder)."""
    from hf_mcore_bridge.grpo.run import generation

    calls: list[dict[str, Any]] = []

    class Recorder:
        def __init__(self, model_dir: Path, config: EngineConfig, **kwargs: Any) -> None:
            calls.append(kwargs)

    group = object()  # a two-rank group of a four-rank world, as `torch.distributed` would size them
    world = [4]
    monkeypatch.setattr(hf_mcore_bridge.engine, "VllmEngine", Recorder)
    monkeypatch.setattr(generation.dist, "is_initialized", lambda: world[0] > 1)
    monkeypatch.setattr(generation.dist, "get_world_size", lambda g=None: 2 if g is group else world[0])
    monkeypatch.setattr(generation.dist, "get_rank", lambda g=None: 0)
    monkeypatch.setattr(generation.dist, "barrier", lambda g=None: None)
    policy = build_tiny_policy(tmp_path / "policy")
    tokenizer = Tokenizer.from_file(str(policy / "tokenizer.json"))
    hf_config = json.loads((policy / "config.json").read_text())
    build_engine("vllm", hf_config, CONFIG, tokenizer, tmp_path / "logs", tp_group=group)  # 2 replicas of TP 2
    build_engine("vllm", hf_config, CONFIG, tokenizer, tmp_path / "logs")  # 4 replicas of one rank
    world[0] = 1
    build_engine("vllm", hf_config, CONFIG, tokenizer, tmp_path / "logs")  # one process: vLLM's own executor
    launcher = {"distributed_executor_backend": "external_launcher"}
    assert calls[0] == launcher | {"tensor_parallel_size": 2, "data_parallel_size": 2} | _common(calls[0])
    assert calls[1] == launcher | {"tensor_parallel_size": 1, "data_parallel_size": 4} | _common(calls[1])
    assert calls[2] == _common(calls[2])


def _common(call: dict[str, Any]) -> dict[str, Any]:
    return {k: call[k] for k in ("load_format", "skip_tokenizer_init")}
