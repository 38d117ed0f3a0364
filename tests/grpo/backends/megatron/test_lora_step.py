"""A GRPO step with `policy.lora` on the megatron-core trainer at TP2 (no rollout engine) against HF transformers +
PEFT + autograd + torch's AdamW on the same rollouts, from the same initial adapters.

The trainer's adapters are initialised by the trainer (A seeded, B zero); the reference PEFT model takes those A
and B (its own initial values are not the trainer's), then both run one step: the loss, the gradient norm and the
gradients of every A and B (gathered whole) equal the reference's; the refit stream before the step equals the HF
checkpoint bit for bit (B = 0 leaves the merged weights the base's) and after it equals PEFT's `merge_and_unload`
of the reference's updated adapters, with exactly the targeted projections changed; the base parameters are
untouched and the optimizer holds the adapters alone. The stream after the step would show a wrong merge (scale,
rows) or a refit of the unmerged base; the gradients, adapters placed on the wrong rows (`tests/megatron/test_lora`
shows those checks failing).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hf_mcore_bridge.grpo.algorithm.batching import Rollout
from hf_mcore_bridge.grpo.run.config import GRPOConfig, config_from_dict
from hf_mcore_bridge.grpo.run.ranks import start_world
from hf_mcore_bridge.grpo.run.trainer import prepare_run
from hf_mcore_bridge.megatron.lora_config import PROJECTIONS

from ...offpolicy_reference import ReferenceSettings, _minibatch_loss, advantages_of, completion_logprobs
from ...tiny_policy import WORDS, build_tiny_policy
from .lora_step_ranks import lora_step_rank

pytestmark = pytest.mark.slow

GROUP, RANK, ALPHA, LR = 4, 4, 8.0, 1e-2


def _rows() -> list[dict]:
    generator = torch.Generator().manual_seed(7)
    rows = []
    for i in range(8):
        prompt = torch.randint(1, len(WORDS), (3 + i % 3,), generator=generator).tolist()
        completion = torch.randint(1, len(WORDS), (2 + 3 * (i % 2),), generator=generator).tolist()
        rows.append({"prompt_ids": prompt, "completion_ids": completion, "reward": float(i % 3 == 0)})
        rows[-1]["engine_logprobs"] = [-1.0] * len(completion)
    return rows


def _config(policy: Path, root: Path) -> GRPOConfig:
    (root / "prompts.jsonl").write_text(json.dumps({"prompt": "Say 1", "answer": "1"}))
    return config_from_dict(
        {
            "policy": {
                "model_path": str(policy),
                "megatron_cfg": {
                    "tensor_model_parallel_size": 2,
                    "micro_batch_size": 4,
                    "optimizer": {"lr": LR, "weight_decay": 0.0},
                },
                "lora": {"enabled": True, "rank": RANK, "alpha": ALPHA, "target_modules": list(PROJECTIONS)},
            },
            "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": GROUP, "max_num_steps": 1},
            "loss_fn": {"kl_coef": 0.0},
            "generation": {"max_new_tokens": 6, "stop_token_ids": [0], "max_model_len": 64},
            "data": {"train_jsonl": str(root / "prompts.jsonl")},
            "logger": {"log_dir": str(root / "run"), "print_progress": False},
            "cluster": {"gpus_per_node": 2},
        }
    )


def _reference(policy: Path, rows: list[dict], initial: dict) -> tuple[float, float, dict, dict]:
    """One step of HF + PEFT + autograd + AdamW (megatron-core's CPU optimizer is torch's AdamW): loss, gradient
    norm (before clipping at 1.0), the adapters' gradients by HF module name and the merged model's weights."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32),
        LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=list(PROJECTIONS)),
    )
    modules = {n.removeprefix("base_model.model."): m for n, m in model.named_modules() if hasattr(m, "lora_A")}
    modules = {n: m for n, m in modules.items() if "default" in m.lora_A}
    assert sorted(modules) == sorted(initial)
    with torch.no_grad():
        for name, m in modules.items():
            m.lora_A["default"].weight.copy_(initial[name][0])
            m.lora_B["default"].weight.copy_(initial[name][1])
    s = ReferenceSettings(group=GROUP, minibatches=1, temperature=1.0, lr=LR, momentum=0.0, clip_grad=1.0, kl_coef=0.0)
    advantages = advantages_of([r["reward"] for r in rows], GROUP)
    with torch.no_grad():
        old = [completion_logprobs(model, r, 1.0) for r in rows]
    loss = _minibatch_loss(model, rows, old, old, advantages, s)
    loss.backward()
    trainable = [p for p in model.parameters() if p.requires_grad]
    grads = {
        n: (m.lora_A["default"].weight.grad.clone(), m.lora_B["default"].weight.grad.clone())
        for n, m in modules.items()
    }
    grad_norm = float(torch.nn.utils.clip_grad_norm_(trainable, 1.0))
    torch.optim.AdamW(trainable, lr=LR, weight_decay=0.0).step()
    merged = model.merge_and_unload().state_dict()
    return float(loss.detach()), grad_norm, grads, merged


def test_lora_step_at_tp2_matches_hf_peft_reference(tmp_path: Path) -> None:
    policy = build_tiny_policy(tmp_path / "policy", seed=3)
    rows = _rows()
    config = _config(policy, tmp_path)
    prepared = prepare_run(config)
    advantages = advantages_of([r["reward"] for r in rows], GROUP)
    fields = ("prompt_ids", "completion_ids", "engine_logprobs")
    rollouts = [Rollout(*(tuple(r[f]) for f in fields), r["reward"], a) for r, a in zip(rows, advantages, strict=True)]
    start_world(prepared.plan.dims, lora_step_rank, config, prepared, rollouts, str(tmp_path / "out.pt"))
    got = torch.load(tmp_path / "out.pt", weights_only=True)

    base = load_file(policy / "model.safetensors")
    assert sorted(got["before"]) == sorted(base)
    assert all(torch.equal(got["before"][n], base[n]) for n in base)
    assert got["frozen_unchanged"]
    assert got["trainable"] == sum(
        a.numel() // 2 + b.numel() if n.endswith(("o_proj", "down_proj")) else a.numel() + b.numel() // 2
        for n, (a, b) in got["initial"].items()
    )

    loss, grad_norm, grads, merged = _reference(policy, rows, got["initial"])
    assert loss != 0.0
    assert got["metrics"]["loss"] == pytest.approx(loss, rel=1e-5, abs=1e-7)
    assert got["metrics"]["grad_norm"] == pytest.approx(grad_norm, rel=1e-5)
    for name, (want_a, want_b) in grads.items():
        mine_a, mine_b = got["grads"][name]
        assert (mine_a - want_a).abs().max() <= 1e-6, name  # zero at step one: B = 0
        assert (mine_b - want_b).abs().max() <= 1e-5 * want_b.abs().max(), name
    changed = {n for n in base if not torch.equal(got["after"][n], base[n])}
    assert changed == {n for n in base if n.rsplit(".", 2)[-2] in PROJECTIONS}, sorted(changed)
    for name, tensor in got["after"].items():
        torch.testing.assert_close(tensor, merged[name], atol=1e-6, rtol=0, msg=name)
