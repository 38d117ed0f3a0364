"""`CompiledOrEager`: a function run through `torch.compile`, falling back to the plain function for good (with
one warning naming the error) if compilation fails.

The engine compiles only code whose eager version is the reference: pointwise steps of the decoder and the
sampler's reductions. Compiled code is traced on first use per input shape class (torch's automatic dynamic
shapes: a second shape recompiles once with a symbolic size), so the first call of each is slow; CUDA-graph
capture warms every function up before capturing it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Generic, ParamSpec, TypeVar

import torch

P = ParamSpec("P")
R = TypeVar("R")


class CompiledOrEager(Generic[P, R]):
    """Calls `torch.compile(fn)`; on a compiler error warns once and calls `fn` from then on."""

    def __init__(self, fn: Callable[P, R], what: str) -> None:
        self.eager = fn
        self.what = what
        self._compiled: Callable[P, R] | None = torch.compile(fn)

    @property
    def compiled(self) -> bool:
        """False once compilation has failed."""
        return self._compiled is not None

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        if self._compiled is not None:
            try:
                return self._compiled(*args, **kwargs)
            except torch.OutOfMemoryError:
                raise
            except Exception as err:  # a compiler error; an error of `fn` itself is raised again below
                warnings.warn(
                    f"compiled {self.what} failed, running eagerly: {type(err).__name__}: {err}", stacklevel=2
                )
                self._compiled = None
        return self.eager(*args, **kwargs)
