"""Group advantages against values worked out by hand.

The running example is one group of four rewards [0, 1, 1, 1]: mean 0.75, deviations [-0.75, 0.25, 0.25, 0.25],
sample variance (0.5625 + 3 * 0.0625) / 3 = 0.25, so std 0.5.
"""

import pytest
import torch

from hf_mcore_bridge.grpo.advantages import AdvantageConfig, constant_reward_groups, group_advantages

EXACT = AdvantageConfig(eps=0.0)


def test_mean_std_normalisation() -> None:
    rewards = torch.tensor([0.0, 1.0, 1.0, 1.0, 3.0, 1.0, 2.0, 2.0])
    # Second group [3, 1, 2, 2]: mean 2, deviations [1, -1, 0, 0], variance 2 / 3.
    second_std = (2.0 / 3.0) ** 0.5
    expected = torch.tensor([-1.5, 0.5, 0.5, 0.5, 1 / second_std, -1 / second_std, 0.0, 0.0])
    torch.testing.assert_close(group_advantages(rewards, 4, EXACT), expected)


def test_eps_is_added_to_the_std() -> None:
    advantages = group_advantages(torch.tensor([0.0, 1.0, 1.0, 1.0]), 4, AdvantageConfig(eps=0.5))
    torch.testing.assert_close(advantages, torch.tensor([-0.75, 0.25, 0.25, 0.25]) / 1.0)


def test_no_std_subtracts_the_mean_only() -> None:
    config = AdvantageConfig(normalize_std=False)
    advantages = group_advantages(torch.tensor([0.0, 1.0, 1.0, 1.0]), 4, config)
    torch.testing.assert_close(advantages, torch.tensor([-0.75, 0.25, 0.25, 0.25]))


def test_leave_one_out_baseline() -> None:
    # Sample 0's baseline is mean(1, 1, 1) = 1; each other sample's is mean(0, 1, 1) = 2/3.
    config = AdvantageConfig(normalize_std=False, leave_one_out=True)
    advantages = group_advantages(torch.tensor([0.0, 1.0, 1.0, 1.0]), 4, config)
    torch.testing.assert_close(advantages, torch.tensor([-1.0, 1 / 3, 1 / 3, 1 / 3]))


def test_leave_one_out_divides_by_the_whole_group_std() -> None:
    config = AdvantageConfig(leave_one_out=True, eps=0.0)
    advantages = group_advantages(torch.tensor([0.0, 1.0, 1.0, 1.0]), 4, config)
    torch.testing.assert_close(advantages, torch.tensor([-2.0, 2 / 3, 2 / 3, 2 / 3]))


@pytest.mark.parametrize(
    "config",
    [AdvantageConfig(), AdvantageConfig(normalize_std=False), AdvantageConfig(leave_one_out=True)],
)
def test_identical_rewards_give_exactly_zero(config: AdvantageConfig) -> None:
    # 0.1 is not exact in binary, so the group mean can differ from the members by rounding.
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.7, 1.0, 0.0, 0.5])
    advantages = group_advantages(rewards, 3, config)
    assert torch.equal(advantages[:6], torch.zeros(6))
    assert advantages[6] > 0 > advantages[7]


def test_integer_rewards_become_float() -> None:
    advantages = group_advantages(torch.tensor([0, 1, 1, 1]), 4, EXACT)
    assert advantages.dtype == torch.float32
    torch.testing.assert_close(advantages, torch.tensor([-1.5, 0.5, 0.5, 0.5]))


def test_constant_reward_groups() -> None:
    rewards = torch.tensor([0.0, 1.0, 2.0, 2.0, 0.0, 0.0])
    assert constant_reward_groups(rewards, 2).tolist() == [False, True, True]


@pytest.mark.parametrize(
    ("rewards", "group_size", "message"),
    [
        (torch.zeros(6), 1, "group_size"),
        (torch.zeros(7), 2, "do not split"),
        (torch.zeros(2, 2), 2, "1-D"),
    ],
)
def test_bad_inputs(rewards: torch.Tensor, group_size: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        group_advantages(rewards, group_size)


def test_negative_eps_is_rejected() -> None:
    with pytest.raises(ValueError, match="eps"):
        AdvantageConfig(eps=-1.0)
