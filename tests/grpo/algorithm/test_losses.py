"""GRPO loss pieces against values worked out by hand.

The running 2x3 example: row 0 has advantage +1 and ratios [0.5, 1.1, 1.5], row 1 advantage -2 and ratios
[0.5, 0.9, 1.5], with clip_low 0.2 and clip_high 0.3 (so the ratio is clipped to [0.8, 1.3]). The per-token loss
max(-r A, -clip(r) A) is then
    row 0: max(-0.5, -0.8) = -0.5,  max(-1.1, -1.1) = -1.1,  max(-1.5, -1.3) = -1.3 (upper clip active)
    row 1: max(1.0, 1.6) = 1.6 (lower clip active),  max(1.8, 1.8) = 1.8,  max(3.0, 2.6) = 3.0
and d loss / d logprob is -A r where the unclipped term is taken, 0 where clipping is active.
"""

import math
from collections.abc import Callable

import pytest
import torch

from hf_mcore_bridge.grpo.algorithm.losses import (
    Aggregation,
    ISCorrection,
    LossConfig,
    clipped_surrogate,
    count_valid_sequences,
    count_valid_tokens,
    grpo_loss,
    icepop_weights,
    k3_kl,
    overlong_mask_from_finish_reasons,
    overlong_mask_from_lengths,
    sequence_level_mean,
    tis_weights,
    token_level_mean,
    token_mult_prob_error,
)

RATIOS = [[0.5, 1.1, 1.5], [0.5, 0.9, 1.5]]
ADVANTAGES = [1.0, -2.0]
HAND_LOSS = [[-0.5, -1.1, -1.3], [1.6, 1.8, 3.0]]
HAND_GRAD = [[-0.5, -1.1, 0.0], [0.0, 1.8, 3.0]]


def log_tensor(values: list[list[float]]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64).log()


def surrogate_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.5, -2.5]], dtype=torch.float64)
    current = (old + log_tensor(RATIOS)).requires_grad_()
    return current, old, torch.tensor(ADVANTAGES, dtype=torch.float64)


def test_clipped_surrogate_values_and_clip_flags() -> None:
    current, old, adv = surrogate_inputs()
    terms = clipped_surrogate(current, old, adv, clip_low=0.2, clip_high=0.3)
    torch.testing.assert_close(terms.loss, torch.tensor(HAND_LOSS, dtype=torch.float64))
    torch.testing.assert_close(terms.ratio, torch.tensor(RATIOS, dtype=torch.float64))
    assert terms.clipped_high.tolist() == [[False, False, True], [False, False, False]]
    assert terms.clipped_low.tolist() == [[False, False, False], [True, False, False]]
    assert not terms.dual_clipped.any()


def test_clipped_surrogate_gradient_vanishes_only_where_clipping_is_active() -> None:
    current, old, adv = surrogate_inputs()
    clipped_surrogate(current, old, adv, clip_low=0.2, clip_high=0.3).loss.sum().backward()
    torch.testing.assert_close(current.grad, torch.tensor(HAND_GRAD, dtype=torch.float64))


def test_asymmetric_clip_uses_each_epsilon_on_its_side() -> None:
    # Ratio 1.25 with A > 0: inside 1 + 0.3 but outside 1 + 0.2.
    old = torch.zeros(1, 1, dtype=torch.float64)
    current = torch.tensor([[math.log(1.25)]], dtype=torch.float64)
    adv = torch.tensor([1.0], dtype=torch.float64)
    wide = clipped_surrogate(current, old, adv, clip_low=0.2, clip_high=0.3)
    narrow = clipped_surrogate(current, old, adv, clip_low=0.3, clip_high=0.2)
    assert wide.loss.item() == pytest.approx(-1.25) and not wide.clipped_high.any()
    assert narrow.loss.item() == pytest.approx(-1.2) and narrow.clipped_high.all()


def test_dual_clip_caps_the_loss_of_negative_advantages() -> None:
    # c = 1.4 caps row 1 (A = -2) at 2.8: only the ratio-1.5 token (loss 3.0) is affected; row 0 (A > 0) never.
    current, old, adv = surrogate_inputs()
    terms = clipped_surrogate(current, old, adv, clip_low=0.2, clip_high=0.3, dual_clip=1.4)
    expected = [[-0.5, -1.1, -1.3], [1.6, 1.8, 2.8]]
    torch.testing.assert_close(terms.loss, torch.tensor(expected, dtype=torch.float64))
    assert terms.dual_clipped.tolist() == [[False, False, False], [False, False, True]]
    terms.loss.sum().backward()
    torch.testing.assert_close(current.grad, torch.tensor([[-0.5, -1.1, 0.0], [0.0, 1.8, 0.0]], dtype=torch.float64))


def test_per_token_advantages() -> None:
    current, old, _ = surrogate_inputs()
    adv = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]], dtype=torch.float64)
    terms = clipped_surrogate(current, old, adv, clip_low=0.2, clip_high=0.3)
    torch.testing.assert_close(terms.loss, torch.tensor(HAND_LOSS, dtype=torch.float64))


def test_k3_kl() -> None:
    current = torch.tensor([[-1.0, -1.0, -2.0]], dtype=torch.float64)
    ref = torch.tensor([[-1.0, -1.0 + math.log(2.0), -3.0]], dtype=torch.float64)
    # d = ref - current: 0 -> 0; log 2 -> 2 - log 2 - 1; -1 -> e^-1 + 1 - 1.
    expected = torch.tensor([[0.0, 1.0 - math.log(2.0), math.exp(-1.0)]], dtype=torch.float64)
    torch.testing.assert_close(k3_kl(current, ref), expected)
    assert torch.equal(k3_kl(current, current.clone()), torch.zeros_like(current))


VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])


def test_token_level_mean_divides_by_the_global_count() -> None:
    # (1 + 2 + 4) / 3 over the whole batch; each row alone with the same global count: 3/3 and 4/3.
    assert token_level_mean(VALUES, MASK, 3).item() == pytest.approx(7 / 3)
    assert token_level_mean(VALUES[:1], MASK[:1], 3).item() == pytest.approx(1.0)
    assert token_level_mean(VALUES[1:], MASK[1:], 3).item() == pytest.approx(4 / 3)


def test_sequence_level_mean() -> None:
    # Row means 1.5 and 4, over 2 sequences: 2.75; split: 1.5 / 2 + 4 / 2.
    assert sequence_level_mean(VALUES, MASK, 2).item() == pytest.approx(2.75)
    assert sequence_level_mean(VALUES[:1], MASK[:1], 2).item() == pytest.approx(0.75)
    assert sequence_level_mean(VALUES[1:], MASK[1:], 2).item() == pytest.approx(2.0)


def test_fully_masked_sequence_is_not_counted() -> None:
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    assert count_valid_sequences(mask).item() == 1
    assert count_valid_tokens(mask).item() == 2
    assert sequence_level_mean(VALUES, mask, count_valid_sequences(mask)).item() == pytest.approx(1.5)


def test_empty_batch_gives_zero_not_nan() -> None:
    zero_mask = torch.zeros(2, 3)
    assert token_level_mean(VALUES, zero_mask, 0).item() == 0.0
    assert sequence_level_mean(VALUES, zero_mask, 0).item() == 0.0


def test_tis_and_icepop_weights() -> None:
    engine = torch.zeros(1, 4, dtype=torch.float64)
    old = log_tensor([[0.5, 3.0, 1.0, 2.0]])
    torch.testing.assert_close(tis_weights(old, engine, cap=2.5), torch.tensor([[0.5, 2.5, 1.0, 2.0]]).double())
    torch.testing.assert_close(
        icepop_weights(old, engine, low=0.6, high=2.5), torch.tensor([[0.0, 0.0, 1.0, 2.0]]).double()
    )


def test_token_mult_prob_error_is_a_mean_of_exponentials() -> None:
    trainer = torch.tensor([[0.1, -0.2, 5.0]], dtype=torch.float64)
    engine = torch.zeros(1, 3, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0]])
    expected = (math.exp(0.1) + math.exp(0.2)) / 2
    assert token_mult_prob_error(trainer, engine, mask).item() == pytest.approx(expected)
    assert token_mult_prob_error(engine, engine, mask).item() == 1.0


def test_overlong_masks() -> None:
    reasons = ["stop", "length", "stop", "abort"]
    assert overlong_mask_from_finish_reasons(reasons).tolist() == [1.0, 0.0, 1.0, 1.0]
    mask = overlong_mask_from_lengths([5, 8, 8, 3], max_length=8, stopped=[True, True, False, False])
    assert mask.tolist() == [1.0, 1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="shape"):
        overlong_mask_from_lengths([5, 8], max_length=8, stopped=[True])


# grpo_loss on the running example with the last token of row 1 masked out (5 valid tokens).
LOSS_MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def loss_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    current, old, adv = surrogate_inputs()
    # Garbage at the masked position must reach neither the loss nor the gradient.
    with torch.no_grad():
        current[1, 2] = float("-inf")
    old = old.clone()
    old[1, 2] = float("nan")
    return current, old, adv


def test_grpo_loss_token_level_value_metrics_and_gradient() -> None:
    current, old, adv = loss_inputs()
    config = LossConfig(clip_low=0.2, clip_high=0.3)
    loss, metrics = grpo_loss(current, old, adv, LOSS_MASK, count_valid_tokens(LOSS_MASK), config)
    # (-0.5 - 1.1 - 1.3 + 1.6 + 1.8) / 5
    assert loss.item() == pytest.approx(0.5 / 5)
    assert metrics["clip_fraction"].item() == pytest.approx(2 / 5)
    assert metrics["clip_fraction_high"].item() == pytest.approx(1 / 5)
    assert metrics["clip_fraction_low"].item() == pytest.approx(1 / 5)
    assert metrics["dual_clip_fraction"].item() == 0.0
    assert metrics["ratio_mean"].item() == pytest.approx((0.5 + 1.1 + 1.5 + 0.5 + 0.9) / 5)
    # k3 of old vs current with old - current = -log r: 1/r + log r - 1.
    approx_kl = sum(1 / r + math.log(r) - 1 for r in (0.5, 1.1, 1.5, 0.5, 0.9)) / 5
    assert metrics["approx_kl"].item() == pytest.approx(approx_kl)
    assert metrics["num_valid_tokens"].item() == 5
    loss.backward()
    expected_grad = torch.tensor([[-0.5, -1.1, 0.0], [0.0, 1.8, 0.0]], dtype=torch.float64) / 5
    torch.testing.assert_close(current.grad, expected_grad)


def test_grpo_loss_sequence_level() -> None:
    current, old, adv = loss_inputs()
    config = LossConfig(clip_low=0.2, clip_high=0.3, aggregation=Aggregation.SEQUENCE)
    loss, _ = grpo_loss(current, old, adv, LOSS_MASK, count_valid_sequences(LOSS_MASK), config)
    # Row means -2.9 / 3 and 3.4 / 2, averaged over 2 sequences.
    assert loss.item() == pytest.approx((-2.9 / 3 + 3.4 / 2) / 2)


@pytest.mark.parametrize(
    ("aggregation", "count"),
    [(Aggregation.TOKEN, count_valid_tokens), (Aggregation.SEQUENCE, count_valid_sequences)],
)
def test_micro_batches_sum_to_the_full_batch_loss(
    aggregation: Aggregation, count: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    config = LossConfig(clip_low=0.2, clip_high=0.3, aggregation=aggregation)
    expected = 0.5 / 5 if aggregation is Aggregation.TOKEN else (-2.9 / 3 + 3.4 / 2) / 2
    current, old, adv = loss_inputs()
    global_count = count(LOSS_MASK)
    total = torch.zeros((), dtype=torch.float64)
    for rows in (slice(0, 1), slice(1, 2)):
        part, _ = grpo_loss(current[rows], old[rows], adv[rows], LOSS_MASK[rows], global_count, config)
        total = total + part
    assert total.item() == pytest.approx(expected)


def test_grpo_loss_kl_term() -> None:
    current, old, adv = loss_inputs()
    ref = (current.detach() + math.log(2.0)).clone()
    config = LossConfig(clip_low=0.2, clip_high=0.3, kl_coef=0.1)
    loss, metrics = grpo_loss(current, old, adv, LOSS_MASK, 5, config, ref_logprobs=ref)
    # Every valid token has ref - current = log 2, so k3 = 1 - log 2 on each.
    assert metrics["kl_ref"].item() == pytest.approx(1 - math.log(2.0))
    assert metrics["kl_loss"].item() == pytest.approx(1 - math.log(2.0))
    assert loss.item() == pytest.approx(0.1 + 0.1 * (1 - math.log(2.0)))


def test_grpo_loss_kl_is_zero_when_policies_are_equal() -> None:
    current, old, adv = loss_inputs()
    config = LossConfig(clip_low=0.2, clip_high=0.3, kl_coef=0.5)
    loss, metrics = grpo_loss(current, old, adv, LOSS_MASK, 5, config, ref_logprobs=current.detach().clone())
    assert metrics["kl_ref"].item() == 0.0
    assert loss.item() == pytest.approx(0.1)


def test_grpo_loss_on_policy_default_for_old_logprobs() -> None:
    # old = current: every ratio is 1, so the loss is -mean(A) over tokens: (-1 * 2 + 2 * 1) / 3 = 0.
    current = torch.zeros(2, 2, requires_grad=True)
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, metrics = grpo_loss(current, None, adv, mask, 3, LossConfig())
    assert loss.item() == pytest.approx(0.0)
    assert metrics["ratio_mean"].item() == 1.0
    loss.backward()
    torch.testing.assert_close(current.grad, torch.tensor([[-1.0, -1.0], [2.0, 0.0]]) / 3)


def is_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    current = torch.zeros(1, 2, dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 2, dtype=torch.float64)
    return current, old, torch.tensor([1.0], dtype=torch.float64)


def test_grpo_loss_with_tis() -> None:
    # Ratio 1 and A = 1 give a per-token loss of -1; weights min([0.5, 3], 2) = [0.5, 2].
    current, old, adv = is_inputs()
    engine = -log_tensor([[0.5, 3.0]])
    config = LossConfig(is_correction=ISCorrection.TIS, tis_cap=2.0)
    loss, metrics = grpo_loss(current, old, adv, torch.ones(1, 2), 2, config, engine_logprobs=engine)
    assert loss.item() == pytest.approx(-(0.5 + 2.0) / 2)
    assert metrics["is_weight_mean"].item() == pytest.approx(1.25)
    assert metrics["is_weight_min"].item() == pytest.approx(0.5)
    assert metrics["is_weight_max"].item() == pytest.approx(2.0)
    assert metrics["is_truncated_fraction"].item() == pytest.approx(0.5)
    assert metrics["token_mult_prob_error"].item() == pytest.approx((2.0 + 3.0) / 2)


def test_grpo_loss_with_icepop() -> None:
    current, old, adv = is_inputs()
    engine = -log_tensor([[0.5, 2.0]])
    config = LossConfig(is_correction="icepop", icepop_low=0.6, icepop_high=2.5)
    loss, metrics = grpo_loss(current, old, adv, torch.ones(1, 2), 2, config, engine_logprobs=engine)
    # Ratio 0.5 is dropped; 2.0 is kept with weight 2. The dropped token still counts in the denominator.
    assert loss.item() == pytest.approx(-2.0 / 2)
    assert metrics["is_truncated_fraction"].item() == pytest.approx(0.5)
    loss.backward()
    torch.testing.assert_close(current.grad, torch.tensor([[0.0, -1.0]], dtype=torch.float64))


def test_missing_inputs_are_errors() -> None:
    current, old, adv = is_inputs()
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(current, old, adv, torch.ones(1, 2), 2, LossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="engine"):
        grpo_loss(current, old, adv, torch.ones(1, 2), 2, LossConfig(is_correction="tis"))
    with pytest.raises(ValueError, match="mask"):
        grpo_loss(current, old, adv, torch.ones(2, 2), 2, LossConfig())
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(current, old, torch.ones(3), torch.ones(1, 2), 2, LossConfig())


@pytest.mark.parametrize(
    "kwargs",
    [
        {"dual_clip": 1.0},
        {"clip_low": 1.0},
        {"clip_high": -0.1},
        {"kl_coef": -1.0},
        {"tis_cap": 0.0},
        {"icepop_low": 2.0, "icepop_high": 1.0},
        {"aggregation": "tokens"},
        {"is_correction": "is"},
        {"ratio_level": "sequences", "aggregation": "sequence"},
        {"ratio_level": "sequence"},  # GSPO normalises per sequence: token aggregation is refused
    ],
)
def test_loss_config_rejects_bad_values(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        LossConfig(**kwargs)


def test_loss_config_accepts_strings_for_enums() -> None:
    config = LossConfig(aggregation="sequence", is_correction="tis")
    assert config.aggregation is Aggregation.SEQUENCE
    assert config.is_correction is ISCorrection.TIS


def gspo_reference(
    current: torch.Tensor,
    old: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    num_sequences: int,
) -> torch.Tensor:
    """GSPO's objective as its paper writes it, sequence by sequence in plain Python: s_i = (prod_t r_t)^(1/|y_i|),
    loss = sum_i max(-s_i A_i, -clip(s_i) A_i) / num_sequences."""
    total = torch.zeros((), dtype=torch.float64)
    for i in range(current.shape[0]):
        tokens = [t for t in range(current.shape[1]) if mask[i, t]]
        if not tokens:
            continue
        log_s = sum(current[i, t] - old[i, t] for t in tokens) / len(tokens)
        s = torch.exp(log_s)
        total = total + torch.maximum(-s * adv[i], -s.clamp(1 - clip_low, 1 + clip_high) * adv[i])
    return total / num_sequences


def gspo_rows() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three rows: row 0's geometric-mean ratio 1.1 (inside the clip range, though its tokens' ratios are not), row
    1's 1.5 with a positive advantage (clipped at 1.3), row 2's 0.7 with a negative one (clipped at 0.8); the
    last token of row 1 is padding holding garbage."""
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.5, -2.5], [-0.7, -0.2, -1.1]], dtype=torch.float64)
    token_ratios = [[0.5, 1.2, 1.1**3 / (0.5 * 1.2)], [1.5 * 1.2, 1.5 / 1.2, 1.0], [0.7, 0.7, 0.7]]
    current = (old + torch.tensor(token_ratios, dtype=torch.float64).log()).requires_grad_()
    with torch.no_grad():
        current[1, 2] = float("-inf")
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1]])
    return current, old, torch.tensor([1.0, 2.0, -1.5], dtype=torch.float64), mask


def test_sequence_level_ratio_matches_gspo_value_gradient_and_clip() -> None:
    current, old, adv, mask = gspo_rows()
    config = LossConfig(clip_low=0.2, clip_high=0.3, aggregation="sequence", ratio_level="sequence")
    loss, metrics = grpo_loss(current, old, adv, mask, count_valid_sequences(mask), config)
    loss.backward()
    grad = current.grad.clone()

    reference_current = current.detach().clone().requires_grad_()
    expected = gspo_reference(reference_current, old, adv, mask, 0.2, 0.3, num_sequences=3)
    expected.backward()
    assert loss.item() == pytest.approx(expected.item())
    assert loss.item() == pytest.approx((-1.1 * 1.0 - 1.3 * 2.0 + 0.8 * 1.5) / 3)
    torch.testing.assert_close(grad, reference_current.grad)
    # Row 0 keeps its gradient although its first token's own ratio (0.5) lies outside the clip range; the
    # clipped rows 1 and 2 have none.
    assert grad[0].abs().min() > 0 and not grad[1:].any()
    # A clip decision per sequence, counted over its tokens: rows 1 and 2 (5 of 8 valid tokens).
    assert metrics["clip_fraction"].item() == pytest.approx(5 / 8)
    assert metrics["clip_fraction_high"].item() == pytest.approx(2 / 8)
    assert metrics["clip_fraction_low"].item() == pytest.approx(3 / 8)
    assert metrics["ratio_mean"].item() == pytest.approx((3 * 1.1 + 2 * 1.5 + 3 * 0.7) / 8)


def test_token_level_ratio_differs_from_gspo_on_the_same_rows() -> None:
    current, old, adv, mask = gspo_rows()
    config = LossConfig(clip_low=0.2, clip_high=0.3, aggregation="sequence")
    loss, _ = grpo_loss(current, old, adv, mask, count_valid_sequences(mask), config)
    expected = gspo_reference(current.detach(), old, adv, mask, 0.2, 0.3, num_sequences=3)
    assert abs(loss.item() - expected.item()) > 1e-3


def test_sequence_level_ratio_of_micro_batches_adds_up() -> None:
    current, old, adv, mask = gspo_rows()
    config = LossConfig(clip_low=0.2, clip_high=0.3, aggregation="sequence", ratio_level="sequence")
    total = sum(
        grpo_loss(current[rows], old[rows], adv[rows], mask[rows], 3, config)[0].item()
        for rows in (slice(0, 1), slice(1, 3))
    )
    expected = gspo_reference(current.detach(), old, adv, mask, 0.2, 0.3, num_sequences=3)
    assert total == pytest.approx(expected.item())
