"""Checkpoints and resume: a run stopped after step 2 and resumed to step 4 logs exactly the metrics of an
uninterrupted 4-step run (model, optimizer, LR schedule and prompt order all restored; sampling seeds per step)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_mcore_bridge.grpo.backends.megatron.checkpoint import latest_step
from hf_mcore_bridge.grpo.run.config import config_from_dict
from hf_mcore_bridge.grpo.run.trainer import RunResult, train_grpo

from ..tiny_policy import build_tiny_policy

pytestmark = pytest.mark.slow

TIMINGS = ("_s", "tokens_per_s")


def _config(root: Path, name: str, steps: int, policy: Path):
    prompts = root / "prompts.jsonl"
    if not prompts.exists():
        rows = [{"prompt": f"Repeat the digit {d}. Answer:", "answer": str(d)} for d in range(10)]
        prompts.write_text("\n".join(json.dumps(r) for r in rows))
    return config_from_dict(
        {
            "policy": {
                "model_path": str(policy),
                "megatron_cfg": {"tensor_model_parallel_size": 2, "micro_batch_size": 8, "optimizer": {"lr": 1e-2}},
            },
            "grpo": {
                "num_prompts_per_step": 4,
                "num_generations_per_prompt": 4,
                "max_num_steps": steps,
                "val_period": 2,
            },
            "loss_fn": {"kl_coef": 0.01},
            "generation": {"max_new_tokens": 3, "stop_token_ids": [0], "max_model_len": 64},
            "data": {"train_jsonl": str(prompts)},
            "checkpointing": {"enabled": True, "checkpoint_dir": str(root / name / "ckpt"), "save_period": 2},
            "logger": {"log_dir": str(root / name / "logs"), "print_progress": False},
        }
    )


def _comparable(result: RunResult) -> list[dict[str, float]]:
    return [{k: v for k, v in m.items() if not k.endswith(TIMINGS) and k != "initial_refit_s"} for m in result.metrics]


def test_resumed_run_repeats_the_uninterrupted_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policy = build_tiny_policy(tmp_path / "policy", seed=1)
    straight = train_grpo(_config(tmp_path, "straight", 4, policy))
    train_grpo(_config(tmp_path, "stopped", 2, policy))
    assert latest_step(tmp_path / "stopped" / "ckpt") == 2
    capsys.readouterr()
    resumed = train_grpo(_config(tmp_path, "stopped", 4, policy))
    assert f"resuming from step 2 ({tmp_path / 'stopped' / 'ckpt'})" in capsys.readouterr().out.splitlines()

    assert [m["step"] for m in resumed.metrics] == [1, 2, 3, 4]
    assert _comparable(resumed) == _comparable(straight)
    assert len({m["reward_mean"] for m in straight.metrics} | {m["kl_ref"] for m in straight.metrics}) > 2
    assert ["val_reward" in m for m in straight.metrics] == [False, True, False, True]
    ckpt = tmp_path / "stopped" / "ckpt"
    assert latest_step(ckpt) == 4
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "hf_assets",
        "iter_0000002",
        "iter_0000004",
        "latest_checkpointed_iteration.txt",
    ]  # no partial directory left behind
