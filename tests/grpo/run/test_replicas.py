"""Every data-parallel replica generates: a run at two replicas against the same run at one (megatron-core and
DTensor, fp32 on CPU).

Each replica's engine draws the rollouts of its half of the step's prompts, seeded by (seed, step, prompt index),
and scores them as its engine finishes each (`reward.overlap`, off in the single-replica run), and the rollouts are
gathered before the training split: so the first step's rollouts must be the same tokens and rewards as the
single-replica run's, its loss the same up to the reduction order of the data-parallel gradient average, and
the later steps must track it within rounding. With dynamic sampling (`grpo.dynamic_sampling`: half the prompts
give groups without reward variance) a step's extra generation rounds, too, must be the same at two replicas as at
one. The fast tests check the pieces the claim rests on against independent references: the engine's samples of a
batch split in two against the whole batch's, and the prompt shares against a plain split.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from hf_mcore_bridge.grpo.run.config import config_from_dict
from hf_mcore_bridge.grpo.run.generation import prompt_share, request_seed

from ..tiny_policy import WORDS, build_tiny_policy

if TYPE_CHECKING:
    from hf_mcore_bridge.grpo.run.trainer import RunResult

STEPS = 10


def test_prompt_shares_are_consecutive_whole_prompts_covering_the_step() -> None:
    for count in range(0, 9):
        for replicas in range(1, 5):
            shares = [prompt_share(count, replicas, r) for r in range(replicas)]
            assert [i for start, end in shares for i in range(start, end)] == list(range(count))
            sizes = [end - start for start, end in shares]
            assert max(sizes) - min(sizes) <= 1


def test_request_seeds_differ_by_index_and_stay_in_int63() -> None:
    seeds = {request_seed(2**62, i) for i in range(100)}
    assert len(seeds) == 100 and all(0 <= s < 2**63 for s in seeds)


def test_a_batch_split_over_two_engines_samples_what_one_engine_samples(tmp_path: Path) -> None:
    """The engine's `first_index`: prompts 2-3 generated on their own with first_index=2 give the samples they get
    as prompts 2-3 of the whole batch (and a different index gives different samples: the check can fail)."""
    from hf_mcore_bridge.engine import Engine, EngineConfig, SamplingParams

    policy = build_tiny_policy(tmp_path / "policy")
    engine = Engine.from_pretrained(policy, EngineConfig(dtype=torch.float32, device="cpu", max_model_len=64))
    prompts = [[11, 12, 13, d + 1] for d in range(4)]
    params = SamplingParams(n=4, temperature=1.0, max_tokens=6, seed=1234)
    whole = [[s.token_ids for s in out.samples] for out in engine.generate(prompts, params)]
    halves = engine.generate(prompts[:2], params, first_index=0) + engine.generate(prompts[2:], params, first_index=2)
    assert [[s.token_ids for s in out.samples] for out in halves] == whole
    shifted = engine.generate(prompts[2:], params, first_index=0)
    assert [[s.token_ids for s in out.samples] for out in shifted] != whole[2:]


def test_vllm_requests_are_seeded_by_their_index_in_the_step() -> None:
    """vLLM seeds each request on its own: the wrapper gives prompt i of a replica's share the seed of prompt
    `first_index + i` of the step, so a split batch sends each prompt the seed it has in the whole batch (vLLM's
    engine replaced by a recorder: vLLM is not installed here)."""
    import dataclasses

    from hf_mcore_bridge.engine import SamplingParams
    from hf_mcore_bridge.engine.engine import RequestOutput
    from hf_mcore_bridge.grpo.run.generation import VllmGeneration

    class Recorder:
        def __init__(self) -> None:
            self.seeds: list[int | None] = []

        def generate(self, ids: list[list[int]], params: list[SamplingParams]) -> list[RequestOutput]:
            self.seeds += [p.seed for p in params]
            return [RequestOutput(prompt_token_ids=i, samples=[]) for i in ids]

    whole, split = Recorder(), Recorder()
    params = SamplingParams(n=2, seed=77)
    prompts = [[1, 2], [3], [4, 5], [6]]
    VllmGeneration(whole, None).generate(prompts, params, first_index=0)
    VllmGeneration(split, None).generate(prompts[:1], params, first_index=0)
    VllmGeneration(split, None).generate(prompts[1:], params, first_index=1)
    assert split.seeds == whole.seeds and len(set(whole.seeds)) == 4
    assert dataclasses.replace(params).seed == 77  # the caller's params are not changed


def _config(root: Path, policy: Path, name: str, replicas: int, dtensor: bool, overlap: bool, dynamic: bool = False):
    prompts = root / "prompts.jsonl"
    rows = [{"prompt": f"Repeat the digit {d}. Answer:", "answer": str(d)} for d in range(10)]
    prompts.write_text("\n".join(json.dumps(r) for r in rows))
    if dtensor:
        backend = {
            "megatron_cfg": {"enabled": False},
            "dtensor_cfg": {"enabled": True, "data_parallel_shard_size": replicas, "micro_batch_size": 8, "lr": 1e-2},
        }
    else:
        backend = {"megatron_cfg": {"micro_batch_size": 8, "optimizer": {"lr": 1e-2}}}
    return config_from_dict(
        {
            "policy": {"model_path": str(policy), **backend},
            "grpo": {
                "num_prompts_per_step": 4,
                "num_generations_per_prompt": 4,
                "max_num_steps": DYNAMIC_STEPS if dynamic else STEPS,
                "dynamic_sampling": {"enabled": dynamic, "max_rounds": 3},
            },
            "loss_fn": {"kl_coef": 0.01},
            "generation": {"max_new_tokens": 3, "stop_token_ids": [WORDS.index("[EOS]")], "max_model_len": 64},
            "data": {"train_jsonl": str(prompts)},
            # rewards that differ within a group (with dynamic sampling: only for odd answers), scored in workers
            "reward": {"name": f"grpo.refit.refit_ranks:{REWARD[dynamic]}", "overlap": overlap},
            "logger": {"log_dir": str(root / name), "print_progress": False},
            "cluster": {"gpus_per_node": replicas},
        }
    )


REWARD = {False: "varied_reward", True: "varied_reward_on_odd_answers"}


def _rollouts(log_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (log_dir / "rollouts.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["megatron", "dtensor"])
def test_two_replicas_generate_and_train_as_one(tmp_path: Path, backend: str) -> None:
    from hf_mcore_bridge.grpo.run.trainer import train_grpo

    policy = build_tiny_policy(tmp_path / "policy")
    dtensor = backend == "dtensor"
    # one replica scoring after generation, two each scoring its share as its engine finishes each sample
    one = train_grpo(_config(tmp_path, policy, "dp1", 1, dtensor, overlap=False))
    two = train_grpo(_config(tmp_path, policy, "dp2", 2, dtensor, overlap=True))
    assert one.steps == two.steps == STEPS

    # both replicas generated (each its half of the prompts), and the rollouts are the single engine's
    first = two.metrics[0]
    assert first["generation_replicas"] == 2 and first["generation_replica0_s"] > 0
    assert first["generation_replica1_s"] > 0
    single, split = _rollouts(one.log_dir), _rollouts(two.log_dir)
    step1 = [(r["prompt_ids"], r["completion_ids"], r["reward"], r["advantage"]) for r in single if r["step"] == 1]
    assert step1 == [
        (r["prompt_ids"], r["completion_ids"], r["reward"], r["advantage"]) for r in split if r["step"] == 1
    ]
    for a, b in zip(single, split, strict=True):  # the engines' log-probs: the same weights, another batch
        assert a["engine_logprobs"] == pytest.approx(b["engine_logprobs"], abs=1e-5)
    assert len({tuple(r["completion_ids"]) for r in single}) > 3  # sampled, not one fixed answer

    # step one: the same loss and gradient up to the order of the data-parallel reduction
    for key in ("loss", "grad_norm", "reward_mean", "kl_ref", "token_mult_prob_error"):
        assert two.metrics[0][key] == pytest.approx(one.metrics[0][key], rel=1e-6, abs=1e-9), key
    # every step: the single-replica run's rewards (scored with and without overlap alike) and losses within rounding
    for key in ("reward_mean", "reward_std", "reward_timeouts"):
        assert two.series(key) == one.series(key), key
    assert all(m["reward_wait_s"] >= 0 for m in one.metrics + two.metrics)
    assert two.series("loss") == pytest.approx(one.series("loss"), rel=1e-4, abs=1e-5)
    assert any(r["advantage"] != 0 for r in single)  # the steps moved the weights
    assert one.series("kl_ref")[-1] > 1e-4  # the policy moved away from the reference: later steps are not step one


DYNAMIC_STEPS = 3


@pytest.mark.slow
def test_dynamic_sampling_at_two_replicas_samples_as_at_one(tmp_path: Path) -> None:
    """`grpo.dynamic_sampling` (megatron-core): every round's prompts are shared by both replicas, the groups kept
    and dropped are the same as the single replica's and so are the steps' rollouts, the rounds and the groups
    dropped or filled."""
    from hf_mcore_bridge.grpo.run.trainer import train_grpo

    policy = build_tiny_policy(tmp_path / "policy")
    one = train_grpo(_config(tmp_path, policy, "dp1", 1, False, overlap=False, dynamic=True))
    two = train_grpo(_config(tmp_path, policy, "dp2", 2, False, overlap=True, dynamic=True))
    assert one.steps == two.steps == DYNAMIC_STEPS
    # step one exactly (later steps follow weights equal within rounding: their rewards are compared below)
    fields = ("prompt_ids", "completion_ids", "reward", "advantage")
    single, split = ([[r[f] for f in fields] for r in _rollouts(run.log_dir) if r["step"] == 1] for run in (one, two))
    assert single == split and len(single) == 16
    assert two.metrics[0]["loss"] == pytest.approx(one.metrics[0]["loss"], rel=1e-6, abs=1e-9)
    _check_dynamic_sampling(one, two)


def _check_dynamic_sampling(one: RunResult, two: RunResult) -> None:
    """Both runs dropped and regenerated the same groups; a step trains on groups with reward variance, but for
    the `filled_groups` it took back when its rounds ran out; the rounds were counted."""
    for key in ("dropped_groups", "generation_rounds", "filled_groups", "kept_reward_mean", "reward_mean"):
        assert two.series(key) == one.series(key), key
    assert sum(one.series("dropped_groups")) > 0 and max(one.series("generation_rounds")) > 1
    assert all(1 <= rounds <= 3 for rounds in one.series("generation_rounds"))
    rows = _rollouts(one.log_dir)
    for step, metrics in enumerate(one.metrics, start=1):
        groups = [[r["reward"] for r in rows if r["step"] == step][i : i + 4] for i in range(0, 16, 4)]
        assert len(groups) == 4 and all(len(g) == 4 for g in groups)
        assert sum(max(g) == min(g) for g in groups) == metrics["filled_groups"], step
        # generated in all: 4 prompts a round, the groups without variance among them dropped
        assert metrics["dropped_groups"] <= 4 * metrics["generation_rounds"] - (4 - metrics["filled_groups"])
