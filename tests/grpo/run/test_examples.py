"""Every example config under examples/ loads: known keys only, megatron-core fields that exist, valid values, one
training backend enabled."""

from __future__ import annotations

from pathlib import Path

import pytest

from hf_mcore_bridge.grpo.run.config import load_config

EXAMPLES = sorted((Path(__file__).parents[3] / "examples").glob("*.yaml"))


def test_there_is_an_example_per_dense_family():
    names = {p.name for p in EXAMPLES}
    assert {"grpo_llama3.yaml", "grpo_mistral.yaml", "grpo_qwen2.5.yaml", "grpo_qwen3.yaml"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_config_loads_and_validates(path: Path):
    config = load_config(path, ["policy.model_path=/models/any"])
    config.validate()
    assert config.policy.megatron_cfg.enabled != config.policy.dtensor_cfg.enabled  # exactly one backend
