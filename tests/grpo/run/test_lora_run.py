"""A GRPO run with `policy.lora` end to end on CPU: the tiny Llama at TP2 with the embedded engine, adapters on all
seven projections, four steps.

The engine is an independent forward pass refitted each step with the trainer's merged weights (base + alpha/rank
B A, `megatron.lora.merged`): every step's rollouts and the probe prompt after every refit must have the trainer's
log-probs within fp32 agreement (`token_mult_prob_error` <= 1.0001, the run's gate would stop it otherwise). A
refit of the unmerged base, or of wrongly merged weights, leaves the engine a different model than the trainer's
from the first refit on (with `merged` made a no-op the run stops after step 1: probe prompt, 1.119 > 1.0001).
Every refit after the initial one streams the adapted projections alone (`refit_bytes`); the engine keeps the
others from the initial refit. The trained adapters are written as a PEFT directory that
`PeftModel.from_pretrained` loads. Learning the toy task needs the embeddings, which LoRA leaves frozen: no
learning curve here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from hf_mcore_bridge.grpo.run.config import config_from_dict
from hf_mcore_bridge.grpo.run.trainer import ADAPTER_DIR, train_grpo
from hf_mcore_bridge.megatron.lora_config import PROJECTIONS

from ..tiny_policy import WORDS, build_tiny_policy

pytestmark = pytest.mark.slow

STEPS = 4


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_lora_run_keeps_engine_and_trainer_in_agreement(tmp_path: Path, layout: str) -> None:
    """At TP2 (each rank streams its own half of the adapted projections, shard-local) and at PP2 (the stages'
    adapted layers named alike on both, so the collective stream agrees; the whole tensors). At TP2 a second run
    starts from the first one's adapter directory (`policy.lora.adapter_path`)."""
    run = train_grpo(_config(tmp_path / "first", layout))
    assert run.steps == STEPS
    errors = run.series("token_mult_prob_error")
    assert len(errors) == STEPS and all(e <= 1.0001 for e in errors), errors
    assert all(g > 0 for g in run.series("grad_norm"))
    # every refit after the initial one streams the adapted projections alone: at TP2 each rank its own half
    # (shard-local), at PP2 every tensor whole
    weights = load_file(tmp_path / "policy" / "model.safetensors")
    adapted = sum(t.numel() * t.element_size() for n, t in weights.items() if n.rsplit(".", 2)[-2] in PROJECTIONS)
    shard_local = layout == "tp2"
    assert run.series("refit_shard_local") == [float(shard_local)] * STEPS
    assert run.series("refit_bytes") == [adapted / 2 if shard_local else adapted] * STEPS
    trained = tmp_path / "first" / "logs" / ADAPTER_DIR
    _check_adapter_directory(trained, tmp_path / "policy")
    if layout == "tp2":  # a run from that adapter starts with its A and B: at lr 0 it writes them back unchanged
        again = train_grpo(_config(tmp_path / "second", layout, steps=1, lr=0.0, adapter_path=str(trained)))
        assert again.steps == 1
        written = load_file(tmp_path / "second" / "logs" / ADAPTER_DIR / "adapter_model.safetensors")
        start = load_file(trained / "adapter_model.safetensors")
        assert written.keys() == start.keys() and all(written[k].equal(start[k]) for k in start)


def _config(tmp_path: Path, layout: str, steps: int = STEPS, lr: float = 5e-2, **lora: object) -> object:
    """The run: the tiny policy at `layout` with adapters on every projection (`lora`: more of `policy.lora`),
    `steps` steps at `lr`, logged in `tmp_path / "logs"`."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    prompts = tmp_path / "say7.jsonl"
    rows = [{"prompt": " ".join(["Say"] + ["7"] * k) + ". Answer:", "answer": "7"} for k in range(1, 7)]
    prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return config_from_dict(
        {
            "policy": {
                "model_path": str(build_tiny_policy(tmp_path.parent / "policy")),
                "megatron_cfg": {
                    "tensor_model_parallel_size": 2 if layout == "tp2" else 1,
                    "pipeline_model_parallel_size": 2 if layout == "pp2" else 1,
                    "micro_batch_size": 16,
                    "optimizer": {"lr": lr, "weight_decay": 0.0, "clip_grad": 1.0},
                },
                "lora": {"enabled": True, "rank": 8, "alpha": 16, "target_modules": list(PROJECTIONS), **lora},
            },
            "grpo": {"num_prompts_per_step": 8, "num_generations_per_prompt": 8, "max_num_steps": steps},
            "loss_fn": {"kl_coef": 0.0},
            "generation": {
                "max_new_tokens": 3,
                "stop_token_ids": [WORDS.index("[EOS]")],
                "max_model_len": 64,
                "decode_attention": "gather",
                "torch_compile": False,
            },
            "data": {"train_jsonl": str(prompts)},
            "reward": {"name": "number"},
            "logger": {"log_dir": str(tmp_path / "logs"), "print_progress": False},
        }
    )


def _check_adapter_directory(directory: Path, base: Path) -> None:
    """The run's trained adapters, written as a PEFT directory, load with `PeftModel.from_pretrained` onto the base
    model: one trained (nonzero) B per targeted projection of every layer, held by PEFT as written."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    written = load_file(directory / "adapter_model.safetensors")
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), directory)
    held = {k.replace(".default", ""): v for k, v in model.state_dict().items() if ".lora_" in k}
    assert sorted(held) == sorted(written) and len(written) == 2 * len(PROJECTIONS) * 2  # 2 layers, A and B
    assert all(torch.equal(held[k], written[k]) for k in written)
    assert all(written[k].abs().max() > 0 for k in written if ".lora_B." in k)
