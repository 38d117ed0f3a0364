"""Loading weights (HF safetensors directory, `load_weights` refit in pieces and in any order), the errors for
unknown and missing names, and sleep / wake_up."""

from __future__ import annotations

import random

import pytest
import torch
from engine_helpers import GREEDY, engine_from_hf, engine_greedy, hf_greedy, random_prompts, tiny_engine_config

from hf_mcore_bridge.engine import (
    Engine,
    EngineAsleepError,
    MissingWeightsError,
    UnknownWeightError,
)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])  # tied and untied output layer
def test_refit_switches_to_the_new_weights_exactly(arch, get_hf_model, tmp_path):
    first, second = get_hf_model(arch, 0), get_hf_model(arch, 1)
    first.save_pretrained(tmp_path)
    engine = Engine.from_pretrained(tmp_path, tiny_engine_config())
    prompts = random_prompts([4, 13], seed=8)
    before = engine_greedy(engine, prompts)
    assert before == [hf_greedy(first, p, 10) for p in prompts]

    items = list(second.state_dict().items())
    random.Random(0).shuffle(items)
    loaded: set[str] = set()
    for chunk in (items[:5], items[5:17], items[17:]):
        loaded |= engine.load_weights(iter(chunk))
    after = engine_greedy(engine, prompts)
    expected = [hf_greedy(second, p, 10) for p in prompts]
    assert after == expected
    assert after != before
    assert loaded == set(engine.model.targets)


def test_unknown_name_is_an_error_naming_it(get_hf_model):
    engine = engine_from_hf(get_hf_model("llama"))
    with pytest.raises(UnknownWeightError, match=r"model\.layers\.0\.self_attn\.qq_proj\.weight"):
        engine.load_weights([("model.layers.0.self_attn.qq_proj.weight", torch.zeros(64, 64))])
    with pytest.raises(UnknownWeightError, match=r"model\.layers\.2\.mlp\.up_proj\.weight"):
        engine.load_weights([("model.layers.2.mlp.up_proj.weight", torch.zeros(96, 64))])


def test_wrong_shape_is_an_error_naming_it(get_hf_model):
    engine = engine_from_hf(get_hf_model("qwen2"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias"):
        engine.load_weights([("model.layers.1.self_attn.k_proj.bias", torch.zeros(64))])


def test_missing_name_is_an_error_naming_it(get_hf_model):
    model = get_hf_model("qwen2")
    engine = Engine(model.config, tiny_engine_config())
    skipped = "model.layers.1.self_attn.v_proj.bias"
    engine.load_weights((k, v) for k, v in model.state_dict().items() if k != skipped)
    with pytest.raises(MissingWeightsError, match=r"model\.layers\.1\.self_attn\.v_proj\.bias"):
        engine.check_loaded()
    with pytest.raises(MissingWeightsError, match=r"v_proj\.bias"):
        engine.generate([[1, 2, 3]], GREEDY)
    engine.load_weights([(skipped, model.state_dict()[skipped])])
    engine.check_loaded()


def test_untied_model_requires_lm_head(get_hf_model):
    model = get_hf_model("mistral")
    engine = Engine(model.config, tiny_engine_config())
    engine.load_weights((k, v) for k, v in model.state_dict().items() if k != "lm_head.weight")
    with pytest.raises(MissingWeightsError, match=r"lm_head\.weight"):
        engine.check_loaded()


def test_sleep_and_wake_up(get_hf_model):
    model = get_hf_model("llama")
    engine = engine_from_hf(model)
    prompts = random_prompts([6, 10], seed=9)
    expected = [hf_greedy(model, p, 10) for p in prompts]

    engine.sleep(level=1)
    assert engine.kv_cache is None
    with pytest.raises(EngineAsleepError):
        engine.generate(prompts, GREEDY)
    engine.wake_up()
    assert engine_greedy(engine, prompts) == expected

    engine.sleep(level=2)
    assert engine.kv_cache is None
    assert all(p.numel() == 0 for p in engine.model.parameters())
    with pytest.raises(EngineAsleepError):
        engine.load_weights(model.state_dict().items())
    engine.wake_up()
    with pytest.raises(MissingWeightsError, match="sleep"):
        engine.generate(prompts, GREEDY)
    engine.load_weights(model.state_dict().items())
    assert engine_greedy(engine, prompts) == expected
