"""User-facing errors.

A `BridgeError` is a problem with the user's input or environment (a missing tensor, an infeasible layout, a
corrupt file). The CLI prints its message as one line and exits non-zero; anything else is a bug and keeps its
traceback.
"""


class BridgeError(Exception):
    """An error whose message alone tells the user what is wrong with their input."""


class UnsupportedArchitectureError(BridgeError):
    """The HF `architectures` entry has no mapping."""


class LayoutError(BridgeError):
    """A parallel layout that cannot be built for the model."""


class CheckpointError(BridgeError):
    """A checkpoint that is missing, incomplete, corrupt or inconsistent with its config."""
