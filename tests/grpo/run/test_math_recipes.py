"""The math recipes under examples/: one per family, each a chat-template run on a math set with the math-verify
reward, pass@k validation and a statement of its expected step time."""

from __future__ import annotations

from pathlib import Path

import pytest

from hf_mcore_bridge.grpo.run.config import load_config

EXAMPLES = Path(__file__).parents[3] / "examples"
RECIPES = {
    "grpo_math_llama3.1_8b_instruct.yaml": "gsm8k",
    "grpo_math_qwen3_8b.yaml": "math",
    "grpo_math_qwen3_30b_a3b.yaml": "openmathinstruct2",
    "grpo_math_gpt_oss_20b.yaml": "openmathinstruct2",
}


@pytest.mark.parametrize(("name", "processor"), sorted(RECIPES.items()))
def test_math_recipe(name: str, processor: str) -> None:
    path = EXAMPLES / name
    config = load_config(path, ["policy.model_path=/models/any"])
    assert config.data.processor == processor and config.data.apply_chat_template is True
    assert config.reward.name == "math" and config.grpo.val_num_generations > 1
    assert config.data.prompt_template.format(question="Q").endswith(r"\boxed{}.")
    assert "# Expected step time:" in path.read_text()
