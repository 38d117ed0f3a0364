"""Rollout routing replay (`policy.router_replay`) end to end: GRPO runs of a tiny GLM-4.5 MoE (sigmoid router with
expert score bias, 4 of 8 experts in 2 of 4 groups) whose routers' score biases move between generation and training
(`perturbed_router`). The bias only chooses experts, so with replay the trainer's log-probs of the rollouts are the
engine's (`token_mult_prob_error` within fp32 rounding of 1, the gate's fp32 bound) and without it they are not; both
runs log the metric. Replay at TP2 with sequence parallelism and packed rows, at EP2 x CP2 and at PP2 (each stage's
routers their own layers), is `extended`.

The pieces alone are checked in the fast tier: the engine's recorded ids against transformers' top-k
(`tests/engine/test_engine_moe.py`), the layout each router sees against a reference written here, the micro-batch
fields through padding and packing, and the refusals.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hf_mcore_bridge.grpo.algorithm.batching import Rollout, make_microbatches, pack_microbatches, pad_to_length
from hf_mcore_bridge.grpo.backends.megatron.router_replay import local_routing, moe_layer_numbers, replay_routing
from hf_mcore_bridge.grpo.errors import GRPOConfigError
from hf_mcore_bridge.grpo.run.config import config_from_dict
from hf_mcore_bridge.grpo.run.trainer import check_router_replay
from hf_mcore_bridge.models.spec import ModelSpec
from hf_mcore_bridge.models.tiny_models import build_tiny_model

from ..tiny_policy import build_tiny_policy


def _rollout(prompt: int, completion: int, layers: int = 2, k: int = 3, seed: int = 0) -> Rollout:
    """A rollout of `prompt` + `completion` tokens whose routing holds distinct ids (layer, slot, position)."""
    tokens = prompt + completion - 1
    routed = torch.randint(0, 200, (layers, tokens, k), generator=torch.Generator().manual_seed(seed))
    return Rollout(
        tuple(range(1, prompt + 1)),
        tuple(range(1, completion + 1)),
        (0.0,) * completion,
        0.0,
        0.0,
        False,
        routed.to(torch.uint8),
    )


def test_micro_batches_carry_routing_with_their_tokens() -> None:
    """Padded rows: row b, position p holds the rollout's id + 1 at p, 0 at its last token and after; packed rows:
    each rollout at its offset; padding to a length adds zeros."""
    rollouts = [_rollout(3, 4, seed=1), _rollout(2, 2, seed=2)]
    (batch,) = make_microbatches(rollouts, 2)
    assert batch.routed_experts is not None and batch.routed_experts.shape == (2, 3, 2, 7)
    for b, rollout in enumerate(rollouts):
        routed = rollout.routed_experts
        for p in range(7):
            want = routed[:, p].long() + 1 if p < routed.shape[1] else torch.zeros(2, 3, dtype=torch.long)
            assert torch.equal(batch.routed_experts[:, :, b, p].long(), want), (b, p)
    (packed,) = pack_microbatches(rollouts, 64)
    assert packed.routed_experts is not None and packed.routed_experts.shape == (2, 3, 1, 11)
    assert torch.equal(packed.routed_experts[:, :, 0, :6].long(), rollouts[0].routed_experts.permute(0, 2, 1) + 1)
    assert not packed.routed_experts[:, :, 0, 6].any()  # the first rollout's last token
    assert torch.equal(packed.routed_experts[:, :, 0, 7:10].long(), rollouts[1].routed_experts.permute(0, 2, 1) + 1)
    longer = pad_to_length(batch, 9)
    assert longer.routed_experts is not None and not longer.routed_experts[..., 7:].any()


def test_rollouts_and_batches_refuse_routing_that_does_not_fit() -> None:
    with pytest.raises(ValueError, match=r"must be \[moe_layers, 6, k\] for a rollout of 7 tokens"):
        Rollout((1, 2, 3), (4, 5, 6, 7), (0.0,) * 4, routed_experts=torch.zeros(2, 7, 3, dtype=torch.uint8))
    plain = Rollout((1, 2), (3,), (0.0,))
    with pytest.raises(ValueError, match="every rollout; some have none"):
        make_microbatches([_rollout(2, 1), plain], 2)


def test_local_routing_is_the_routers_token_order() -> None:
    """Against loops written here: the context-parallel positions, then the sequence-parallel slice of the
    tensor-parallel rank, then tokens sequence-major (position, then row); unrecorded tokens go to 0..k-1."""
    layers, k, rows, length = 2, 3, 2, 8
    routed = torch.randint(1, 9, (layers, k, rows, length), generator=torch.Generator().manual_seed(3))
    routed[:, :, 1, 6:] = 0  # row 1 ends early
    positions = torch.tensor([0, 1, 6, 7])  # a CP rank's share
    tp_size, tp_rank = 2, 1
    got = local_routing(routed, positions, tp_size, tp_rank, sequence_parallel=True)
    mine = positions.tolist()[2:]  # rank 1's half of its CP share
    expected = torch.empty(layers, len(mine) * rows, k, dtype=torch.long)
    for layer in range(layers):
        for i, p in enumerate(mine):
            for b in range(rows):
                ids = [int(routed[layer, slot, b, p]) - 1 for slot in range(k)]
                expected[layer, i * rows + b] = torch.tensor(ids if min(ids) >= 0 else list(range(k)))
    assert torch.equal(got, expected)
    whole = local_routing(routed, None, 2, 0, sequence_parallel=False)  # TP without SP: every token
    assert whole.shape == (layers, length * rows, k)


def test_replay_routing_hands_each_router_its_layer_and_refuses_misbuilt_routers() -> None:
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    def router(layer: int, replay: bool) -> TopKRouter:
        made = TopKRouter.__new__(TopKRouter)
        torch.nn.Module.__init__(made)
        made.layer_number, made.router_replay = layer, RouterReplay() if replay else None
        return made

    try:
        model = torch.nn.ModuleList([router(2, True), router(4, True)])
        ids = torch.arange(2 * 5 * 3).view(2, 5, 3)
        assert replay_routing(model, ids, (2, 4)) == 2
        for index, module in enumerate(model):
            assert module.router_replay.router_replay_action is RouterReplayAction.REPLAY_FORWARD
            assert torch.equal(module.router_replay.target_topk_idx, ids[index])
        replay_routing(model, ids, (2, 4))  # a second micro-batch: the backward queue does not grow
        assert len(model[0].router_replay.replay_backward_list) == 1
        replay_routing(model, None, (2, 4))
        assert model[0].router_replay.router_replay_action is None and model[0].router_replay.target_topk_idx is None
        with pytest.raises(ValueError, match=r"router of layer 4 is not one of the MoE layers \(2, 3\)"):
            replay_routing(model, ids, (2, 3))
        with pytest.raises(RuntimeError, match="built with moe_enable_routing_replay=True"):
            replay_routing(torch.nn.ModuleList([router(2, False)]), ids, (2,))
    finally:
        RouterReplay.clear_global_router_replay_instances()


def _spec(tmp_path: Path, architecture: str, **overrides: object) -> ModelSpec:
    from hf_mcore_bridge.convert.config_bridge import megatron_spec

    directory = build_tiny_model(tmp_path / architecture, architecture, **overrides)
    return megatron_spec(json.loads((directory / "config.json").read_text()))


def test_moe_layer_numbers_follow_the_model_and_dense_models_are_refused(tmp_path: Path) -> None:
    glm = _spec(tmp_path, "Glm4MoeForCausalLM", num_hidden_layers=3, first_k_dense_replace=1)
    assert moe_layer_numbers(glm) == (2, 3)
    config = config_from_dict(BASE, ["policy.router_replay.enabled=true"])
    check_router_replay(config, glm)
    with pytest.raises(GRPOConfigError, match="needs a mixture-of-experts model; LlamaForCausalLM has no routed"):
        check_router_replay(config, _spec(tmp_path, "LlamaForCausalLM"))


BASE = {"policy": {"model_path": "/m"}, "data": {"task": "repeat_digit"}}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["policy.megatron_cfg.enabled=false", "policy.dtensor_cfg.enabled=true"],
            "implemented for the megatron-core backend only, not policy.dtensor_cfg",
        ),
        (["generation.backend=vllm"], "needs generation.backend=embedded"),
        (
            ["policy.megatron_cfg.transformer.moe_router_fusion=true"],
            "cannot be combined with policy.megatron_cfg.transformer.moe_router_fusion: the fused top-k",
        ),
        (
            ["policy.megatron_cfg.transformer.recompute_granularity=full"],
            "cannot be combined with policy.megatron_cfg.transformer.recompute_granularity",
        ),
    ],
)
def test_replay_is_refused_where_it_cannot_serve(overrides: list[str], message: str) -> None:
    with pytest.raises(GRPOConfigError, match=message) as err:
        config_from_dict(BASE, ["policy.router_replay.enabled=true", *overrides])
    assert "\n" not in str(err.value)


def _run(root: Path, name: str, policy: Path, replay: bool, **layout: object) -> list[dict[str, float]]:
    from hf_mcore_bridge.grpo.run.trainer import train_grpo

    prompts = root / "prompts.jsonl"
    rows = [{"prompt": f"Repeat the digit {d}. Answer:", "answer": str(d)} for d in range(10)]
    prompts.write_text("\n".join(json.dumps(r) for r in rows))
    config = config_from_dict(
        {
            "policy": {
                "model_path": str(policy),
                "router_replay": {"enabled": replay},
                "megatron_cfg": {
                    "tensor_model_parallel_size": layout.get("tp", 1),
                    "expert_model_parallel_size": layout.get("ep", 1),
                    "pipeline_model_parallel_size": layout.get("pp", 1),
                    "context_parallel_size": layout.get("cp", 1),
                    "sequence_parallel": layout.get("tp", 1) > 1,
                    "sequence_packing": bool(layout.get("packing", False)),
                    "max_tokens_per_microbatch": 96,
                    "micro_batch_size": 8,
                    "optimizer": {"lr": 1e-2},
                },
            },
            "grpo": {
                "num_prompts_per_step": 4,
                "num_generations_per_prompt": 4,
                "max_num_steps": 2,
                # without replay the moved biases make the trainer disagree with the engine: logged, not stopped
                "on_logprob_mismatch": "warn",
            },
            "generation": {"max_new_tokens": 3, "stop_token_ids": [0], "max_model_len": 64},
            "data": {"train_jsonl": str(prompts)},
            "logger": {"log_dir": str(root / name), "print_progress": False},
            "cluster": {"gpus_per_node": layout.get("world")},
        }
    )
    return train_grpo(config).metrics


def _glm_policy(root: Path, **overrides: object) -> Path:
    return build_tiny_policy(root / "policy", seed=2, architecture="Glm4MoeForCausalLM", **overrides)


@pytest.mark.slow
def test_replay_gives_the_trainer_the_engines_logprobs_on_a_moved_router(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EP2: with the expert biases moved after every generation, the trainer's log-probs of the rollouts equal the
    engine's with replay (every step), and differ without it; both runs log `token_mult_prob_error`."""
    from hf_mcore_bridge.grpo.run import trainer

    from .perturbed_router import train_rank_with_perturbed_router

    monkeypatch.setattr(trainer, "_train_rank", train_rank_with_perturbed_router)
    policy = _glm_policy(tmp_path)
    without = _run(tmp_path, "ep2", policy, replay=False, ep=2)
    replayed = _run(tmp_path, "ep2_replay", policy, replay=True, ep=2)
    assert len(without) == len(replayed) == 2
    assert all(m["token_mult_prob_error"] > 1.001 for m in without)
    assert all(m["token_mult_prob_error"] <= 1.0001 for m in replayed)
    # the probe after each refit: engine and trainer hold the same weights, replayed or not
    assert all(m["probe_token_mult_prob_error"] <= 1.0001 for m in without + replayed)


REPLAY_LAYOUTS = {
    "pp2": {"pp": 2},
    "tp2_sp_packed": {"tp": 2, "packing": True},
    "ep2_cp2": {"ep": 2, "cp": 2},
}
"""Routing replay at tensor parallelism with sequence parallelism and packed rows (each TP rank's routers see their
slice of a packed row), at context parallelism beside expert parallelism (each CP rank its positions) and at
pipeline parallelism (megatron-core's all-to-all dispatcher; each stage's routers their own layers' choices: at PP2
without replay the same run's `token_mult_prob_error` is 1.005 and 1.003)."""
REPLAY_POLICIES = {"pp2": {"first_k_dense_replace": 0}}
"""Changes to the tiny GLM-4.5 per layout: at PP2 both layers routed, so each stage replays its own layer."""


@pytest.mark.extended
@pytest.mark.parametrize("name", list(REPLAY_LAYOUTS))
def test_replay_at_more_layouts(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hf_mcore_bridge.grpo.run import trainer

    from .perturbed_router import train_rank_with_perturbed_router

    monkeypatch.setattr(trainer, "_train_rank", train_rank_with_perturbed_router)
    policy = _glm_policy(tmp_path, **REPLAY_POLICIES.get(name, {}))
    replayed = _run(tmp_path, name, policy, replay=True, **REPLAY_LAYOUTS[name])
    assert all(m["token_mult_prob_error"] <= 1.0001 for m in replayed)
