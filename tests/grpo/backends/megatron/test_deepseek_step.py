"""GRPO step one of a DeepSeek-V3 policy (multi-latent attention, sigmoid router with expert bias, shared experts,
a dense first layer) at EP2 on the megatron-core trainer, against `offpolicy_reference`: HF transformers + autograd
from the same initial weights on the same rollouts. Loss and gradient norm must agree; the refit's weight stream
(gathered over EP through the mapping table) must equal the HF checkpoint bit for bit.

The rollouts are made here (random completions, group rewards) and handed to the trainer's own step
(`trainer._train_step`) on every rank, so the refit's stream can be compared with the checkpoint itself; the full
`train_grpo` run, with rollouts from the engine's multi-latent attention, the engine-side refit and the
engine/trainer log-prob gate, is `test_layouts.py::test_mla_first_step_matches_hf_reference`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hf_mcore_bridge.grpo.algorithm.batching import Rollout
from hf_mcore_bridge.grpo.run.config import config_from_dict
from hf_mcore_bridge.grpo.run.ranks import start_world
from hf_mcore_bridge.grpo.run.trainer import prepare_run

from ...offpolicy_reference import ReferenceSettings, advantages_of, replay
from ...tiny_policy import WORDS, build_tiny_policy
from .engineless_ranks import train_step_rank

pytestmark = pytest.mark.slow

GROUP, KL = 4, 0.01


def _rollouts(path: Path) -> list[Rollout]:
    """16 rollouts (4 groups of 4) of random prompts and completions over the tiny vocabulary, logged as the
    trainer logs them (`rollouts.jsonl`, for the reference)."""
    generator = torch.Generator().manual_seed(11)
    rows = []
    for i in range(16):
        prompt = torch.randint(1, len(WORDS), (3 + i % 3,), generator=generator).tolist()
        completion = torch.randint(1, len(WORDS), (2 + i % 2,), generator=generator).tolist()
        rows.append({"step": 1, "prompt_ids": prompt, "completion_ids": completion, "reward": float(i % 3 == 0)})
    for row in rows:
        row["engine_logprobs"] = [-1.0] * len(row["completion_ids"])
    path.write_text("\n".join(json.dumps(r) for r in rows))
    advantages = advantages_of([r["reward"] for r in rows], GROUP)
    fields = ("prompt_ids", "completion_ids", "engine_logprobs")
    return [Rollout(*(tuple(r[f]) for f in fields), r["reward"], a) for r, a in zip(rows, advantages, strict=True)]


def test_deepseek_v3_first_step_at_ep2_matches_hf_reference(tmp_path: Path) -> None:
    policy = build_tiny_policy(
        tmp_path / "policy", seed=3, architecture="DeepseekV3ForCausalLM", num_hidden_layers=2
    )  # layer 0 dense, layer 1 routed (first_k_dense_replace=1)
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": "Say 1", "answer": "1"}))
    config = config_from_dict(
        {
            "policy": {
                "model_path": str(policy),
                "megatron_cfg": {"expert_model_parallel_size": 2, "micro_batch_size": 4, "optimizer": {"lr": 1e-2}},
            },
            "grpo": {"num_prompts_per_step": 4, "num_generations_per_prompt": GROUP, "max_num_steps": 1},
            "loss_fn": {"kl_coef": KL},
            "generation": {"max_new_tokens": 3, "stop_token_ids": [0], "max_model_len": 64},
            "data": {"train_jsonl": str(tmp_path / "prompts.jsonl")},
            "logger": {"log_dir": str(tmp_path / "run"), "print_progress": False},
        }
    )
    rollouts = _rollouts(tmp_path / "rollouts.jsonl")
    prepared = prepare_run(config)
    start_world(prepared.plan.dims, train_step_rank, config, prepared, rollouts, str(tmp_path / "step.pt"))
    result = torch.load(tmp_path / "step.pt", weights_only=True)
    settings = ReferenceSettings(group=GROUP, minibatches=1, temperature=1.0, lr=0.0, momentum=0.0, clip_grad=1.0,
                                 kl_coef=KL)  # fmt: skip
    ((expected,),) = replay(policy, tmp_path / "rollouts.jsonl", 1, settings)
    metrics = result["metrics"]
    assert expected["grad_norm"] > 0
    assert metrics["loss"] == pytest.approx(expected["loss"], rel=1e-4, abs=1e-7)
    assert metrics["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-4)
    hf = load_file(policy / "model.safetensors")
    assert sorted(result["weights"]) == sorted(hf)
    for name, tensor in hf.items():
        assert torch.equal(result["weights"][name], tensor), name
