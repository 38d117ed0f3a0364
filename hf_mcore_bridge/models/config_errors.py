"""Refusing HF config values, naming the field."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hf_mcore_bridge.errors import BridgeError


class ConfigError(BridgeError):
    """An HF config value that is missing or malformed, or that a consumer cannot compute as transformers does
    (megatron-core's refusals name megatron-core; the engine's its decoder)."""


def refuse_unless(config: Mapping[str, Any], field: str, good: Any) -> None:
    """Raise when `config[field]` is present and differs from `good` (a field transformers' model of the
    architecture ignores, so any other value would be computed as `good` is)."""
    if field in config and config[field] != good:
        raise ConfigError(f"config field {field}={config[field]!r} is not supported (only {good!r})")


def require(config: Mapping[str, Any], field: str) -> Any:
    """The value of a required field, or an error naming it."""
    if config.get(field) is None:
        raise ConfigError(f"config field {field!r} is missing")
    return config[field]
