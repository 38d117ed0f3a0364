"""GRPO step one of a GPT-OSS policy (sinks, a sliding and a full layer, YaRN, biased router and experts with the
clamped SwiGLU) on the megatron-core trainer at EP2 and at TP2 x EP2 (experts at ETP 1, megatron-core's limit for
biased experts; TP2 without EP is refused, see below), against `offpolicy_reference`: HF transformers + autograd
from the same initial weights on the same rollouts. Loss and gradient norm must agree; the refit's weight stream
(gathered over TP and EP through the mapping table, experts by their per-expert linear-layer names) must be the HF
checkpoint's tensors cut as transformers computes with them. Completions are longer than the window (3), so rows
see it; the rollouts are made here, without the engine (as `test_deepseek_step` makes them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hf_mcore_bridge.checkpoint import expert_parts
from hf_mcore_bridge.grpo.algorithm.batching import Rollout
from hf_mcore_bridge.grpo.errors import GRPOConfigError
from hf_mcore_bridge.grpo.run.config import config_from_dict
from hf_mcore_bridge.grpo.run.ranks import start_world
from hf_mcore_bridge.grpo.run.trainer import prepare_run
from hf_mcore_bridge.mappings.gpt_oss import FUSED_EXPERTS

from ...offpolicy_reference import ReferenceSettings, advantages_of, replay
from ...tiny_policy import WORDS, build_tiny_policy
from .engineless_ranks import train_step_rank

pytestmark = pytest.mark.slow

GROUP, KL = 4, 0.01
LAYOUTS = {
    "ep2": {"expert_model_parallel_size": 2},
    "tp2ep2": {"tensor_model_parallel_size": 2, "expert_model_parallel_size": 2, "sequence_parallel": True},
}


def _rollouts(path: Path) -> list[Rollout]:
    """16 rollouts (4 groups of 4) of random prompts and completions longer than the window, logged as the trainer
    logs them (`rollouts.jsonl`, for the reference)."""
    generator = torch.Generator().manual_seed(11)
    rows = []
    for i in range(16):
        prompt = torch.randint(1, len(WORDS), (3 + i % 3,), generator=generator).tolist()
        completion = torch.randint(1, len(WORDS), (4 + i % 3,), generator=generator).tolist()
        rows.append({"step": 1, "prompt_ids": prompt, "completion_ids": completion, "reward": float(i % 3 == 0)})
    for row in rows:
        row["engine_logprobs"] = [-1.0] * len(row["completion_ids"])
    path.write_text("\n".join(json.dumps(r) for r in rows))
    advantages = advantages_of([r["reward"] for r in rows], GROUP)
    fields = ("prompt_ids", "completion_ids", "engine_logprobs")
    return [Rollout(*(tuple(r[f]) for f in fields), r["reward"], a) for r, a in zip(rows, advantages, strict=True)]


def _per_expert(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors with each fused expert tensor cut into its experts' linear-layer tensors."""
    out = dict(hf)
    for template, (fused_template, part) in FUSED_EXPERTS.items():
        for layer in range(2):
            fused = hf[fused_template.format(layer=layer)]
            out.pop(fused_template.format(layer=layer), None)
            for expert in range(fused.shape[0]):
                out[template.format(layer=layer, expert=expert)] = expert_parts.take(fused[expert], part)
    return out


def test_biased_experts_under_tensor_parallelism_without_expert_parallelism_are_refused(tmp_path: Path) -> None:
    policy = build_tiny_policy(
        tmp_path / "policy", architecture="GptOssForCausalLM", layer_types=["sliding_attention", "full_attention"]
    )
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": "Say 1", "answer": "1"}))
    megatron = {"tensor_model_parallel_size": 2, "expert_tensor_parallel_size": 1, "sequence_parallel": True}
    config = config_from_dict(
        {
            "policy": {"model_path": str(policy), "megatron_cfg": megatron},
            "generation": {"stop_token_ids": [0]},
            "data": {"train_jsonl": str(tmp_path / "prompts.jsonl")},
            "logger": {"log_dir": str(tmp_path / "run"), "print_progress": False},
        }
    )
    with pytest.raises(GRPOConfigError, match="expert_model_parallel_size=1"):
        prepare_run(config)


@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_gpt_oss_first_step_matches_hf_reference(layout_name: str, tmp_path: Path) -> None:
    policy = build_tiny_policy(
        tmp_path / "policy",
        seed=3,
        architecture="GptOssForCausalLM",
        sliding_window=3,
        layer_types=["sliding_attention", "full_attention"],
    )
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": "Say 1", "answer": "1"}))
    megatron = {**LAYOUTS[layout_name], "expert_tensor_parallel_size": 1, "micro_batch_size": 4}
    config = config_from_dict(
        {
            "policy": {"model_path": str(policy), "megatron_cfg": {**megatron, "optimizer": {"lr": 1e-2}}},
            "grpo": {"num_prompts_per_step": 4, "num_generations_per_prompt": GROUP, "max_num_steps": 1},
            "loss_fn": {"kl_coef": KL},
            "generation": {"max_new_tokens": 6, "stop_token_ids": [0], "max_model_len": 64},
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
    hf = _per_expert(load_file(policy / "model.safetensors"))
    assert sorted(result["weights"]) == sorted(hf)
    for name, tensor in hf.items():
        assert torch.equal(result["weights"][name], tensor), name
