"""Refusing HF config values that megatron-core cannot represent, naming the field."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hf_mcore_bridge.errors import BridgeError


class ConfigError(BridgeError):
    """An HF config value that cannot be represented in megatron-core (or is missing)."""


def refuse_if(config: Mapping[str, Any], field: str, bad: Any) -> None:
    """Raise when `config[field] == bad`."""
    if config.get(field) == bad:
        raise ConfigError(f"config field {field}={bad!r} cannot be represented in megatron-core")


def refuse_unless(config: Mapping[str, Any], field: str, good: Any) -> None:
    """Raise when `config[field]` is present and differs from `good`."""
    if field in config and config[field] != good:
        raise ConfigError(
            f"config field {field}={config[field]!r} cannot be represented in megatron-core (only {good!r})"
        )


def require(config: Mapping[str, Any], field: str) -> Any:
    """The value of a required field, or an error naming it."""
    if config.get(field) is None:
        raise ConfigError(f"config field {field!r} is missing")
    return config[field]
