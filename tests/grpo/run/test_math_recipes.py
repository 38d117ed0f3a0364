"""The math recipes under examples/: one per family, each a chat-template run on a math set with the math-verify
reward, pass@k validation and a statement of its expected step time; the mixture-of-experts ones with routing
replay on, at layouts megatron-core and the run's plan accept."""

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
    "grpo_math_glm4.5_air.yaml": "openmathinstruct2",
    "grpo_math_deepseek_v3.yaml": "openmathinstruct2",
    "grpo_gemma3_1b_it_math.yaml": "gsm8k",
    "grpo_math_qwen3_5.yaml": "openmathinstruct2",
}
MOE_RECIPES_WITH_REPLAY = ("grpo_math_qwen3_30b_a3b.yaml", "grpo_math_glm4.5_air.yaml", "grpo_math_deepseek_v3.yaml")
"""The mixture-of-experts recipes that route the trainer's tokens to the engine's experts (`policy.router_replay`)."""


@pytest.mark.parametrize(("name", "processor"), sorted(RECIPES.items()))
def test_math_recipe(name: str, processor: str) -> None:
    path = EXAMPLES / name
    config = load_config(path, ["policy.model_path=/models/any"])
    assert config.data.processor == processor and config.data.apply_chat_template is True
    assert config.reward.name == "math" and config.grpo.val_num_generations > 1
    assert config.data.prompt_template.format(question="Q").endswith(r"\boxed{}.")
    assert "# Expected step time:" in path.read_text()


PUBLISHED_SIZES = {
    "grpo_math_qwen3_30b_a3b.yaml": (48, 32, 128),
    "grpo_math_glm4.5_air.yaml": (46, 96, 128),
    "grpo_math_deepseek_v3.yaml": (61, 128, 256),
}
"""Recipe -> (num_hidden_layers, num_attention_heads, routed experts) of the model's published config.json."""


@pytest.mark.parametrize("name", MOE_RECIPES_WITH_REPLAY)
def test_moe_recipes_replay_routing_at_a_layout_the_model_takes(name: str) -> None:
    from hf_mcore_bridge.grpo.run.plan import parallel_dims

    config = load_config(EXAMPLES / name, ["policy.model_path=/models/any"])
    config.validate()
    assert config.policy.router_replay.enabled and config.generation.backend == "embedded"
    megatron = config.policy.megatron_cfg
    assert megatron.sequence_parallel or megatron.tensor_model_parallel_size == 1  # MoE under TP needs SP
    dims = parallel_dims(config)  # the world holds the layout, the engines divide it
    assert dims.world == config.cluster.gpus_per_node * config.cluster.num_nodes
    layers, heads, experts = PUBLISHED_SIZES[name]
    layout = dims.layout
    assert layers % layout.pp == 0 and heads % layout.tp == 0 and experts % layout.ep == 0
    assert heads % (config.generation.tensor_parallel_size or layout.tp) == 0
