"""The tensor-parallel engine: the slicing rules against megatron-core's layout functions (`tensor_ops`), the
single-device path without collectives, and a 2-rank gloo world (`engine_tp_ranks.py`) where every architecture's
greedy tokens equal transformers' and the single-device engine's (mixture-of-experts models also through the fast
expert path), continuous batching, preemption, prefix sharing and sleep/wake with a reload work, and both ranks sample
the same tokens."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from engine_helpers import (
    GREEDY,
    VOCAB,
    engine_from_hf,
    engine_greedy,
    hf_greedy,
    hub_weights,
    random_prompts,
    tiny_engine_config,
)
from engine_tp_ranks import MAX_TOKENS, TP_ARCHS, TP_MOE_ARCHS, tp_engine_rank

from hf_mcore_bridge.engine import Engine, read_spec
from hf_mcore_bridge.engine.kv_cache import blocks_for
from hf_mcore_bridge.engine.model import CausalLM
from hf_mcore_bridge.engine.tp_group import TensorParallel
from hf_mcore_bridge.engine.tp_shards import (
    TPRank,
    column_shard,
    head_shard,
    kv_shard,
    local_sizes,
    row_shard,
    vocab_shard,
)
from hf_mcore_bridge.grpo.errors import GRPOConfigError
from hf_mcore_bridge.grpo.run.config import config_from_dict
from hf_mcore_bridge.grpo.run.plan import parallel_dims
from hf_mcore_bridge.megatron.world import run_torch_world
from hf_mcore_bridge.models.parallel_style import Parallel
from hf_mcore_bridge.models.tensor_ops import pad_vocab, padded_vocab_size, rank_shard


@pytest.mark.parametrize("tp", [2, 4])
def test_column_and_row_shards_match_megatron_layout(tp):
    """q heads, KV heads, gate/up and down slices equal megatron-core's column / gated-column / row chunks."""
    gen = torch.Generator().manual_seed(0)
    heads, kv, d, hidden, width = 8, 4, 3, 5, 12
    q, k = torch.randn(heads * d, hidden, generator=gen), torch.randn(kv * d, hidden, generator=gen)
    o = torch.randn(hidden, heads * d, generator=gen)
    gate, up = torch.randn(width, hidden, generator=gen), torch.randn(width, hidden, generator=gen)
    down = torch.randn(hidden, width, generator=gen)
    for rank in range(tp):
        place = TPRank(tp, rank)
        assert torch.equal(head_shard(heads, d, place).take(q, "q"), rank_shard(q, Parallel.COLUMN, tp, rank))
        assert torch.equal(kv_shard(kv, d, place).take(k, "k"), rank_shard(k, Parallel.COLUMN, tp, rank))
        assert torch.equal(head_shard(heads, d, place, dim=1).take(o, "o"), rank_shard(o, Parallel.ROW, tp, rank))
        shard = column_shard(width, place, "gate")
        fused = torch.cat([shard.take(gate, "gate"), shard.take(up, "up")])
        assert torch.equal(fused, rank_shard(torch.cat([gate, up]), Parallel.GATED_COLUMN, tp, rank))
        assert torch.equal(row_shard(width, place, "down").take(down, "down"), rank_shard(down, Parallel.ROW, tp, rank))


def test_kv_heads_are_replicated_for_the_query_heads_that_read_them():
    """With fewer KV heads than ranks, each rank keeps the KV head of its query heads' group (q head i reads KV
    head i // (heads / kv_heads), transformers' `repeat_kv`)."""
    heads, kv, d, tp = 8, 2, 1, 4
    k = torch.arange(kv * d, dtype=torch.float32)[:, None]
    for rank in range(tp):
        place = TPRank(tp, rank)
        q_heads = head_shard(heads, d, place).take(torch.arange(heads)[:, None], "q").flatten().tolist()
        groups = {h // (heads // kv) for h in q_heads}
        assert kv_shard(kv, d, place).take(k, "k").flatten().tolist() == sorted(groups)


def test_vocabulary_blocks_cover_an_odd_vocabulary_once():
    """211 rows over 2 and 4 ranks: equal blocks of ceil(211 / tp) rows, the last one short, together every row."""
    vocab = torch.arange(211)[:, None]
    for tp in (2, 4):
        parts = [vocab_shard(211, TPRank(tp, r)).take(vocab, "embed") for r in range(tp)]
        assert torch.equal(torch.cat(parts), vocab)
        assert [len(p) for p in parts[:-1]] == [-(-211 // tp)] * (tp - 1)


def test_shards_refuse_what_does_not_split_and_tensors_that_are_not_full():
    with pytest.raises(ValueError, match="num_attention_heads"):
        local_sizes(6, 2, 96, None, None, 211, TPRank(4, 0))
    with pytest.raises(ValueError, match="num_key_value_heads"):
        local_sizes(12, 3, 96, None, None, 211, TPRank(2, 0))
    with pytest.raises(ValueError, match="intermediate_size"):
        local_sizes(4, 2, 97, None, None, 211, TPRank(2, 0))
    with pytest.raises(ValueError, match="expert width"):
        local_sizes(4, 2, 96, 33, None, 211, TPRank(2, 0))
    with pytest.raises(ValueError, match="expected the full tensor"):
        column_shard(96, TPRank(2, 1), "gate").take(torch.zeros(48, 64), "gate")


def test_single_device_engine_issues_no_collective(get_hf_model, monkeypatch):
    """TP 1 is the single-device code path: with every collective of `torch.distributed` made to raise, and no
    process group at all, the engine still generates transformers' tokens (also sampling unseeded)."""

    def refuse(*args, **kwargs):
        raise AssertionError("a collective was called")

    for name in ("all_reduce", "all_gather_into_tensor", "broadcast", "all_gather"):
        monkeypatch.setattr(dist, name, refuse)
    assert not dist.is_initialized()
    with pytest.raises(AssertionError, match="collective"):  # the patch bites where a collective is called
        dist.all_reduce(torch.zeros(1))
    assert TensorParallel.of(None) is None
    model = get_hf_model("mistral")
    prompts = random_prompts([7, 4], seed=2)
    engine = engine_from_hf(model)
    assert engine_greedy(engine, prompts) == [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts]
    engine.generate(prompts)  # unseeded, temperature 1


@pytest.mark.slow
def test_tensor_parallel_engine_in_a_two_rank_world(tmp_path):
    run_torch_world(tp_engine_rank, 2, str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    mine, other, refs = ranks[0]["mine"], ranks[1]["mine"], ranks[0]["refs"]
    # every rank returned the same tokens (greedy and sampled) and log-probs
    assert mine == other
    assert len(mine["mixed_seeds"]) == 2
    assert sorted(mine["greedy"]) == sorted(TP_ARCHS)
    for arch in TP_ARCHS:  # greedy tokens at TP2 equal transformers' and the single-device engine's
        assert mine["greedy"][arch] == refs["hf"][arch], arch
        assert mine["greedy"][arch] == refs["tp1"][arch], arch
        assert all(len(tokens) == MAX_TOKENS for tokens in mine["greedy"][arch])
    for arch, lora in refs["lora"].items():  # the engine's adapters at TP2: PEFT's tokens and log-probs
        assert mine["lora"][arch]["greedy"] == lora["greedy"], arch
        assert mine["lora"][arch]["greedy"] != refs["hf"][arch], arch  # the adapters change the tokens
        assert mine["lora"][arch]["logprobs"] == pytest.approx(lora["logprobs"], abs=1e-5), arch
    assert mine["after_wake"] == refs["hf"]["qwen3_moe"]  # sleep(2), wake_up, load_weights(named_parameters())
    # the fast expert path (sorted grouped GEMM) at TP2: transformers' tokens for every MoE architecture
    assert {name.split("/")[0] for name in mine["fast_moe"]} == set(TP_MOE_ARCHS)
    for name, tokens in mine["fast_moe"].items():
        assert tokens == refs["hf"][name.split("/")[0]], name

    stats = mine["batching_stats"]
    assert stats["max_running"] == 4 and stats["joins_while_running"] > 0
    assert stats["preemptions"] > 0 and stats["waits_for_blocks"] > 0
    for samples, reference in zip(mine["batching"], refs["batching"], strict=True):
        assert samples == [reference, reference]

    stats, prompt_len, n, new = mine["sampled_stats"], refs["sampled_prompt_len"], 4, 8
    assert stats["prefill_tokens"] == prompt_len and stats["cow_copies"] == n - 1
    assert stats["blocks_allocated"] < n * blocks_for(prompt_len + new - 1, 4)
    assert len({tuple(s) for s in mine["sampled"]}) > 1
    for got, expected in zip(mine["sampled_logprobs"], refs["sampled_logprobs"], strict=True):
        assert got == pytest.approx(expected, abs=1e-5)


def test_a_group_of_one_rank_is_the_single_device_path(get_hf_model, tmp_path):
    """A 1-rank gloo group gives no tensor-parallel state: the model holds every head and the full vocabulary."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        engine = Engine(get_hf_model("llama").config, tiny_engine_config(), tp_group=dist.group.WORLD)
        assert engine.tp is None and engine.model.tp is None
        assert engine.num_kv_heads == 2 and engine.model.lm_head.weight.shape[0] == 211
    finally:
        dist.destroy_process_group()


def test_generation_tensor_parallel_size_defaults_to_the_policy_tp_and_must_divide_the_world():
    base = {"policy": {"model_path": "/some/model"}, "data": {"task": "repeat_digit"}}
    assert parallel_dims(config_from_dict(base)).engine_tp == 1
    tp2 = ["policy.megatron_cfg.tensor_model_parallel_size=2"]
    assert parallel_dims(config_from_dict(base, tp2)).engine_tp == 2
    dtensor = ["policy.megatron_cfg.enabled=false", "policy.dtensor_cfg.enabled=true"]
    dtensor_tp2 = config_from_dict(base, [*dtensor, "policy.dtensor_cfg.tensor_parallel_size=2"])
    assert parallel_dims(dtensor_tp2).engine_tp == 2
    assert parallel_dims(config_from_dict(base, [*tp2, "generation.tensor_parallel_size=1"])).engine_tp == 1
    with pytest.raises(GRPOConfigError, match=r"generation.tensor_parallel_size=0 must be >= 1"):
        config_from_dict(base, ["generation.tensor_parallel_size=0"])
    with pytest.raises(GRPOConfigError, match=r"generation.tensor_parallel_size=3 must divide the run's 2 ranks"):
        config_from_dict(base, [*tp2, "generation.tensor_parallel_size=3"])


def _rank_model(hf_config: object, tp: int, rank: int) -> CausalLM:
    """One rank's model, built without a world: loading only needs the rank's place, not its collectives."""
    place = SimpleNamespace(place=TPRank(tp, rank))
    return CausalLM(read_spec(hf_config), torch.float32, "cpu", max_positions=16, tp=place)  # type: ignore[arg-type]


SHARED_NAMES = ("shared_expert", "shared_experts")
"""HF names of a shared expert: Qwen2-MoE's and GLM-4.5's."""


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe", "glm4_moe"])
def test_each_rank_loads_megatron_slices_of_the_full_hf_tensors(arch, get_hf_model):
    """Every parameter of a TP2 rank equals megatron-core's shard of the full HF tensor (`tensor_ops.rank_shard`;
    the vocabulary padded by Megatron-LM's rule): attention with biases and q/k norms, dense and shared-expert
    MLPs (Qwen2-MoE's `shared_expert`, GLM's `shared_experts`, each held under its own name), routed experts, router
    and its score bias (whole, float32), embedding and output layer."""
    model = get_hf_model(arch)
    weights = dict(hub_weights(model))
    tp = 2
    for rank in range(tp):
        engine_model = _rank_model(model.config, tp, rank)
        engine_model.load_weights(weights.items())
        engine_model.check_loaded()
        params = dict(engine_model.named_parameters())

        def shard(name: str, style: Parallel) -> torch.Tensor:
            return rank_shard(weights[name], style, tp, rank)  # noqa: B023

        def fused(first: str, second: str) -> torch.Tensor:
            return rank_shard(torch.cat([weights[first], weights[second]]), Parallel.GATED_COLUMN, tp, rank)  # noqa: B023

        checked = 0
        for layer in range(model.config.num_hidden_layers):
            attn, mlp = f"model.layers.{layer}.self_attn", f"model.layers.{layer}.mlp"
            for leaf in ("weight", "bias"):
                if f"{attn}.q_proj.{leaf}" in weights:
                    qkv = torch.cat([shard(f"{attn}.{p}_proj.{leaf}", Parallel.COLUMN) for p in "qkv"])
                    assert torch.equal(params[f"{attn}.qkv_proj.{leaf}"], qkv)
                    checked += 1
            assert torch.equal(params[f"{attn}.o_proj.weight"], shard(f"{attn}.o_proj.weight", Parallel.ROW))
            for norm in ("q_norm", "k_norm"):
                if f"{attn}.{norm}.weight" in weights:
                    assert torch.equal(params[f"{attn}.{norm}.weight"], weights[f"{attn}.{norm}.weight"])
            for prefix in (mlp, *(f"{mlp}.{s}" for s in SHARED_NAMES)):
                if f"{prefix}.gate_proj.weight" in weights:  # a dense MLP or the shared expert
                    gate_up = fused(f"{prefix}.gate_proj.weight", f"{prefix}.up_proj.weight")
                    assert torch.equal(params[f"{prefix}.gate_up_proj.weight"], gate_up)
                    assert torch.equal(
                        params[f"{prefix}.down_proj.weight"], shard(f"{prefix}.down_proj.weight", Parallel.ROW)
                    )
                    checked += 1
            bias = f"{mlp}.gate.e_score_correction_bias"
            if bias in weights:
                assert params[bias].dtype == torch.float32 and torch.equal(params[bias], weights[bias])
            experts = getattr(model.config, "num_experts", None) or getattr(model.config, "num_local_experts", 0)
            for expert in range(experts if f"{mlp}.gate.weight" in weights else 0):
                source = f"{mlp}.experts.{expert}"
                gate_up = fused(f"{source}.gate_proj.weight", f"{source}.up_proj.weight")
                assert torch.equal(params[f"{mlp}.experts.gate_up_proj"][expert], gate_up)
                assert torch.equal(
                    params[f"{mlp}.experts.down_proj"][expert], shard(f"{source}.down_proj.weight", Parallel.ROW)
                )
                assert torch.equal(params[f"{mlp}.gate.weight"], weights[f"{mlp}.gate.weight"])
                checked += 1
        assert checked > 3 * model.config.num_hidden_layers
        padded = padded_vocab_size(VOCAB, 1, tp)
        held = vocab_shard(VOCAB, TPRank(tp, rank)).size
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            expected = rank_shard(pad_vocab(weights[name], padded), Parallel.VOCAB, tp, rank)[:held]
            assert torch.equal(params[name][:held], expected)


def test_a_wrong_full_shape_is_named_in_full(get_hf_model):
    model = get_hf_model("llama")
    engine_model = _rank_model(model.config, 2, 1)
    name = "model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(ValueError, match=r"q_proj\.weight: expected shape \(64, 64\), got \(64, 65\)"):
        engine_model.load_weights([(name, torch.zeros(64, 65))])
    with pytest.raises(ValueError, match=r"q_proj\.weight: expected the full tensor, 64 along dim 0"):
        engine_model.load_weights([(name, torch.zeros(32, 64))])
