"""`generation.precision: fp8` in the GRPO loop: its config checks, its gate default, and one CPU step whose
rollouts came from the FP8 engine (the mismatch is logged and the `tis` correction acts on it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_mcore_bridge.grpo.errors import GRPOConfigError
from hf_mcore_bridge.grpo.refit.logprob_gate import FP8_MAX_TOKEN_MULT_PROB_ERROR, limit_of
from hf_mcore_bridge.grpo.run import trainer
from hf_mcore_bridge.grpo.run.config import config_from_dict

from ..tiny_policy import build_tiny_policy


def _base(**generation: object) -> dict:
    return {
        "policy": {"model_path": "/m"},
        "data": {"task": "repeat_digit"},
        "generation": generation,
    }


def test_precision_is_checked_and_sets_the_gate_default() -> None:
    assert limit_of(config_from_dict(_base())) == 1.0001
    assert limit_of(config_from_dict(_base(precision="fp8"))) == FP8_MAX_TOKEN_MULT_PROB_ERROR
    with pytest.raises(GRPOConfigError, match=r"generation\.precision='fp4': dtype or fp8"):
        config_from_dict(_base(precision="fp4"))
    with pytest.raises(GRPOConfigError, match="embedded engine only"):
        config_from_dict(_base(precision="fp8", backend="vllm"))


@pytest.mark.slow
def test_one_grpo_step_with_fp8_rollouts_logs_the_mismatch_and_corrects_it(tmp_path: Path) -> None:
    policy = build_tiny_policy(tmp_path / "policy")
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"prompt": f"Repeat the digit {d}. Answer:", "answer": str(d)} for d in range(4)]
    prompts.write_text("\n".join(json.dumps(r) for r in rows))
    config = config_from_dict(
        {
            "policy": {"model_path": str(policy), "megatron_cfg": {"micro_batch_size": 4}},
            "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 4, "max_num_steps": 1},
            "loss_fn": {"is_correction": "tis", "tis_cap": 1.0},
            "generation": {"precision": "fp8", "max_new_tokens": 4, "max_model_len": 64},
            "data": {"train_jsonl": str(prompts)},
            "logger": {"log_dir": str(tmp_path / "log"), "print_progress": False},
        }
    )
    (step,) = trainer.train_grpo(config).metrics
    # fp32 trainer vs FP8 engine: far past the fp32 limit (1.0001), within the fp8 default
    assert 1.0001 < step["token_mult_prob_error"] <= FP8_MAX_TOKEN_MULT_PROB_ERROR
    # the probe prompt's few greedy tokens are confident ones: smaller, still past fp32 agreement (~1e-6)
    assert 1.00001 < step["probe_token_mult_prob_error"] <= FP8_MAX_TOKEN_MULT_PROB_ERROR
    print({k: step[k] for k in ("token_mult_prob_error", "probe_token_mult_prob_error", "is_truncated_fraction")})
    assert step["is_truncated_fraction"] > 0  # tis capped the tokens the engine under-rated
