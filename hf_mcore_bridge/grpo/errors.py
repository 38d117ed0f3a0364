"""The trainer's configuration error, below every module that reads a configuration (`config` validates with the
run's other modules, which raise it too)."""

from hf_mcore_bridge.errors import BridgeError


class GRPOConfigError(BridgeError):
    """A configuration that cannot run: unknown key, wrong type or inconsistent values; the message says where."""
