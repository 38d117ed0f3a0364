"""One mini-batch per step: the old log-probs come from the training forward (issue 21, requirement 3).

The update (weights after the step, loss, grad_norm, every metric) equals that of the separate-pass path
(`grpo.separate_old_logprobs: true`, the path every mini-batch after the first still takes) on CPU in fp32, for
the megatron-core policy and the DTensor one, with a KL term and a `tis` correction acting (the engine's log-probs
are shifted); forward hooks count the passes that are gone; the rollouts' gate sees the same
`token_mult_prob_error` and, when it raises, no weight has moved.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from hf_mcore_bridge.grpo.algorithm.batching import Rollout
from hf_mcore_bridge.grpo.run import trainer
from hf_mcore_bridge.grpo.run.config import config_from_dict
from hf_mcore_bridge.grpo.run.ranks import start_world

from ..tiny_policy import build_tiny_policy
from .fused_ranks import fused_step_rank

ROWS, MICRO = 8, 2
"""Rollouts of the step and rows per micro-batch: 4 micro-batches."""


def _config(root: Path, policy: Path, dtensor: bool, **grpo: object) -> object:
    prompts = root / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "Repeat the digit 3. Answer:", "answer": "3"}))
    backend = (
        {"dtensor_cfg": {"enabled": True, "micro_batch_size": MICRO}, "megatron_cfg": {"enabled": False}}
        if dtensor
        else {"megatron_cfg": {"micro_batch_size": MICRO}}
    )
    return config_from_dict(
        {
            "policy": {"model_path": str(policy), **backend},
            "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 4, "max_num_steps": 1, **grpo},
            "loss_fn": {"kl_coef": 0.05, "is_correction": "tis", "tis_cap": 1.05},
            "generation": {"temperature": 0.8, "max_new_tokens": 4, "max_model_len": 64},
            "data": {"train_jsonl": str(prompts)},
            "logger": {"log_dir": str(root / "log"), "print_progress": False},
        }
    )


def _rollouts() -> list[Rollout]:
    generator = torch.Generator().manual_seed(3)
    out = []
    for i in range(ROWS):
        prompt = tuple(torch.randint(1, 18, (3 + i % 3,), generator=generator).tolist())
        completion = tuple(torch.randint(0, 18, (2 + i % 4,), generator=generator).tolist())
        engine = tuple((-2.5 + 0.3 * torch.randn(len(completion), generator=generator)).tolist())
        out.append(Rollout(prompt, completion, engine, reward=float(i % 2), advantage=(-1.0) ** i * (1 + i / 8)))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("dtensor", [False, True], ids=["megatron", "dtensor"])
def test_one_minibatch_update_equals_the_separate_pass_update(tmp_path: Path, dtensor: bool) -> None:
    policy = build_tiny_policy(tmp_path / "hf")
    fused = _config(tmp_path, policy, dtensor)
    separate = _config(tmp_path, policy, dtensor, separate_old_logprobs=True)
    assert trainer.fuses_old_logprobs(fused) and not trainer.fuses_old_logprobs(separate)
    no_kl = dataclasses.replace(fused, loss_fn=dataclasses.replace(fused.loss_fn, kl_coef=0.0))
    prepared = trainer.prepare_run(fused)
    configs = {"fused": fused, "separate": separate, "no_kl": no_kl, "refuse_fused": fused}
    out = tmp_path / "results.pt"
    start_world(prepared.plan.dims, fused_step_rank, configs, prepared, _rollouts(), str(out))
    results = torch.load(out, weights_only=False)
    want, got = results["separate"], results["fused"]

    micro = ROWS // MICRO
    assert want["forwards"] == 3 * micro  # old, reference, training
    assert got["forwards"] == 2 * micro  # reference, training
    assert results["no_kl"]["forwards"] == micro  # training only
    assert "kl_ref" in got["metrics"] and "kl_ref" not in results["no_kl"]["metrics"]

    for a, b in zip(want["weights"], got["weights"], strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
    assert not got["unchanged"]  # the step moved the weights
    for key, value in want["metrics"].items():
        if not key.endswith("_s"):
            assert got["metrics"][key] == pytest.approx(value, rel=1e-6, abs=1e-7), key
    assert got["metrics"]["is_truncated_fraction"] > 0  # the tis correction acted on the old log-probs
    assert got["metrics"]["kl_ref"] == pytest.approx(0.0, abs=1e-12)  # the reference is the step's start
    assert got["gated"] == [pytest.approx(want["gated"][0], rel=1e-6)] and want["gated"][0] > 1.01

    refused = results["refuse_fused"]
    assert refused["stopped"] and refused["unchanged"] and refused["forwards"] == 2 * micro
