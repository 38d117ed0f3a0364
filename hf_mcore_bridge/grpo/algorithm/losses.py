"""The GRPO policy loss, built from small pure functions over per-token log-probabilities.

Shapes: `B` completions of `T` response positions. `logprobs: [B, T]` holds the log-probability of the sampled
token at each position; `mask: [B, T]` is nonzero exactly on the valid response tokens (prompt, padding and
filtered-out samples are 0). Advantages are per completion `[B]` (GRPO's outcome reward) or per token `[B, T]`.

The pieces, each usable alone: `clipped_surrogate` (PPO clip with separate low/high epsilons and optional dual
clip) over a log-ratio that is per token or, for GSPO, per sequence (`sequence_log_ratio`), `k3_kl` (KL to a
frozen reference), `token_level_mean` / `sequence_level_mean` (normalisation by counts of the whole global batch),
`tis_weights` / `icepop_weights` (inference-engine vs trainer mismatch), the `token_mult_prob_error` metric and the
overlong sample masks. `grpo_loss` composes them from a `LossConfig` (defined with its enums in the torch-free
`grpo.algorithm.options`, which the run's config is built from).

Choices and simplifications:
- The returned loss is minimised, so it is the negated surrogate objective.
- The KL term is added to the per-token loss (the GRPO paper's form, not folded into the reward) and is
  estimated on the sampled tokens without importance weighting, as in the paper; its log-ratio is clamped to
  [-20, 20] so that one far-off token cannot overflow `exp`.
- Importance-sampling weights are constants (the engine and old log-probs carry no gradient) that multiply the
  surrogate term only. Tokens zeroed by icepop stay in the normaliser (the caller's global count), so masking
  shrinks the step rather than re-weighting the surviving tokens.
- Everything is computed in float32 at least, and positions outside the mask are set to 0 before any `exp`, so
  garbage (even -inf) at padding can reach neither the loss nor its gradient as NaN.
- Metrics are means over this micro-batch's valid tokens; `num_valid_tokens` comes with them so that the trainer
  can weight them when averaging over micro-batches and data-parallel ranks. The loss itself needs no such
  averaging: each micro-batch divides by the global count, so the micro-batch losses simply add up.
"""

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from hf_mcore_bridge.grpo.algorithm.options import Aggregation, ISCorrection, LossConfig, RatioLevel

__all__ = [
    "Aggregation",
    "ISCorrection",
    "LossConfig",
    "RatioLevel",
    "SurrogateTerms",
    "clipped_surrogate",
    "count_valid_sequences",
    "count_valid_tokens",
    "global_valid_count",
    "grpo_loss",
    "icepop_weights",
    "importance_weights",
    "k3_kl",
    "overlong_mask_from_finish_reasons",
    "overlong_mask_from_lengths",
    "sequence_level_mean",
    "sequence_log_ratio",
    "surrogate_from_log_ratio",
    "tis_weights",
    "token_level_mean",
    "token_mult_prob_error",
]

_KL_LOG_RATIO_BOUND = 20.0


class SurrogateTerms(NamedTuple):
    """Per-token output of `clipped_surrogate`; every field is `[B, T]`."""

    loss: torch.Tensor
    """Negated clipped surrogate (to be minimised), before masking and aggregation."""

    ratio: torch.Tensor
    """`exp(logprobs - old_logprobs)`."""

    clipped_low: torch.Tensor
    """Bool: negative advantage and ratio below `1 - clip_low` (the clipped term is taken, no gradient)."""

    clipped_high: torch.Tensor
    """Bool: positive advantage and ratio above `1 + clip_high` (the clipped term is taken, no gradient)."""

    dual_clipped: torch.Tensor
    """Bool: negative advantage and the loss capped at `-dual_clip * A` (no gradient)."""


def _per_token(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Broadcast `advantages: [B]` or `[B, T]` against `like: [B, T]`."""
    if advantages.dim() == 1 and advantages.shape[0] == like.shape[0]:
        return advantages.unsqueeze(-1)
    if advantages.shape == like.shape:
        return advantages
    raise ValueError(
        f"advantages must be [B] or [B, T] for log-probs {tuple(like.shape)}, got {tuple(advantages.shape)}"
    )


def clipped_surrogate(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
) -> SurrogateTerms:
    """PPO/GRPO clipped surrogate per token, with asymmetric clipping and optional dual clip.

    logprobs: [B, T] current policy (carries the gradient); old_logprobs: [B, T] policy that sampled;
    advantages: [B] or [B, T]. With `r = exp(logprobs - old_logprobs)` the per-token loss is
    `max(-r * A, -clip(r, 1 - clip_low, 1 + clip_high) * A)`, and with `dual_clip = c` it is further capped at
    `-c * A` where `A < 0`.
    """
    return surrogate_from_log_ratio(logprobs - old_logprobs, advantages, clip_low, clip_high, dual_clip)


def surrogate_from_log_ratio(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
) -> SurrogateTerms:
    """`clipped_surrogate` given the log importance ratio `log_ratio: [B, T]` itself (per token, or the per-sequence
    ratio of `sequence_log_ratio` repeated over each sequence's tokens); advantages: [B] or [B, T]."""
    adv = _per_token(advantages, log_ratio)
    ratio = torch.exp(log_ratio)
    clipped_ratio = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(-ratio * adv, -clipped_ratio * adv)
    negative = adv < 0
    clipped_low = negative & (ratio < 1.0 - clip_low)
    clipped_high = (adv > 0) & (ratio > 1.0 + clip_high)
    if dual_clip is None:
        dual_clipped = torch.zeros_like(clipped_low)
    else:
        cap = -dual_clip * adv
        dual_clipped = negative & (loss > cap)
        loss = torch.where(dual_clipped, cap, loss)
    return SurrogateTerms(loss, ratio, clipped_low, clipped_high, dual_clipped)


def sequence_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's length-normalised sequence log-ratio, repeated over each sequence's tokens: [B, T].

    logprobs: [B, T] current policy (carries the gradient); old_logprobs: [B, T]; mask: [B, T] valid tokens. Its
    value at every token of row i is `s_i = mean over the valid tokens t of (logprobs - old_logprobs)`; its
    gradient with respect to `logprobs[i, t]` is 1 at that token only (GSPO-token's `sg[s_i] + lp - sg[lp]`), so
    that a per-sequence mean of `f(exp(s_i))` over the tokens has the gradient of `f(exp(s_i))` itself.
    """
    valid = mask.bool()
    lengths = valid.sum(dim=-1, keepdim=True).clamp(min=1)
    per_sequence = torch.where(valid, logprobs - old_logprobs, 0.0).sum(dim=-1, keepdim=True) / lengths
    return per_sequence.detach() + logprobs - logprobs.detach()


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(policy || reference) on tokens sampled from the policy.

    logprobs: [B, T] current policy; ref_logprobs: [B, T] frozen reference. Returns [B, T] values
    `exp(d) - d - 1` with `d = ref_logprobs - logprobs` (clamped to +-20), each >= 0 and 0 where the two agree.
    """
    log_ratio = (ref_logprobs - logprobs).clamp(-_KL_LOG_RATIO_BOUND, _KL_LOG_RATIO_BOUND)
    return torch.exp(log_ratio) - log_ratio - 1.0


def count_valid_tokens(mask: torch.Tensor) -> torch.Tensor:
    """Valid tokens in `mask: [B, T]`; sum it over micro-batches and data-parallel ranks for `token_level_mean`."""
    return mask.bool().sum()


def count_valid_sequences(mask: torch.Tensor) -> torch.Tensor:
    """Sequences of `mask: [B, T]` with at least one valid token; summed globally for `sequence_level_mean`."""
    return mask.bool().any(dim=-1).sum()


def global_valid_count(masks: Sequence[torch.Tensor], aggregation: Aggregation, group: object = None) -> torch.Tensor:
    """The loss normaliser of a mini-batch: valid tokens (or, for sequence aggregation, sequences) of its
    micro-batches' `masks` ([B, T] each), summed over the ranks of `group`, the data-parallel process group (None:
    this rank's micro-batches are the whole mini-batch). Collective over `group`."""
    counter = count_valid_tokens if aggregation is Aggregation.TOKEN else count_valid_sequences
    total = sum((counter(mask).float() for mask in masks), torch.zeros((), device=masks[0].device))
    if group is not None:
        import torch.distributed as dist

        dist.all_reduce(total, group=group)
    return total


def _as_divisor(global_count: float | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    # A global batch without a single valid token yields a zero loss rather than 0 / 0.
    return torch.as_tensor(global_count, dtype=like.dtype, device=like.device).clamp(min=1.0)


def token_level_mean(
    values: torch.Tensor, mask: torch.Tensor, global_valid_tokens: float | torch.Tensor
) -> torch.Tensor:
    """Sum of `values: [B, T]` over valid tokens of `mask: [B, T]`, divided by the GLOBAL valid-token count.

    `global_valid_tokens` counts the valid tokens of every micro-batch on every data-parallel rank of the step,
    so that the per-micro-batch results add up to the mean over the whole batch. Returns a scalar.
    """
    summed = torch.where(mask.bool(), values, 0.0).sum()
    return summed / _as_divisor(global_valid_tokens, summed)


def sequence_level_mean(
    values: torch.Tensor, mask: torch.Tensor, global_num_sequences: float | torch.Tensor
) -> torch.Tensor:
    """Mean of `values: [B, T]` over each sequence's valid tokens, summed and divided by the GLOBAL sequence count.

    `global_num_sequences` counts sequences with at least one valid token (see `count_valid_sequences`) over all
    micro-batches and ranks; a fully masked sequence contributes 0 here. Returns a scalar.
    """
    valid = mask.bool()
    per_sequence_sum = torch.where(valid, values, 0.0).sum(dim=-1)
    lengths = valid.sum(dim=-1).clamp(min=1)
    summed = (per_sequence_sum / lengths).sum()
    return summed / _as_divisor(global_num_sequences, summed)


def tis_weights(old_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance weights `min(exp(old - engine), cap)`, [B, T].

    old_logprobs: [B, T] the trainer's log-probs of the sampling policy; engine_logprobs: [B, T] the inference
    engine's log-probs of the same tokens (the distribution that actually sampled them).
    """
    return torch.exp(old_logprobs - engine_logprobs).clamp(max=cap)


def icepop_weights(old_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """Icepop weights, [B, T]: the ratio `exp(old - engine)` where it lies in `[low, high]`, else 0.

    old_logprobs, engine_logprobs: [B, T] as in `tis_weights`. A zero weight drops the token from the gradient.
    """
    ratio = torch.exp(old_logprobs - engine_logprobs)
    keep = (ratio >= low) & (ratio <= high)
    return torch.where(keep, ratio, 0.0)


def importance_weights(
    old_logprobs: torch.Tensor, engine_logprobs: torch.Tensor | None, config: LossConfig
) -> torch.Tensor | None:
    """The correction `config.is_correction` selects, [B, T], or None when no correction is configured."""
    if config.is_correction is ISCorrection.NONE:
        return None
    if engine_logprobs is None:
        raise ValueError(f"is_correction={config.is_correction.value!r} needs the engine's log-probs")
    if config.is_correction is ISCorrection.TIS:
        return tis_weights(old_logprobs, engine_logprobs, config.tis_cap)
    return icepop_weights(old_logprobs, engine_logprobs, config.icepop_low, config.icepop_high)


def _masked_mean(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return torch.where(valid, values, 0.0).sum() / valid.sum().clamp(min=1)


def token_mult_prob_error(
    trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Mean multiplicative probability error between trainer and inference engine, a scalar >= 1.

    trainer_logprobs, engine_logprobs, mask: [B, T]. Follows the metric of the same name in NeMo-RL (its GRPO
    guide, "Multiplicative Token Probability Error", and the clipped policy-gradient loss that logs it): the
    per-token factor `exp(|trainer - engine|)` by which the two disagree on a sampled token's probability,
    averaged over the valid tokens, an average of exponentials and not the exponential of the mean log-prob gap.
    1.0 means exact agreement; that guide reads a steep climb past about 1-2% above 1 as a weight-update problem
    and spikes as an inference-engine or weight-refit bug. Here the mean is over this micro-batch's tokens.
    """
    valid = mask.bool()
    gap = torch.where(valid, trainer_logprobs - engine_logprobs, 0.0).abs()
    return _masked_mean(torch.exp(gap), valid)


def overlong_mask_from_finish_reasons(finish_reasons: Sequence[str]) -> torch.Tensor:
    """Sample mask [B], float 0/1: 0 where generation stopped on the length limit (`"length"`, vLLM's spelling).

    Such completions were cut off, not finished, so their reward says little about the policy (DAPO's overlong
    filtering); they stay in their group for the advantage baseline but are masked out of the loss.
    """
    return torch.tensor([0.0 if reason == "length" else 1.0 for reason in finish_reasons])


def overlong_mask_from_lengths(
    lengths: Sequence[int] | torch.Tensor, max_length: int, stopped: Sequence[bool] | torch.Tensor
) -> torch.Tensor:
    """Sample mask [B], float 0/1: 0 where `lengths[i] >= max_length` and sample i did not stop by itself.

    `stopped[i]` is True when the sample ended on a stop token or string; a sample that does so exactly at the
    limit finished and is kept.
    """
    lengths_t = torch.as_tensor(lengths)
    stopped_t = torch.as_tensor(stopped, dtype=torch.bool)
    if lengths_t.shape != stopped_t.shape:
        raise ValueError(f"lengths {tuple(lengths_t.shape)} and stopped {tuple(stopped_t.shape)} differ in shape")
    truncated = (lengths_t >= max_length) & ~stopped_t
    return (~truncated).to(torch.float32)


_AGGREGATORS: dict[Aggregation, Callable[[torch.Tensor, torch.Tensor, float | torch.Tensor], torch.Tensor]] = {
    Aggregation.TOKEN: token_level_mean,
    Aggregation.SEQUENCE: sequence_level_mean,
}


def _masked_extreme(values: torch.Tensor, valid: torch.Tensor, *, largest: bool) -> torch.Tensor:
    fill = float("-inf") if largest else float("inf")
    filled = torch.where(valid, values, fill)
    extreme = filled.amax() if largest else filled.amin()
    return torch.where(valid.any(), extreme, torch.zeros_like(extreme))


def _check_shapes(reference: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    for name, tensor in tensors.items():
        if tensor is not None and tensor.shape != reference.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {tuple(reference.shape)}")


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    global_count: float | torch.Tensor,
    config: LossConfig,
    ref_logprobs: torch.Tensor | None = None,
    engine_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO loss of one micro-batch and its metrics.

    logprobs: [B, T] current policy, with gradient; old_logprobs: [B, T] the trainer's log-probs of the policy
    that sampled (None for a single on-policy update: `logprobs.detach()`); advantages: [B] or [B, T];
    mask: [B, T] valid response tokens, already multiplied by any sample mask (e.g. overlong filtering);
    global_count: valid tokens (token aggregation) or valid sequences (sequence aggregation) of the whole global
    batch; `config.ratio_level` takes the importance ratio per token or per sequence (GSPO: one length-normalised
    ratio and clip decision per completion, `sequence_log_ratio`); ref_logprobs: [B, T] frozen reference, needed
    when `config.kl_coef > 0` and otherwise only reported;
    engine_logprobs: [B, T] inference engine's log-probs, needed for an IS correction and otherwise only used
    for `token_mult_prob_error`.

    Returns the scalar loss and a dict of detached scalar metrics: `loss`, `pg_loss`, `kl_loss` (same
    normalisation as the loss), `clip_fraction` (valid tokens where any clip bit) with its parts
    `clip_fraction_low`, `clip_fraction_high`, `dual_clip_fraction`, `ratio_mean`, `approx_kl` (k3 between the
    old and current policy), `num_valid_tokens`, and, when their inputs are given, `kl_ref`, `is_weight_mean`,
    `is_weight_min`, `is_weight_max`, `is_truncated_fraction` (capped by tis or dropped by icepop),
    `token_mult_prob_error`.
    """
    if config.kl_coef > 0 and ref_logprobs is None:
        raise ValueError(f"kl_coef={config.kl_coef} needs ref_logprobs")
    _check_shapes(
        logprobs, old_logprobs=old_logprobs, mask=mask, ref_logprobs=ref_logprobs, engine_logprobs=engine_logprobs
    )
    valid = mask.bool()

    def clean(tensor: torch.Tensor) -> torch.Tensor:
        return torch.where(valid, tensor.float(), 0.0)

    # Only the current policy's log-probs carry gradient; the others are constants of the step by definition.
    current = clean(logprobs)
    old = clean(logprobs if old_logprobs is None else old_logprobs).detach()
    ref = None if ref_logprobs is None else clean(ref_logprobs).detach()
    engine = None if engine_logprobs is None else clean(engine_logprobs).detach()

    log_ratio = sequence_log_ratio(current, old, valid) if config.ratio_level is RatioLevel.SEQUENCE else current - old
    terms = surrogate_from_log_ratio(log_ratio, advantages.float(), config.clip_low, config.clip_high, config.dual_clip)
    weights = importance_weights(old, engine, config)
    pg_per_token = terms.loss if weights is None else terms.loss * weights
    kl_per_token = None if ref is None else k3_kl(current, ref)

    aggregate = _AGGREGATORS[config.aggregation]
    pg_loss = aggregate(pg_per_token, valid, global_count)
    kl_loss = torch.zeros_like(pg_loss) if kl_per_token is None else aggregate(kl_per_token, valid, global_count)
    loss = pg_loss + config.kl_coef * kl_loss if config.kl_coef > 0 else pg_loss

    metrics = _metrics(terms, valid, current, old, kl_per_token, weights, engine)
    metrics.update(loss=loss.detach(), pg_loss=pg_loss.detach(), kl_loss=kl_loss.detach())
    return loss, metrics


def _metrics(
    terms: SurrogateTerms,
    valid: torch.Tensor,
    current: torch.Tensor,
    old: torch.Tensor,
    kl_per_token: torch.Tensor | None,
    weights: torch.Tensor | None,
    engine: torch.Tensor | None,
) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        any_clip = terms.clipped_low | terms.clipped_high | terms.dual_clipped
        metrics = {
            "clip_fraction": _masked_mean(any_clip.float(), valid),
            "clip_fraction_low": _masked_mean(terms.clipped_low.float(), valid),
            "clip_fraction_high": _masked_mean(terms.clipped_high.float(), valid),
            "dual_clip_fraction": _masked_mean(terms.dual_clipped.float(), valid),
            "ratio_mean": _masked_mean(terms.ratio, valid),
            "approx_kl": _masked_mean(k3_kl(current, old), valid),
            "num_valid_tokens": valid.sum().float(),
        }
        if kl_per_token is not None:
            metrics["kl_ref"] = _masked_mean(kl_per_token, valid)
        if weights is not None:
            metrics["is_weight_mean"] = _masked_mean(weights, valid)
            metrics["is_weight_min"] = _masked_extreme(weights, valid, largest=False)
            metrics["is_weight_max"] = _masked_extreme(weights, valid, largest=True)
            # Both corrections return the raw ratio untouched where they do not act, so inequality marks the
            # tokens that were capped (tis) or dropped (icepop).
            raw_ratio = torch.exp(old - engine) if engine is not None else weights
            metrics["is_truncated_fraction"] = _masked_mean((weights != raw_ratio).float(), valid)
        if engine is not None:
            metrics["token_mult_prob_error"] = token_mult_prob_error(old, engine, valid)
    return {name: value.detach() for name, value in metrics.items()}
