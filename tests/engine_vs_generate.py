"""The engine's greedy completions against transformers' `generate` on a real model (fp32, CPU): the check the
real-model tests share (`tests/megatron/test_real_model.py`, `test_real_gemma3.py`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file


def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int, eos: int | None = None) -> list[int]:
    """transformers' greedy `generate` on one unpadded prompt; the new tokens only."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def greedy_as_generate(
    directory: Path, model: Any, prompts: list[list[int]], end: int, max_tokens: int, logprob_tol: float, **engine: Any
) -> list[tuple[list[int], torch.Tensor]]:
    """The engine (`EngineConfig(**engine)`, fp32 on the CPU) loaded from `directory`'s safetensors generates
    greedily from `prompts`, stopping at `end`; each sample's tokens must equal `model.generate`'s and its log-probs
    transformers' log-softmax at those tokens (float64, within `logprob_tol`). Returns, per prompt, the tokens and
    transformers' log-probs of them."""
    from hf_mcore_bridge.engine import Engine, EngineConfig, SamplingParams

    config = EngineConfig(dtype=torch.float32, device="cpu", **engine)
    runner = Engine(json.loads((directory / "config.json").read_text()), config)
    runner.load_weights(load_file(directory / "model.safetensors").items())
    outputs = runner.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=(end,)))
    results = []
    for prompt, output in zip(prompts, outputs, strict=True):
        reference = hf_greedy(model, prompt, max_tokens, eos=end)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + reference])).logits[0, len(prompt) - 1 : -1]
        (sample,) = output.samples
        assert sample.token_ids == reference
        expected = torch.log_softmax(logits.double(), -1).gather(1, torch.tensor(reference)[:, None])[:, 0]
        assert sample.logprobs == pytest.approx(expected.tolist(), abs=logprob_tol)
        results.append((reference, expected))
    return results
