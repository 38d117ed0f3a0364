"""The layer implementation's choice: Transformer Engine's spec where it is installed (with a GPU), the local spec
with SDPA elsewhere, and a clear error when Transformer Engine is asked for without it. Transformer Engine is not
installed on the machines these tests run on (nor on the GPU machine of the benchmarks), so its spec itself is
never built here."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch

from hf_mcore_bridge.convert import transformer_impl
from hf_mcore_bridge.convert.config_bridge import megatron_spec, transformer_config_kwargs
from hf_mcore_bridge.convert.layout import Layout
from hf_mcore_bridge.convert.placement import LOCAL_SPEC_MOE_NORM, MOE_PRE_MLP_NORM
from hf_mcore_bridge.grpo.refit.stream import _local_name
from hf_mcore_bridge.megatron.model import layer_spec
from hf_mcore_bridge.models.spec import ModelSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from random_checkpoint import TINY_SHAPE


@pytest.fixture
def tiny_model_cfg() -> ModelSpec:
    return megatron_spec(TINY_SHAPE)


@pytest.mark.parametrize(
    ("installed", "cuda", "expected"),
    [(True, True, "transformer_engine"), (True, False, "local"), (False, True, "local"), (False, False, "local")],
)
def test_transformer_engine_is_chosen_where_installed_with_a_gpu(monkeypatch, installed, cuda, expected):
    real = importlib.util.find_spec

    def find_spec(name, *args):
        if name == "transformer_engine":
            return object() if installed else None
        return real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert transformer_impl.default_transformer_impl() == expected


def test_this_machine_builds_the_local_spec_with_sdpa(tiny_model_cfg):
    from hf_mcore_bridge.megatron.sdpa_attention import SDPAttention

    assert not transformer_impl.transformer_engine_installed()
    kwargs = transformer_config_kwargs(tiny_model_cfg, Layout(), torch.float32)
    assert kwargs["transformer_impl"] == "local"
    spec = layer_spec(tiny_model_cfg, types.SimpleNamespace(**kwargs))
    assert spec.submodules.self_attention.submodules.core_attention is SDPAttention


def test_transformer_engine_without_it_is_a_clear_error(tiny_model_cfg):
    config = types.SimpleNamespace(transformer_impl="transformer_engine", sequence_parallel=False)
    with pytest.raises(ValueError, match="needs Transformer Engine, which is not installed"):
        layer_spec(tiny_model_cfg, config)
    with pytest.raises(ValueError, match="must be one of local, transformer_engine"):
        transformer_impl.check_transformer_impl("te")


def test_refit_finds_a_moe_norm_under_either_specs_name():
    template = f"decoder.layers.{{layer}}.{MOE_PRE_MLP_NORM}"
    local = {(template.replace(MOE_PRE_MLP_NORM, LOCAL_SPEC_MOE_NORM), 3): "decoder.layers.0.pre_mlp_layernorm.weight"}
    engine_names = {(template, 3): "decoder.layers.0.pre_mlp_layernorm.weight"}
    assert _local_name(local, template, 3) == "decoder.layers.0.pre_mlp_layernorm.weight"
    assert _local_name(engine_names, template, 3) == "decoder.layers.0.pre_mlp_layernorm.weight"
    assert _local_name(local, template, 4) is None
