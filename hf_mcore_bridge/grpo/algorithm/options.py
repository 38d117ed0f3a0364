"""The GRPO algorithm's settings as plain Python: the loss's `LossConfig` with its enums, the leave-one-out
advantage's choice of standard deviation and dynamic sampling's `DynamicSamplingConfig`.

They live apart from `losses` and `advantages` (which re-export them) because the run's config is built from them:
loading and validating a config must not import torch, so that a mistake in it is reported in a fraction of a
second. Nothing here imports anything beyond the standard library.
"""

from dataclasses import dataclass
from enum import StrEnum

__all__ = ["Aggregation", "DynamicSamplingConfig", "ISCorrection", "LeaveOneOutStd", "LossConfig", "RatioLevel"]


class LeaveOneOutStd(StrEnum):
    """Which standard deviation the leave-one-out advantage of completion `i` is divided by."""

    OTHERS = "others"
    """The sample std of the other `n - 1` rewards of the group (NeMo-RL's choice)."""
    GROUP = "group"
    """The sample std of the whole group (as with the group-mean baseline)."""


class Aggregation(StrEnum):
    """How per-token losses become one scalar."""

    TOKEN = "token"
    """Sum over all valid tokens divided by the global number of valid tokens (DAPO; long answers weigh more)."""

    SEQUENCE = "sequence"
    """Mean over each sequence's valid tokens, then sum divided by the global number of sequences (GRPO paper)."""


class RatioLevel(StrEnum):
    """Where the policy's importance ratio is taken and clipped."""

    TOKEN = "token"
    """Per token: `exp(logprob - old_logprob)` of each sampled token (PPO, GRPO)."""

    SEQUENCE = "sequence"
    """Per sequence, length-normalised: `exp(mean over the sequence's tokens of (logprob - old_logprob))`, one
    ratio and one clip decision for the whole completion (GSPO)."""


class ISCorrection(StrEnum):
    """Correction for the mismatch between the inference engine's and the trainer's log-probs of one policy."""

    NONE = "none"
    """No correction."""

    TIS = "tis"
    """Truncated importance sampling: weight `min(exp(old - engine), cap)`."""

    ICEPOP = "icepop"
    """Weight `exp(old - engine)` inside `[low, high]`, 0 outside (the token is dropped from the gradient)."""


@dataclass(frozen=True)
class LossConfig:
    """Everything that selects and parameterises the GRPO loss."""

    clip_low: float = 0.2
    """Lower clip epsilon: the ratio is clipped at `1 - clip_low` (bites for negative advantages)."""

    clip_high: float = 0.2
    """Upper clip epsilon: the ratio is clipped at `1 + clip_high` (bites for positive advantages). DAPO's
    clip-higher uses a larger value than `clip_low`, e.g. 0.28."""

    dual_clip: float | None = None
    """Dual-clip constant c > 1: for negative advantages the per-token loss is capped at `-c * A`, so a ratio that
    has run far above 1 cannot produce an unbounded loss. None disables it."""

    kl_coef: float = 0.0
    """Coefficient of the k3 KL term to the reference policy; 0 disables it (reference log-probs then optional)."""

    aggregation: Aggregation = Aggregation.TOKEN
    """Token-level or sequence-level normalisation; the caller's `global_count` must count the matching unit."""

    ratio_level: RatioLevel = RatioLevel.TOKEN
    """`token` (PPO's per-token ratio and clip) or `sequence` (GSPO: each completion's geometric-mean ratio, clipped
    once for the whole completion; its gradient is that ratio times the mean of the token log-prob gradients). GSPO
    averages per sequence, so `sequence` needs `aggregation: sequence`; GSPO's paper uses clip epsilons of about
    3e-4 and 4e-4 (the sequence ratio stays much closer to 1 than token ratios)."""

    is_correction: ISCorrection = ISCorrection.NONE
    """Engine-vs-trainer importance-sampling correction; anything but NONE needs the engine's log-probs."""

    tis_cap: float = 2.0
    """Upper bound on the truncated importance weight (`tis`)."""

    icepop_low: float = 0.5
    """Smallest trainer/engine probability ratio that `icepop` keeps."""

    icepop_high: float = 5.0
    """Largest trainer/engine probability ratio that `icepop` keeps."""

    overlong_filtering: bool = False
    """Mask truncated samples (no stop token within `generation.max_new_tokens`, the engine's finish reason
    `length`) out of the loss and out of its token / sequence count (DAPO's overlong filtering, NeMo-RL's
    `overlong_filtering`). They keep their place in their group's advantage baseline."""

    def __post_init__(self) -> None:
        # Strings from YAML become the enums here, so that a typo fails at load time, not at the first step.
        object.__setattr__(self, "aggregation", Aggregation(self.aggregation))
        object.__setattr__(self, "is_correction", ISCorrection(self.is_correction))
        object.__setattr__(self, "ratio_level", RatioLevel(self.ratio_level))
        if self.ratio_level is RatioLevel.SEQUENCE and self.aggregation is not Aggregation.SEQUENCE:
            raise ValueError(
                "LossConfig.ratio_level=sequence (GSPO) needs aggregation=sequence: the ratio and its loss are per"
                " sequence"
            )
        if not 0.0 <= self.clip_low < 1.0:
            raise ValueError(f"LossConfig.clip_low must be in [0, 1), got {self.clip_low}")
        if self.clip_high < 0.0:
            raise ValueError(f"LossConfig.clip_high must be >= 0, got {self.clip_high}")
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError(f"LossConfig.dual_clip must be > 1 (or None), got {self.dual_clip}")
        if self.kl_coef < 0.0:
            raise ValueError(f"LossConfig.kl_coef must be >= 0, got {self.kl_coef}")
        if self.tis_cap <= 0.0:
            raise ValueError(f"LossConfig.tis_cap must be > 0, got {self.tis_cap}")
        if not 0.0 <= self.icepop_low < self.icepop_high:
            raise ValueError(
                f"LossConfig needs 0 <= icepop_low < icepop_high, got [{self.icepop_low}, {self.icepop_high}]"
            )


@dataclass(frozen=True)
class DynamicSamplingConfig:
    """DAPO's dynamic sampling (`grpo.algorithm.dynamic_sampling`): groups whose rewards are all equal are dropped
    and further rounds of prompts generated until `num_prompts_per_step` groups with reward variance remain."""

    enabled: bool = False
    """Drop zero-variance groups and generate more."""

    max_rounds: int = 4
    """Generation rounds a step runs at most (each of `num_prompts_per_step` new prompts, every engine replica
    generating its share); a step whose rounds run out trains on its groups with variance filled up with dropped
    ones (zero advantage), and logs how many as `filled_groups`. At least 2 when enabled."""

    def __post_init__(self) -> None:
        if self.max_rounds < 1:
            raise ValueError(f"DynamicSamplingConfig.max_rounds must be >= 1, got {self.max_rounds}")
        if self.enabled and self.max_rounds < 2:
            raise ValueError(
                "DynamicSamplingConfig.max_rounds=1 generates nothing to replace a dropped group: use >= 2"
            )
