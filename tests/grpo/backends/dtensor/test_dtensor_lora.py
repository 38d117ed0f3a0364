"""LoRA on the DTensor backend (PEFT's LoRA layers under FSDP2), in a two-process gloo world at dp_shard=2, against
HF transformers + PEFT + autograd + torch's AdamW written here.

- One `train_minibatch` (two micro-batches per rank, KL term, clipping active) from the trainer's initial adapters
  (A seeded as the megatron-core backend seeds it, B zero), copied into a PEFT model: the loss, the gradient norm
  and every updated A and B equal the reference's; the base weights are untouched; the optimizer holds the adapters
  alone; the merged stream equals PEFT's `merge_and_unload` of the reference's updated adapters, with exactly the
  targeted projections changed; the base stream (`merged=False`) equals the HF checkpoint.
- A short GRPO run with the embedded engine: every step's rollouts and probe prompt have the trainer's log-probs
  within fp32 agreement (the engine holds the merged weights), every refit after the initial one streams the
  adapted projections alone, and the run's PEFT directory loads with `PeftModel.from_pretrained`; a run started
  from that directory (`policy.lora.adapter_path`) at lr 0 writes the same adapters back.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hf_mcore_bridge.grpo.algorithm.batching import make_microbatches
from hf_mcore_bridge.grpo.algorithm.losses import LossConfig, grpo_loss
from hf_mcore_bridge.grpo.backends.dtensor.config import DTensorConfig
from hf_mcore_bridge.megatron.lora_config import PROJECTIONS, LoraConfig
from hf_mcore_bridge.megatron.world import run_torch_world

from ...tiny_policy import WORDS, build_tiny_policy
from .dtensor_ranks import lora_step_rank
from .test_dtensor import ROLLOUTS, TEMPERATURE, _reference_logprobs

pytestmark = pytest.mark.slow

MICRO_BATCH, LR, WEIGHT_DECAY, CLIP = 2, 1e-2, 0.1, 0.05
LOSS = LossConfig(kl_coef=0.05)
LORA = LoraConfig(enabled=True, rank=4, alpha=8.0, target_modules=PROJECTIONS)
EXACT = 1.0001


def _peft_reference(policy: Path, initial: dict) -> tuple[torch.nn.Module, dict]:
    """HF + PEFT with the trainer's initial adapters; its LoRA modules by HF module name."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32, attn_implementation="eager")
    model = get_peft_model(hf, PeftLoraConfig(r=LORA.rank, lora_alpha=LORA.alpha, target_modules=list(PROJECTIONS)))
    modules = {n.removeprefix("base_model.model."): m for n, m in model.named_modules() if hasattr(m, "lora_A")}
    modules = {n: m for n, m in modules.items() if "default" in m.lora_A}
    assert sorted(modules) == sorted(initial)
    with torch.no_grad():
        for name, m in modules.items():
            m.lora_A["default"].weight.copy_(initial[name][0])
            m.lora_B["default"].weight.copy_(initial[name][1])
    return model, modules


def test_lora_step_at_dp_shard2_matches_hf_peft_reference(tmp_path: Path) -> None:
    policy = build_tiny_policy(tmp_path / "policy", seed=5)
    settings = DTensorConfig(enabled=True, data_parallel_shard_size=2, lr=LR, weight_decay=WEIGHT_DECAY, clip_grad=CLIP)
    out = tmp_path / "out.pt"
    run_torch_world(lora_step_rank, 2, str(policy), settings, LORA, ROLLOUTS, MICRO_BATCH, LOSS, TEMPERATURE, str(out))
    got = torch.load(out, weights_only=True)
    assert all(not b.any() for _, b in got["initial"].values()) and all(a.any() for a, _ in got["initial"].values())

    model, modules = _peft_reference(policy, got["initial"])
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert got["held"] == sum(p.numel() for p in trainable)  # the optimizer holds the adapters alone
    optimizer = torch.optim.AdamW(trainable, lr=LR, weight_decay=WEIGHT_DECAY)  # all matrices: all decayed
    batches = make_microbatches(ROLLOUTS, MICRO_BATCH)
    count = sum(b.mask.sum() for b in batches)
    total = 0.0
    for batch in batches:
        logprobs = _reference_logprobs(model, batch).nan_to_num()
        with torch.no_grad():
            old = _reference_logprobs(model, batch).nan_to_num()  # B = 0: the base model, also the KL reference
        loss, _ = grpo_loss(logprobs, old, batch.advantages, batch.mask, count, LOSS, ref_logprobs=old)
        loss.backward()
        total += float(loss.detach())
    norm = torch.nn.utils.clip_grad_norm_(trainable, CLIP)
    assert float(norm) > CLIP  # the clipping path is exercised
    optimizer.step()

    assert got["metrics"]["loss"] == pytest.approx(total, abs=1e-6)
    assert got["metrics"]["grad_norm"] == pytest.approx(float(norm), rel=1e-5)
    for name, m in modules.items():
        a, b = got["trained"][name]
        torch.testing.assert_close(a, m.lora_A["default"].weight.detach(), atol=1e-5, rtol=0, msg=name)
        torch.testing.assert_close(b, m.lora_B["default"].weight.detach(), atol=1e-5, rtol=0, msg=name)
    assert max(b.abs().max() for _, b in got["trained"].values()) > 100 * 1e-5  # the step is far larger

    hf = load_file(policy / "model.safetensors")
    assert got["base"].keys() == hf.keys() and all(torch.equal(got["base"][n], hf[n]) for n in hf)
    merged = model.merge_and_unload().state_dict()
    changed = {n for n in hf if not torch.equal(got["merged"][n], hf[n])}
    assert changed == {n for n in hf if n.rsplit(".", 2)[-2] in PROJECTIONS} == set(got["adapted"])
    for name, tensor in got["merged"].items():
        torch.testing.assert_close(tensor, merged[name], atol=1e-5, rtol=0, msg=name)
    assert got["only"].keys() == set(got["adapted"])
    assert all(torch.equal(got["only"][n], got["merged"][n]) for n in got["adapted"])


def test_lora_run_keeps_engine_and_trainer_in_agreement(tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hf_mcore_bridge.grpo.run.config import config_from_dict
    from hf_mcore_bridge.grpo.run.trainer import ADAPTER_DIR, train_grpo

    policy = build_tiny_policy(tmp_path / "policy")
    prompts = tmp_path / "say7.jsonl"
    rows = [{"prompt": " ".join(["Say"] + ["7"] * k) + ". Answer:", "answer": "7"} for k in range(1, 7)]
    prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    steps = 3
    config = {
        "policy": {
            "model_path": str(policy),
            "megatron_cfg": {"enabled": False},
            "dtensor_cfg": {"enabled": True, "data_parallel_shard_size": 2, "micro_batch_size": 16, "lr": 5e-2},
            "lora": {"enabled": True, "rank": 4, "alpha": 8, "target_modules": list(PROJECTIONS)},
        },
        "grpo": {"num_prompts_per_step": 4, "num_generations_per_prompt": 8, "max_num_steps": steps},
        "loss_fn": {"kl_coef": 0.01},
        "generation": {"max_new_tokens": 3, "stop_token_ids": [WORDS.index("[EOS]")], "max_model_len": 64},
        "data": {"train_jsonl": str(prompts)},
        "reward": {"name": "number"},
        "logger": {"log_dir": str(tmp_path / "logs"), "print_progress": False},
    }
    run = train_grpo(config_from_dict(config))
    assert run.steps == steps
    for step in run.metrics:
        assert step["token_mult_prob_error"] <= EXACT, step["step"]
        assert step["probe_token_mult_prob_error"] <= EXACT, step["step"]
        assert step["grad_norm"] > 0
    weights = load_file(policy / "model.safetensors")
    adapted = sum(t.numel() * t.element_size() for n, t in weights.items() if n.rsplit(".", 2)[-2] in PROJECTIONS)
    assert run.series("refit_bytes") == [adapted] * steps  # after the initial refit: the adapted projections alone
    directory = tmp_path / "logs" / ADAPTER_DIR
    written = load_file(directory / "adapter_model.safetensors")
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32), directory)
    held = {k.replace(".default", ""): v for k, v in loaded.state_dict().items() if ".lora_" in k}
    assert sorted(held) == sorted(written) and all(torch.equal(held[k], written[k]) for k in written)
    assert all(written[k].abs().max() > 0 for k in written if ".lora_B." in k)

    # a run from that directory (`policy.lora.adapter_path`) starts with its A and B: at lr 0 it writes them back
    config["policy"]["lora"]["adapter_path"] = str(directory)
    config["policy"]["dtensor_cfg"]["lr"] = 0.0
    config["grpo"]["max_num_steps"] = 1
    config["logger"]["log_dir"] = str(tmp_path / "again")
    assert train_grpo(config_from_dict(config)).steps == 1
    again = load_file(tmp_path / "again" / ADAPTER_DIR / "adapter_model.safetensors")
    assert again.keys() == written.keys() and all(torch.equal(again[k], written[k]) for k in written)
