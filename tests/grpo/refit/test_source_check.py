"""`grpo.refit.source_check.compare_with_source` against a tiny HF directory: the directory's own tensors (in its dtype
or cast as conversion casts them) pass; each refit fault of `grpo.refit.faults`, a one-ulp change and a name the files
lack are named in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hf_mcore_bridge.grpo.refit.faults import inject
from hf_mcore_bridge.grpo.refit.source_check import InitialWeightsError, compare_with_source
from hf_mcore_bridge.models.tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("src") / "m", "Qwen3MoeForCausalLM", seed=4, num_hidden_layers=2)


def _stream(directory: Path, dtype: torch.dtype | None = None) -> list[tuple[str, torch.Tensor]]:
    weights = load_file(directory / "model.safetensors")
    return [(n, t if dtype is None or not t.is_floating_point() else t.to(dtype)) for n, t in sorted(weights.items())]


def test_the_checkpoints_own_tensors_pass_in_its_dtype_and_cast(tiny: Path) -> None:
    count = len(_stream(tiny))
    assert compare_with_source(_stream(tiny), tiny, report=True) == count
    assert compare_with_source(_stream(tiny, torch.bfloat16), tiny, report=True) == count
    assert compare_with_source(_stream(tiny), tiny, report=False) == 0  # other ranks: only exhaust the stream


@pytest.mark.parametrize("fault", ["qk", "q_heads", "kv", "experts"])
def test_each_refit_fault_is_named(tiny: Path, fault: str) -> None:
    config = {"num_attention_heads": 8, "num_key_value_heads": 4, "hidden_size": 64, "head_dim": 8}
    stream = inject(iter(_stream(tiny)), fault, config)
    with pytest.raises(InitialWeightsError, match=r"do not give back the policy's HF checkpoint .* differ: model"):
        compare_with_source(stream, tiny, report=True)


def test_a_changed_element_a_missing_name_and_one_line(tiny: Path) -> None:
    stream = _stream(tiny)
    name, tensor = stream[3]
    changed = tensor.clone()
    changed.view(-1)[7] = torch.nextafter(changed.view(-1)[7], torch.tensor(float("inf")))
    stream[3] = (name, changed)
    stream.append(("model.layers.9.mlp.gate.weight", torch.zeros(2)))
    with pytest.raises(InitialWeightsError) as caught:
        compare_with_source(stream, tiny, report=True)
    message = str(caught.value)
    assert f"1 differ: {name}" in message and "1 are not in it: model.layers.9.mlp.gate.weight" in message
    assert "\n" not in message
