"""A training prompt as every data source gives it (`PromptRecord`), and the error of a row that cannot be one.

Kept apart from the loaders (`data`) so that the row formats (`processors`) and the built-in tasks (`tasks`), which
the loaders call, depend on the record alone.
"""

from __future__ import annotations

from typing import TypedDict

__all__ = ["DataError", "PromptRecord"]


class PromptRecord(TypedDict):
    """One training prompt and the answer its reward is checked against."""

    prompt: str
    answer: str


class DataError(ValueError):
    """A dataset row that cannot become a `PromptRecord`; the message names where it is."""
