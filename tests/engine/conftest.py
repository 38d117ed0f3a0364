"""Session fixtures of the engine tests (the builders live in `engine_helpers.py`)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from engine_helpers import build_hf_model
from transformers import PreTrainedModel


@pytest.fixture(scope="session")
def hf_models() -> dict[tuple[str, int], PreTrainedModel]:
    """A cache of built HF models, keyed by (arch, seed)."""
    return {}


@pytest.fixture(scope="session")
def get_hf_model(hf_models: dict) -> Callable[[str, int], PreTrainedModel]:
    def get(arch: str, seed: int = 0) -> PreTrainedModel:
        if (arch, seed) not in hf_models:
            hf_models[(arch, seed)] = build_hf_model(arch, seed)
        return hf_models[(arch, seed)]

    return get


@pytest.fixture(autouse=True)
def one_cpu_thread():
    """The tiny models gain nothing from intra-op threads, and on a shared 2-core machine the threads' spinning
    makes them many times slower; the setting is restored after each test."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
