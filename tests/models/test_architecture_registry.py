"""One registry, one file per architecture: nothing outside `mappings/` branches on an architecture's name, and
what other parts derive from the tables (the DTensor plan, the engine's names) is what those parts need."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from hf_mcore_bridge.errors import BridgeError, UnsupportedArchitectureError
from hf_mcore_bridge.grpo.backends.dtensor.parallel import layer_tp_plan
from hf_mcore_bridge.models.registry import REGISTRY, WRAPPERS, for_config, with_features
from hf_mcore_bridge.models.spec import ModelSpec
from hf_mcore_bridge.models.tiny_models import tiny_config

ROOT = Path(__file__).parents[2]
NAMES = (
    {arch.hf_name for arch in REGISTRY.values()}
    | {kind for arch in REGISTRY.values() for kind in (arch.model_type, *arch.other_model_types)}
    | set(WRAPPERS)
    | {wrapper.model_type for wrapper in WRAPPERS.values()}
)


def _constants(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return {c.value for c in node.elts if isinstance(c, ast.Constant) and isinstance(c.value, str)}
    return set()


def _branches(path: Path, root: Path = ROOT) -> list[str]:
    """Comparisons against, and dict literals keyed by, registered architecture names or model types."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            named = set().union(*map(_constants, [node.left, *node.comparators])) & NAMES
        elif isinstance(node, ast.Dict):
            named = set().union(*(_constants(k) for k in node.keys if k is not None)) & NAMES
        else:
            continue
        if named:
            found.append(f"{path.relative_to(root)}:{node.lineno} {sorted(named)}")
    return found


def test_no_code_outside_mappings_branches_on_an_architecture_name() -> None:
    sources = [*(ROOT / "hf_mcore_bridge").rglob("*.py"), *(ROOT / "cli").rglob("*.py")]
    assert len(sources) > 50
    assert [hit for path in sources for hit in _branches(path)] == []


def test_the_branch_finder_sees_the_forms_it_forbids(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        'if arch.model_type in ("llama", "qwen3"):\n    pass\n'
        'if name == "MixtralForCausalLM":\n    pass\n'
        'TABLE = {"Qwen2ForCausalLM": 1}\n'
        'if x == "unrelated":\n    pass\n'
    )
    hits = _branches(probe, tmp_path)
    assert [hit.split(" ", 1)[0] for hit in hits] == ["probe.py:1", "probe.py:3", "probe.py:5"]


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_each_architecture_is_found_by_name_and_by_model_type(name: str) -> None:
    arch = REGISTRY[name]
    config = tiny_config(name)
    assert for_config(config) is arch
    assert for_config({"model_type": arch.model_type}) is arch
    assert all(for_config({"model_type": kind}) is arch for kind in arch.other_model_types)
    assert config["architectures"] == [name] and config["model_type"] == arch.model_type


def test_an_unknown_architecture_is_refused_with_the_supported_list() -> None:
    with pytest.raises(UnsupportedArchitectureError, match=r"GPT2LMHeadModel.*LlamaForCausalLM"):
        for_config({"architectures": ["GPT2LMHeadModel"], "model_type": "llama"})


@pytest.mark.parametrize(
    ("features", "expected"),
    [
        ({"moe": False, "shared_expert": False, "qk_norm": False, "qkv_bias": False}, "LlamaForCausalLM"),
        ({"moe": False, "shared_expert": False, "qk_norm": False, "qkv_bias": True}, "Qwen2ForCausalLM"),
        ({"moe": False, "shared_expert": False, "qk_norm": True, "qkv_bias": False}, "Qwen3ForCausalLM"),
        ({"moe": True, "shared_expert": False, "qk_norm": False, "qkv_bias": False}, "MixtralForCausalLM"),
        ({"moe": True, "shared_expert": False, "qk_norm": True, "qkv_bias": False}, "Qwen3MoeForCausalLM"),
        ({"moe": True, "shared_expert": True, "qk_norm": False, "qkv_bias": True}, "Qwen2MoeForCausalLM"),
        (
            {
                "moe": True,
                "shared_expert": True,
                "qk_norm": False,
                "qkv_bias": False,
                "mla": True,
                "score_function": "sigmoid",
            },
            "DeepseekV3ForCausalLM",
        ),
        # GLM-4.5 switches its q/k norms and biases per config: either value finds it
        (
            {"moe": True, "shared_expert": True, "qk_norm": True, "qkv_bias": True, "score_function": "sigmoid"},
            "Glm4MoeForCausalLM",
        ),
        (
            {"moe": True, "shared_expert": True, "qk_norm": False, "qkv_bias": False, "score_function": "sigmoid"},
            "Glm4MoeForCausalLM",
        ),
    ],
)
def test_megatron_args_without_an_hf_name_map_to_the_architecture_with_their_features(
    features: dict, expected: str
) -> None:
    assert with_features(**features).hf_name == expected


def test_mla_experts_after_a_dense_layer_find_the_architecture_whose_config_states_them() -> None:
    """DeepSeek-V3 is the first multi-latent architecture, but `first_k_dense_replace` cannot place MoE layers
    around a dense one; GLM-4.7-Flash's `mlp_layer_types` can. Leading dense layers still find DeepSeek-V3."""
    features = {"moe": True, "shared_expert": True, "qk_norm": False, "qkv_bias": False, "mla": True}
    lite = ModelSpec.from_hf(tiny_config("Glm4MoeLiteForCausalLM")).moe
    assert lite is not None and lite.moe_layers == (False, True, False, True)
    found = with_features(**features, score_function="sigmoid", experts=lite)
    assert found.hf_name == "Glm4MoeLiteForCausalLM"
    leading = dataclasses.replace(lite, moe_layers=(False, True, True, True))
    assert with_features(**features, score_function="sigmoid", experts=leading).hf_name == "DeepseekV3ForCausalLM"


def test_features_no_architecture_has_are_refused() -> None:
    with pytest.raises(UnsupportedArchitectureError, match="--hf-config"):
        with_features(moe=False, shared_expert=False, qk_norm=True, qkv_bias=True)
    with pytest.raises(UnsupportedArchitectureError, match="multi-latent attention; pass"):
        with_features(moe=True, shared_expert=False, qk_norm=False, qkv_bias=False, mla=True, score_function="sigmoid")


MEGATRON_PATTERN = {
    "self_attn.q_proj": ColwiseParallel,
    "self_attn.k_proj": ColwiseParallel,
    "self_attn.v_proj": ColwiseParallel,
    "self_attn.o_proj": RowwiseParallel,
    "mlp.gate_proj": ColwiseParallel,
    "mlp.up_proj": ColwiseParallel,
    "mlp.down_proj": RowwiseParallel,
}
"""How megatron-core shards a dense decoder layer's projections (column in, row out)."""


@pytest.mark.parametrize("name", sorted(n for n, arch in REGISTRY.items() if not arch.is_moe))
def test_the_dtensor_plan_derived_from_the_table_is_megatrons_pattern(name: str) -> None:
    if REGISTRY[name].linear_attention:  # refused by name: no plan for Gated DeltaNet yet
        with pytest.raises(BridgeError, match=f"not planned for {name}'s Gated DeltaNet"):
            layer_tp_plan(REGISTRY[name])
        return
    assert layer_tp_plan(REGISTRY[name]) == MEGATRON_PATTERN
