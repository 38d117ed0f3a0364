"""What every registered architecture gets without a test of its own: one parametrisation over the registry, so a
new architecture file is covered as soon as its line is in `models.registry.REGISTRY`.

For each one's tiny model (`Architecture.tiny`, built by transformers from the config, no download):
- its description reads the same from the config dict as from transformers' own config object, and survives
  `to_hf` (the export) and megatron-core's `args` (a checkpoint without HF assets);
- the engine takes transformers' state dict as it is, every tensor placed and none left over, and its log-probs
  equal those of transformers' forward pass (fp32);
- conversion to megatron-core at TP2 x PP2 (x EP2 for mixture-of-experts) and back gives the checkpoint's tensors
  bit for bit.
Logit parity through megatron-core itself (multi-process worlds) covers the tiny models of `tiny_variants.VARIANTS` and
`MOE_VARIANTS`; `test_every_architecture_has_a_tiny_model_in_the_suites` keeps every architecture in them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_weights import assert_same_weights
from tiny_variants import MOE_VARIANTS, VARIANTS
from transformers import AutoConfig, AutoModelForCausalLM

from hf_mcore_bridge.convert import config_bridge
from hf_mcore_bridge.convert.layout import Layout
from hf_mcore_bridge.convert.to_hf import convert_mcore_to_hf
from hf_mcore_bridge.convert.to_mcore import convert_hf_to_mcore
from hf_mcore_bridge.engine import Engine, EngineConfig, SamplingParams
from hf_mcore_bridge.models.registry import REGISTRY
from hf_mcore_bridge.models.spec import ModelSpec
from hf_mcore_bridge.models.tiny_models import build_tiny_model, tiny_config

NAMES = sorted(REGISTRY)


def _transformers_config(name: str) -> object:
    config = tiny_config(name)
    return AutoConfig.for_model(config.pop("model_type"), **config)


@pytest.mark.parametrize("name", NAMES)
def test_the_description_reads_alike_from_transformers_and_survives_export(name: str) -> None:
    raw = ModelSpec.from_hf(tiny_config(name))
    normalised = ModelSpec.from_hf(_transformers_config(name))
    assert normalised == raw
    assert ModelSpec.from_hf(raw.to_hf()) == raw
    exported = raw.to_hf()  # and transformers takes what `to_hf` writes
    assert AutoConfig.for_model(exported.pop("model_type"), **exported).architectures == [name]


@pytest.mark.parametrize("name", NAMES)
def test_megatron_args_give_the_description_back(name: str) -> None:
    spec = config_bridge.megatron_spec(tiny_config(name, torch_dtype="float32"))  # `args` record the dtype
    args = config_bridge.megatron_args(spec, Layout(), torch.float32)
    assert config_bridge.from_megatron_args(args) == spec
    del args.hf_architecture  # a checkpoint Megatron-LM wrote: the features find an architecture of the same spec
    found = config_bridge.from_megatron_args(args)
    assert found.to_hf()["architectures"] == [found.architecture]


def _reference_logprobs(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> list[float]:
    """log_softmax of transformers' logits at each generated token, from one forward pass over prompt + tokens."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [logprobs[len(prompt) - 1 + i, token].item() for i, token in enumerate(tokens)]


@pytest.mark.parametrize("name", NAMES)
def test_the_engine_runs_transformers_weights_as_transformers_does(name: str) -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_transformers_config(name), dtype=torch.float32).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:  # norms start at 1, biases at 0: randomised so a misplaced one shows
                param.add_(torch.randn_like(param) * 0.1)
    config = EngineConfig(device="cpu", dtype=torch.float32, max_model_len=64, kv_cache_memory_bytes=8 << 20)
    engine = Engine(model.config, config)
    loaded = engine.load_weights(model.state_dict().items())
    engine.model.check_loaded()
    assert loaded == set(engine.model.targets)
    prompt = torch.randint(0, model.config.vocab_size, (9,), generator=torch.Generator().manual_seed(1)).tolist()
    (output,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6))
    sample = output.samples[0]
    assert sample.logprobs == pytest.approx(_reference_logprobs(model, prompt, sample.token_ids), abs=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_conversion_round_trip_is_bit_exact(name: str, tmp_path: Path) -> None:
    hf_dir = build_tiny_model(tmp_path / "hf", name, seed=5)
    biased = ModelSpec.from_hf(tiny_config(name)).moe
    etp = 1 if biased is not None and biased.expert_mlp_bias else None  # megatron-core: biased experts at ETP 1
    layout = Layout(tp=2, pp=2, ep=2 if REGISTRY[name].is_moe else 1, etp=etp)
    convert_hf_to_mcore(hf_dir, tmp_path / "mcore", layout=layout, show_progress=False)
    convert_mcore_to_hf(tmp_path / "mcore", tmp_path / "back", show_progress=False)
    assert_same_weights(hf_dir, tmp_path / "back")


def test_every_architecture_has_a_tiny_model_in_the_suites() -> None:
    """The round trips at every layout, the megatron-core parity worlds and the CLI tests build their tiny models
    from these two lists."""
    assert {arch for arch, _ in (*VARIANTS.values(), *MOE_VARIANTS.values())} == set(REGISTRY)
