"""The engine-vs-trainer log-prob gate: a wrong conversion stops the run at the first step it shows in.

After each step's rollouts the trainer scores the sampled tokens itself; `token_mult_prob_error` (see
`losses.token_mult_prob_error`) compares those probabilities with the engine's. The refit's checksums
(`refit_checksums`) show that the engine holds the tensors the stream sent (a changed element always shows, a
change of several elements unless the hash's columns happen to cancel); they cannot show that the stream's
conversion was right (a swapped q/k split, gate/up order or expert order is streamed and held consistently).
This gate is that independent check: the engine then computes a different function from the trainer, so its
log-probs disagree. It applies to every generation backend (the vLLM path's log-probs included) and to the probe
prompt scored after each refit.

The limit is `grpo.max_token_mult_prob_error`, by default 1.0001 in fp32 and 1.05 in bf16/fp16; with
`grpo.on_logprob_mismatch: warn` a value past it is reported and the run goes on.
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

DEFAULT_MAX_TOKEN_MULT_PROB_ERROR = {"fp32": 1.0001, "bf16": 1.05, "fp16": 1.05}
"""`grpo.max_token_mult_prob_error` when unset, by `policy.dtype`: fp32 engine and trainer agree to ~1e-6 on the
project's models; half precision kernels of the two sides differ by rounding."""

FP8_MAX_TOKEN_MULT_PROB_ERROR = 1.2
"""`grpo.max_token_mult_prob_error` when unset and `generation.precision` is `fp8`: per-block FP8 weights move a
tiny test model's log-probs by up to ~0.12 (`tests/engine/test_engine_fp8.py`); provisional until measured on the
GPU models. A wrong conversion still shows: it breaks the function, not its rounding."""

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
