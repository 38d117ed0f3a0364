"""The engine applying LoRA adapters in its linears (`engine.lora`) against PEFT's LoRA model in transformers."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import engine_greedy, hf_greedy, hf_token_logprobs, hub_weights, random_prompts, tiny_engine_config
from lora_helpers import ALPHA, RANK, TARGETS, adapter_tensors, peft_model
from transformers import AutoConfig

from hf_mcore_bridge.engine import Engine, SamplingParams
from hf_mcore_bridge.engine.model import MissingWeightsError
from hf_mcore_bridge.models.tiny_models import tiny_config


def _lora_engine(base, scale: float = ALPHA / RANK, **overrides: object) -> Engine:
    config = tiny_engine_config(lora_rank=RANK, lora_scale=scale, lora_targets=TARGETS, **overrides)
    return Engine(base.config, config)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_engine_adapters_give_peft_log_probs_and_tokens(arch, get_hf_model):
    base = get_hf_model(arch, 0)
    weights = hub_weights(base)
    model = peft_model(base)
    adapters = adapter_tensors(model)
    assert len(adapters) == 2 * len(TARGETS) * base.config.num_hidden_layers
    engine = _lora_engine(base)
    engine.load_weights(weights + adapters)
    prompts = random_prompts([5, 9], seed=1)
    with torch.no_grad():
        assert engine_greedy(engine, prompts) == [hf_greedy(model, p, 10) for p in prompts]
    (out,) = engine.generate([prompts[1]], SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=3))
    for sample in out.samples:
        reference = hf_token_logprobs(model, prompts[1], sample.token_ids, 1.0)
        assert sample.logprobs == pytest.approx(reference, abs=1e-5)
    # a break: the adapters at twice their scale give other log-probs
    doubled = _lora_engine(base, scale=2 * ALPHA / RANK)
    doubled.load_weights(weights + adapters)
    (out,) = doubled.generate([prompts[1]], SamplingParams(n=1, temperature=1.0, max_tokens=8, seed=3))
    reference = hf_token_logprobs(model, prompts[1], out.samples[0].token_ids, 1.0)
    assert max(abs(a - b) for a, b in zip(out.samples[0].logprobs, reference, strict=True)) > 1e-3


def test_adapters_must_be_loaded_and_reload_in_place(get_hf_model):
    base = get_hf_model("llama", 0)
    model = peft_model(base)
    engine = _lora_engine(base)
    engine.load_weights(hub_weights(base))
    with pytest.raises(MissingWeightsError, match="lora_A"):
        engine.model.check_loaded()
    adapters = dict(adapter_tensors(model))
    engine.load_weights(adapters.items())
    engine.model.check_loaded()
    # B's blocks sit in the fused qkv's rows of each projection, zero elsewhere
    qkv = engine.model.model.layers[0].self_attn.qkv_proj
    q_rows = base.config.num_attention_heads * base.config.head_dim
    kv_rows = base.config.num_key_value_heads * base.config.head_dim
    b = adapters["model.layers.0.self_attn.k_proj.lora_B.weight"]
    assert torch.equal(qkv.lora_b[q_rows : q_rows + kv_rows, RANK : 2 * RANK], b)
    assert not qkv.lora_b[:q_rows, RANK:].any() and not qkv.lora_b[q_rows + kv_rows :, RANK : 2 * RANK].any()
    engine.sleep(level=2)
    engine.wake_up()
    assert not qkv.lora_b.any()  # reallocated: zero until loaded
    engine.load_weights(hub_weights(base) + list(adapters.items()))
    assert torch.equal(qkv.lora_b[q_rows : q_rows + kv_rows, RANK : 2 * RANK], b)


def test_adapters_on_what_the_engine_cannot_adapt_are_refused():
    fields = tiny_config("DeepseekV3ForCausalLM")
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with pytest.raises(ValueError, match="dense attention and MLP projections only"):
        Engine(config, tiny_engine_config(lora_rank=RANK, lora_targets=("kv_b_proj",)))
    with pytest.raises(ValueError, match="no projection"):
        Engine(config, tiny_engine_config(lora_rank=RANK, lora_targets=("q_proj",)))
