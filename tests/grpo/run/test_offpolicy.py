"""The off-policy path end to end: two GRPO steps of two mini-batches each at TP2, PP2, DP2 (tiny Llama) and EP2
(tiny Qwen3-MoE), every mini-batch's loss and gradient norm against `offpolicy_reference`, an independent trainer
on HF transformers + autograd that replays the logged rollouts from the initial weights.

The second mini-batch of a step is off-policy (the policy took a step since the old log-probs), the second step
has a KL reference (the initial weights) that differs from the policy, and the engine's log-probs disagree with
the trainer's (`mismatched_engine`), so `tis` and `icepop` weights differ from 1. Each layout combines several
loss options; together they cover KL, tis, icepop, temperature != 1, sequence aggregation on padded rows (4-row
micro-batches), overlong filtering and `num_minibatches` 2. The optimizer is SGD with momentum (the reference uses
`torch.optim.SGD`), whose update the reference can reproduce exactly; with clipping at 1.0 it bites at times.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_mcore_bridge.grpo.algorithm.batching import Rollout, make_microbatches, pack_microbatches
from hf_mcore_bridge.grpo.algorithm.losses import count_valid_sequences, count_valid_tokens
from hf_mcore_bridge.grpo.run import trainer
from hf_mcore_bridge.grpo.run.config import config_from_dict

from ..offpolicy_reference import ReferenceSettings, is_truncated, read_rollouts, replay
from ..tiny_policy import build_tiny_policy
from .mismatched_engine import expert_padding_rank, train_rank_with_mismatched_engine

STEPS = 2
GROUP = 4
STOP = (0, 1, 2, 3, 4, 5)
"""Stop tokens: `[EOS]` and the digits 0-4, so that about a third of 3-token completions run into the limit."""
LR, CLIP_GRAD, KL = 0.5, 1.0, 0.05
REL = 1e-5

RUNS = {
    "tp2": (
        {"tp": 2},
        {"is_correction": "tis", "tis_cap": 1.1, "aggregation": "sequence", "overlong_filtering": True},
        0.7,
    ),
    "pp2": (
        {"pp": 2},
        {"is_correction": "icepop", "icepop_low": 0.8, "icepop_high": 1.25, "clip_low": 0.05, "clip_high": 0.08},
        1.3,
    ),
    "dp2": (
        {"world": 2},
        {
            "is_correction": "icepop",
            "icepop_low": 0.8,
            "icepop_high": 1.25,
            "aggregation": "sequence",
            "clip_low": 0.05,
            "clip_high": 0.1,
        },
        1.0,
    ),
    "ep2": (
        {"ep": 2},
        {"is_correction": "tis", "tis_cap": 1.1, "overlong_filtering": True, "clip_low": 0.1, "clip_high": 0.1},
        0.8,
    ),
}
"""name -> (parallel sizes, loss options, temperature)."""


def _run(root: Path, name: str, policy: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[list[dict], ReferenceSettings]:
    sizes, loss, temperature = RUNS[name]
    prompts = root / "prompts.jsonl"
    rows = [{"prompt": f"Repeat the digit {d}. Answer:", "answer": str(d)} for d in range(10)]
    prompts.write_text("\n".join(json.dumps(r) for r in rows))
    config = config_from_dict(
        {
            "policy": {
                "model_path": str(policy),
                "megatron_cfg": {
                    "tensor_model_parallel_size": sizes.get("tp", 1),
                    "pipeline_model_parallel_size": sizes.get("pp", 1),
                    "expert_model_parallel_size": sizes.get("ep", 1),
                    "micro_batch_size": 4,
                    "optimizer": {"optimizer": "sgd", "lr": LR, "weight_decay": 0.0, "clip_grad": CLIP_GRAD},
                },
            },
            "grpo": {
                "num_prompts_per_step": 4,
                "num_generations_per_prompt": GROUP,
                "num_minibatches": 2,
                "max_num_steps": STEPS,
                # the engine's log-probs are shifted on purpose (`mismatched_engine`): the gate would stop the run
                "on_logprob_mismatch": "warn",
            },
            "loss_fn": {"kl_coef": KL, **loss},
            "generation": {
                "temperature": temperature,
                "max_new_tokens": 3,
                "stop_token_ids": list(STOP),
                "max_model_len": 64,
            },
            "data": {"train_jsonl": str(prompts)},
            "logger": {"log_dir": str(root / name), "print_progress": False},
            "cluster": {"gpus_per_node": sizes.get("world")},
        }
    )
    monkeypatch.setattr(trainer, "_train_rank", train_rank_with_mismatched_engine)
    metrics = trainer.train_grpo(config).metrics
    settings = ReferenceSettings(
        group=GROUP,
        minibatches=2,
        temperature=temperature,
        lr=LR,
        momentum=0.9,  # megatron-core's default `sgd_momentum`
        clip_grad=CLIP_GRAD,
        kl_coef=KL,
        stop_token_ids=STOP,
        **loss,
    )
    return metrics, settings


def _check(name: str, policy: Path, root: Path, metrics: list[dict], settings: ReferenceSettings) -> None:
    expected = replay(policy, root / name / "rollouts.jsonl", STEPS, settings)
    for step, (logged, minibatches) in enumerate(zip(metrics, expected, strict=True), start=1):
        for i, want in enumerate(minibatches):
            where = f"{name} step {step} mini-batch {i}"
            assert logged[f"minibatch{i}_loss"] == pytest.approx(want["loss"], rel=REL, abs=1e-7), where
            assert logged[f"minibatch{i}_grad_norm"] == pytest.approx(want["grad_norm"], rel=REL), where
        assert logged["loss"] == pytest.approx(sum(m["loss"] for m in minibatches) / len(minibatches), rel=REL)
        assert logged["grad_norm"] == pytest.approx(
            sum(m["grad_norm"] for m in minibatches) / len(minibatches), rel=REL
        )
    last = metrics[-1]
    assert last["kl_ref"] > 1e-4, name  # the reference differs from the policy at step 2
    assert last["clip_fraction"] > 0, name  # the off-policy mini-batch moved past the clip range
    assert last["token_mult_prob_error"] > 1.01, name  # the engine disagrees, so the correction acts
    assert last["is_truncated_fraction"] > 0, name  # some tokens were capped (tis) or dropped (icepop)


def _reward_signal(root: Path, name: str) -> None:
    """Some group of each step has rewards that differ, so the losses are not trivially 0."""
    for step, rows in read_rollouts(root / name / "rollouts.jsonl").items():
        assert any(len({r["reward"] for r in rows[i : i + GROUP]}) > 1 for i in range(0, len(rows), GROUP)), step


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tp2", "pp2", "dp2"])
def test_later_steps_match_reference(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    policy = build_tiny_policy(tmp_path / "policy", seed=2)
    metrics, settings = _run(tmp_path, name, policy, monkeypatch)
    _reward_signal(tmp_path, name)
    _check(name, policy, tmp_path, metrics, settings)
    if settings.overlong_filtering:
        _check_overlong_filtering_matters(name, policy, tmp_path, metrics, settings)


@pytest.mark.slow
def test_moe_later_steps_match_reference(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen3-MoE (a routed layer and a dense one) at EP2, no router auxiliary loss, so that HF's loss is the whole
    objective."""
    policy = build_tiny_policy(
        tmp_path / "policy", seed=2, architecture="Qwen3MoeForCausalLM", mlp_only_layers=[1], router_aux_loss_coef=0.0
    )
    metrics, settings = _run(tmp_path, "ep2", policy, monkeypatch)
    _reward_signal(tmp_path, "ep2")
    _check("ep2", policy, tmp_path, metrics, settings)
    _check_overlong_filtering_matters("ep2", policy, tmp_path, metrics, settings)


def _check_overlong_filtering_matters(
    name: str, policy: Path, root: Path, metrics: list[dict], settings: ReferenceSettings
) -> None:
    """Some samples of step 1 were truncated and some not, and the reference that keeps them disagrees with the
    run: the comparison above could fail had the trainer ignored `overlong_filtering`."""
    import dataclasses

    rows = read_rollouts(root / name / "rollouts.jsonl")[1]
    truncated = [is_truncated(r, STOP) for r in rows]
    assert any(truncated) and not all(truncated), name
    assert [r["truncated"] for r in rows] == truncated, name  # the engine's finish reason says the same
    assert metrics[0]["truncated_fraction"] == pytest.approx(sum(truncated) / len(truncated))
    unfiltered = replay(
        policy, root / name / "rollouts.jsonl", 1, dataclasses.replace(settings, overlong_filtering=False)
    )
    assert metrics[0]["minibatch0_loss"] != pytest.approx(unfiltered[0][0]["loss"], rel=1e-3), name


# Overlong filtering in the batching (unit) -------------------------------------------------------------------------


def _rollouts() -> list[Rollout]:
    return [
        Rollout((1, 2), (3, 4, 0), (-1.0, -1.0, -1.0), advantage=1.0),
        Rollout((1,), (5, 6, 7), (-1.0, -1.0, -1.0), advantage=-1.0, truncated=True),
        Rollout((1, 2, 3), (8,), (-1.0,), advantage=0.5),
    ]


def test_overlong_filtering_masks_truncated_rollouts() -> None:
    rollouts = _rollouts()
    (kept,) = make_microbatches(rollouts, 3)
    (filtered,) = make_microbatches(rollouts, 3, mask_truncated=True)
    assert kept.mask.sum(-1).tolist() == [3.0, 3.0, 1.0]
    assert filtered.mask.sum(-1).tolist() == [3.0, 0.0, 1.0]
    assert filtered.mask[0].tolist() == kept.mask[0].tolist()
    assert filtered.mask[2].tolist() == kept.mask[2].tolist()
    assert count_valid_tokens(filtered.mask) == 4 and count_valid_sequences(filtered.mask) == 2  # the normalisers
    (packed,) = pack_microbatches(rollouts, 64, mask_truncated=True)
    assert packed.mask.sum() == 4.0  # the 3 tokens of the truncated rollout are out
    # packing puts the longest first: the truncated rollout (4 tokens) sits at 5..8, its completion at 5..7
    assert packed.mask[0, 5:8].tolist() == [0.0, 0.0, 0.0]


@pytest.mark.slow
def test_expert_parallel_ranks_pad_microbatches_alike(tmp_path: Path) -> None:
    """megatron-core's all-gather token dispatcher needs equal token blocks on the expert-parallel ranks, which
    hold different rollouts: each micro-batch is padded to the longest over those ranks (the padding masked out),
    and unequal micro-batch counts (packing) or row counts are refused on every rank."""
    from hf_mcore_bridge.convert.layout import Layout
    from hf_mcore_bridge.megatron.world import run_world

    out = tmp_path / "padding.json"
    run_world(expert_padding_rank, Layout(ep=2), str(out))
    result = json.loads(out.read_text())
    assert result["lengths"] == [7, 4]  # rank 1's 2 + 5 and 2 + 2 tokens
    assert result["masks"] == [2.0, 1.0]  # rank 0's own completion tokens only
    assert "hold 1 to 2 micro-batches" in result["errors"][0]
    assert "different numbers of rows" in result["errors"][1]
