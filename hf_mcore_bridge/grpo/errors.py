"""The trainer's configuration error and the small checks that raise it, below every module that reads a section of
the configuration (the run's config composes sections that `data` and each backend define and validate).

Standard library only: validating a config must not import torch.
"""

import difflib
from collections.abc import Sequence
from typing import Any

from hf_mcore_bridge.errors import BridgeError

__all__ = ["GRPOConfigError", "real_number", "require", "unknown_key"]


class GRPOConfigError(BridgeError):
    """A configuration that cannot run: unknown key, wrong type or inconsistent values; the message says where."""


def require(condition: bool, message: str) -> None:
    """Raise `GRPOConfigError(message)` unless `condition`."""
    if not condition:
        raise GRPOConfigError(message)


def real_number(value: Any, where: str) -> float:
    """A finite real number from the config; YAML 1.1 reads `1e-6` (no dot) as text, so the message says how to
    write it."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        hint = " (YAML reads 1e-6 as text: write 1.0e-6)" if isinstance(value, str) else ""
        raise GRPOConfigError(f"{where} must be a number, got {value!r}{hint}")
    require(value == value and abs(value) != float("inf"), f"{where} must be finite, got {value!r}")
    return float(value)


_NEMO_RL_NAMES = {"use_leave_one_out_baseline": "leave_one_out"}
"""NeMo-RL keys spelled differently here: the suggestion names ours rather than the closest string."""


def unknown_key(key: str, valid: Sequence[str], where: str) -> GRPOConfigError:
    """The error for `key` under `where` (a dotted prefix ending in `.`), naming the closest of `valid`."""
    if _NEMO_RL_NAMES.get(key) in valid:
        return GRPOConfigError(f"unknown config key '{where}{key}'; NeMo-RL's name for '{where}{_NEMO_RL_NAMES[key]}'")
    close = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.5)
    hint = f"; did you mean '{where}{close[0]}'?" if close else f"; valid keys here: {sorted(valid)}"
    return GRPOConfigError(f"unknown config key '{where}{key}'{hint}")
