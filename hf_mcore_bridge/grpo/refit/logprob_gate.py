"""The engine-vs-trainer log-prob gate: a wrong conversion stops the run at the first step it shows in.

After each step's rollouts the trainer scores the sampled tokens itself; `token_mult_prob_error` (see
`losses.token_mult_prob_error`) compares those probabilities with the engine's. The refit's checksums
(`refit.checksums`) show that the engine holds the tensors the stream sent (a changed element always shows, a
change of several elements unless the hash's columns happen to cancel); they cannot show that the stream's
conversion was right (a swapped q/k split, gate/up order or expert order is streamed and held consistently).
This gate is that independent check: the engine then computes a different function from the trainer, so its
log-probs disagree. It applies to every generation backend (the vLLM path's log-probs included) and to the probe
prompt scored after each refit.

The limit is `grpo.max_token_mult_prob_error`, by default 1.0001 in fp32, 1.25 in bf16/fp16 and 1.6 with FP8
rollouts; with `grpo.on_logprob_mismatch: warn` a value past it is reported and the run goes on. The defaults come
from measurement (`scripts/measure_logprob_gate.py`, the table in `docs/refit-checks.md`): on SmolLM2-135M-Instruct,
step 1 of a run at temperature 1 gives 1.0000063 / 1.042 / 1.171 (fp32 / bf16 / FP8 rollouts, one H200) with a
correct refit, and at least 181 / 12.1 / 25.4 with each refit fault of `refit.faults` in one layer (q/k split, two
query heads of a group, k/v, gate/up). A stale engine copy moves the gate by less than a precision's rounding noise
(1.08 in bf16): the transfer check catches it instead.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

from hf_mcore_bridge.errors import BridgeError

__all__ = [
    "DEFAULT_MAX_TOKEN_MULT_PROB_ERROR",
    "FP8_MAX_TOKEN_MULT_PROB_ERROR",
    "LogprobMismatchError",
    "check_logprob_agreement",
    "limit_of",
]

DEFAULT_MAX_TOKEN_MULT_PROB_ERROR = {"fp32": 1.0001, "bf16": 1.25, "fp16": 1.25}
"""`grpo.max_token_mult_prob_error` when unset, by `policy.dtype`. fp32: a correct refit measured 1.0000063 on a
trained model (16x below the limit's excess), the smallest fault 181. bf16: a correct refit 1.038-1.042 (CPU, H200;
the limit leaves 6x its excess for sampling noise and a policy's drift), the smallest fault 4.0 (CPU) / 12.1 (H200).
fp16 is not measured and shares bf16's limit (its rounding is finer)."""

FP8_MAX_TOKEN_MULT_PROB_ERROR = 1.6
"""`grpo.max_token_mult_prob_error` when unset and `generation.precision` is `fp8` (a bf16 trainer): a correct refit
measured 1.171 on a trained model (CPU and H200 alike; the limit leaves 3.5x its excess), the smallest fault 25.4."""

LIKELY_CAUSES = (
    "a wrong weight mapping or refit (q/k/v split, gate/up order, expert order, a stale copy), dtype or kernel"
    " differences between engine and trainer, or sampling settings the trainer does not model"
)


class LogprobMismatchError(BridgeError):
    """The engine's and the trainer's log-probs disagree past `grpo.max_token_mult_prob_error`."""


def limit_of(config: Any) -> float:
    """The run's `grpo.max_token_mult_prob_error`, or the default for its `policy.dtype`."""
    configured = config.grpo.max_token_mult_prob_error
    if configured is not None:
        return float(configured)
    if config.generation.precision == "fp8":
        return FP8_MAX_TOKEN_MULT_PROB_ERROR
    return DEFAULT_MAX_TOKEN_MULT_PROB_ERROR[config.policy.dtype]


def check_logprob_agreement(config: Any, step: int, value: float, what: str, report: bool = True) -> str | None:
    """Raise `LogprobMismatchError` (one line) when `value` is past the limit, or NaN; with
    `grpo.on_logprob_mismatch: warn`, warn instead (where `report`, e.g. on rank 0 only) and return the message.
    `what` names the tokens compared (`rollouts`, `probe prompt`). None when the value is within the limit."""
    limit = limit_of(config)
    if value <= limit:
        return None
    shown = "nan" if math.isnan(value) else f"{value:.6g}"
    message = (
        f"step {step}: engine vs trainer log-probs disagree on the {what}: token_mult_prob_error {shown} >"
        f" grpo.max_token_mult_prob_error {limit:g}; likely causes: {LIKELY_CAUSES}"
        " (grpo.on_logprob_mismatch=warn to go on)"
    )
    if config.grpo.on_logprob_mismatch != "warn":
        raise LogprobMismatchError(message)
    if report:
        warnings.warn(message, stacklevel=2)
    return message
