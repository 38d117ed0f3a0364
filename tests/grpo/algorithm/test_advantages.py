"""Group advantages against values worked out by hand, and NeMo-RL's leave-one-out rule written out in the test.

The running example is one group of four rewards [0, 1, 1, 1]: mean 0.75, deviations [-0.75, 0.25, 0.25, 0.25],
sample variance (0.5625 + 3 * 0.0625) / 3 = 0.25, so std 0.5.
"""

import statistics

import pytest
import torch

from hf_mcore_bridge.grpo.algorithm.advantages import (
    AdvantageConfig,
    LeaveOneOutStd,
    constant_reward_groups,
    group_advantages,
)

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


def test_leave_one_out_can_divide_by_the_whole_group_std() -> None:
    config = AdvantageConfig(leave_one_out=True, leave_one_out_std=LeaveOneOutStd.GROUP, eps=0.0)
    advantages = group_advantages(torch.tensor([0.0, 1.0, 1.0, 1.0]), 4, config)
    torch.testing.assert_close(advantages, torch.tensor([-2.0, 2 / 3, 2 / 3, 2 / 3]))


def _nemo_rl_leave_one_out(group: list[float], eps: float) -> list[float]:
    """NeMo-RL's leave-one-out advantages, written out per completion: baseline and Bessel-corrected std of the
    other rewards; no division where that std is 0 (fewer than two others, or all equal)."""
    out = []
    for i, reward in enumerate(group):
        others = group[:i] + group[i + 1 :]
        baseline = statistics.fmean(others)
        std = statistics.stdev(others) if len(others) >= 2 else 0.0
        out.append((reward - baseline) / (std + eps) if std > 0 else reward - baseline)
    return out


@pytest.mark.parametrize("group_size", [2, 3, 5])
def test_leave_one_out_divides_by_the_others_std_as_nemo_rl(group_size: int) -> None:
    generator = torch.Generator().manual_seed(group_size)
    rewards = torch.randint(0, 3, (6 * group_size,), generator=generator).double() * 0.5
    rewards[:group_size] = 0.25  # a constant group
    rewards[group_size : 2 * group_size] = torch.tensor([1.0] + [0.0] * (group_size - 1), dtype=torch.float64)
    config = AdvantageConfig(leave_one_out=True, eps=1e-6)
    assert config.leave_one_out_std is LeaveOneOutStd.OTHERS  # NeMo-RL's is the default
    expected = [
        value
        for start in range(0, rewards.numel(), group_size)
        for value in _nemo_rl_leave_one_out(rewards[start : start + group_size].tolist(), 1e-6)
    ]
    torch.testing.assert_close(group_advantages(rewards, group_size, config), torch.tensor(expected).double())
    # [1, 0, 0, ...]: the first completion's others all score 0, so its advantage stays undivided at exactly 1
    assert group_advantages(rewards, group_size, config)[group_size].item() == 1.0


def test_leave_one_out_std_choices_differ() -> None:
    rewards = torch.tensor([0.0, 1.0, 1.0, 3.0])
    others = group_advantages(rewards, 4, AdvantageConfig(leave_one_out=True, eps=0.0))
    whole = group_advantages(
        rewards, 4, AdvantageConfig(leave_one_out=True, leave_one_out_std=LeaveOneOutStd.GROUP, eps=0.0)
    )
    # completion 0: others [1, 1, 3], baseline 5/3, std sqrt(4/3); whole group std sqrt(5.6667/3)
    assert others[0].item() == pytest.approx((0 - 5 / 3) / (4 / 3) ** 0.5, rel=1e-6)
    assert whole[0].item() == pytest.approx((0 - 5 / 3) / statistics.stdev([0, 1, 1, 3]), rel=1e-6)


@pytest.mark.parametrize(
    "config",
    [
        AdvantageConfig(),
        AdvantageConfig(normalize_std=False),
        AdvantageConfig(leave_one_out=True),
        AdvantageConfig(leave_one_out=True, leave_one_out_std=LeaveOneOutStd.GROUP),
    ],
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
