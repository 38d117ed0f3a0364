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


class WorldError(BridgeError):
    """An error every rank of a launcher's world (`torchrun`) meets alike: a world of another size than the config
    lays out, rank 0's failure to prepare the run. `reports` is true on the rank that reports it (global rank 0, or
    the one process when ranks are spawned): the others exit with the same status and say nothing, so the user
    reads it once, not once per rank."""

    def __init__(self, message: str, *, reports: bool) -> None:
        super().__init__(message)
        self.reports = reports


class RunStopped(BaseException):
    """A run stopped by a signal (SIGINT, SIGTERM) after its ranks were stopped. A `BaseException`, like
    `KeyboardInterrupt`, so that `except Exception` does not swallow it; the CLI prints `str()` and exits with
    `exit_code` (128 + the signal number, as a shell reports a signalled process)."""

    def __init__(self, signum: int, message: str = "") -> None:
        import signal

        self.signum = signum
        self.signal_name = signal.Signals(signum).name
        super().__init__(message or f"stopped by {self.signal_name}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum
