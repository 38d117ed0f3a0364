"""Dynamic sampling's group selection against selections written out by hand, and its config's refusals."""

import pytest

from hf_mcore_bridge.grpo.algorithm.batching import Rollout
from hf_mcore_bridge.grpo.algorithm.dynamic_sampling import GroupPool, groups_with_variance
from hf_mcore_bridge.grpo.algorithm.options import DynamicSamplingConfig
from hf_mcore_bridge.grpo.errors import GRPOConfigError
from hf_mcore_bridge.grpo.run.config import config_from_dict


def rollouts(prompt: int, rewards: list[float]) -> list[Rollout]:
    """One group: prompt `prompt`'s completions, completion i being token i, with `rewards`."""
    return [Rollout((prompt,), (i,), (0.0,), reward) for i, reward in enumerate(rewards)]


def test_groups_with_variance() -> None:
    assert groups_with_variance([1.0, 1.0, 0.0, 1.0, 2.0, 2.0], 2) == [False, True, False]
    assert groups_with_variance([0.5, 0.5, 0.5], 3) == [False]
    with pytest.raises(ValueError, match="do not form groups of 2"):
        groups_with_variance([1.0, 2.0, 3.0], 2)


def test_pool_keeps_varied_groups_in_order_across_rounds() -> None:
    pool = GroupPool(wanted=3, group_size=2)
    pool.add(rollouts(1, [1.0, 1.0]) + rollouts(2, [0.0, 1.0]) + rollouts(3, [0.0, 0.0]))
    assert not pool.full
    pool.add(rollouts(4, [2.0, 3.0]) + rollouts(5, [1.0, 1.0]) + rollouts(6, [1.0, 0.0]))
    assert pool.full and pool.rounds == 2
    batch, filled = pool.batch()
    # prompts 2, 4 and 6 had reward variance; 1, 3 and 5 were dropped
    assert [r.prompt_ids[0] for r in batch] == [2, 2, 4, 4, 6, 6] and filled == 0
    assert [group[0].prompt_ids[0] for group in pool.dropped] == [1, 3, 5]


def test_pool_takes_only_the_wanted_groups() -> None:
    pool = GroupPool(wanted=1, group_size=2)
    pool.add(rollouts(1, [0.0, 1.0]) + rollouts(2, [1.0, 0.0]))
    batch, filled = pool.batch()
    assert [r.prompt_ids[0] for r in batch] == [1, 1] and filled == 0


def test_pool_fills_with_dropped_groups_when_rounds_run_out() -> None:
    pool = GroupPool(wanted=3, group_size=2)
    pool.add(rollouts(1, [1.0, 1.0]) + rollouts(2, [0.0, 1.0]) + rollouts(3, [0.0, 0.0]))
    batch, filled = pool.batch()
    assert [r.prompt_ids[0] for r in batch] == [2, 2, 1, 1, 3, 3] and filled == 2


def test_pool_refuses_a_batch_it_cannot_make() -> None:
    pool = GroupPool(wanted=2, group_size=2)
    pool.add(rollouts(1, [0.0, 1.0]))
    with pytest.raises(ValueError, match="fewer than 2"):
        pool.batch()


BASE = {"policy": {"model_path": "/m"}, "data": {"task": "repeat_digit"}}


def test_config_takes_dynamic_sampling() -> None:
    config = config_from_dict(BASE, ["grpo.dynamic_sampling.enabled=true", "grpo.dynamic_sampling.max_rounds=3"])
    assert config.grpo.dynamic_sampling == DynamicSamplingConfig(enabled=True, max_rounds=3)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["grpo.dynamic_sampling.max_rounds=0"], "max_rounds must be >= 1, got 0"),
        (
            ["grpo.dynamic_sampling.enabled=true", "grpo.dynamic_sampling.max_rounds=1"],
            "max_rounds=1 generates nothing to replace a dropped group",
        ),
        (["grpo.dynamic_sampling.rounds=3"], "did you mean 'grpo.dynamic_sampling.max_rounds'"),
    ],
)
def test_config_refuses_what_dynamic_sampling_cannot_serve(overrides: list[str], message: str) -> None:
    with pytest.raises(GRPOConfigError, match=message) as err:
        config_from_dict(BASE, overrides)
    assert "\n" not in str(err.value)
