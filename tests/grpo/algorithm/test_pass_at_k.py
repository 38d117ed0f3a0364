"""pass@k against the binomial formula written here, and the validation metrics built from it."""

from math import comb

import pytest

from hf_mcore_bridge.grpo.algorithm.pass_at_k import pass_at_k, reported_ks, validation_metrics


def _reference(n: int, c: int, k: int) -> float:
    return 1 - comb(n - c, k) / comb(n, k)


@pytest.mark.parametrize("n", [1, 2, 5, 16])
def test_pass_at_k_is_the_unbiased_estimator(n: int) -> None:
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(_reference(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_k_refuses_impossible_counts() -> None:
    for n, c, k in [(4, 5, 1), (4, 1, 0), (4, 1, 5), (4, -1, 1)]:
        with pytest.raises(ValueError):
            pass_at_k(n, c, k)


def test_validation_metrics() -> None:
    rewards = [[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.5]]  # 0.5 is not a correct answer
    metrics = validation_metrics(rewards)
    assert reported_ks(4) == [1, 2, 4] and reported_ks(6) == [1, 2, 4, 6] and reported_ks(1) == [1]
    assert set(metrics) == {"val_reward", "val_pass_at_1", "val_pass_at_2", "val_pass_at_4"}
    assert metrics["val_reward"] == pytest.approx(3.5 / 12)
    assert metrics["val_pass_at_1"] == pytest.approx((1 / 4 + 2 / 4 + 0) / 3)
    assert metrics["val_pass_at_2"] == pytest.approx((_reference(4, 1, 2) + _reference(4, 2, 2)) / 3)
    assert metrics["val_pass_at_4"] == pytest.approx(2 / 3)
    with pytest.raises(ValueError):
        validation_metrics([[1.0], [1.0, 0.0]])
