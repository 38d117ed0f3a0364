"""A LoRA run's checkpoints, resume and `bridge export`, on CPU: the tiny Llama at TP2, adapters on all seven
projections with dropout 0.1 (masks seeded by the optimizer step: a resumed run draws the same), checkpoints every
two steps.

- The checkpoint holds the frozen base weights under the ordinary keys, the adapters beside their linears, and
  optimizer state for the adapters alone (the only parameters the optimizer holds).
- A run stopped after step 2 and resumed to step 4 logs exactly the metrics of an uninterrupted 4-step run (each
  adapter's TP-split factor sharded on its axis: with megatron-core's default, which marks the adapters replicated,
  TP rank 1's half of every split factor would be lost and the resumed run would differ from step 3 on).
- `bridge export --peft` writes the adapters the run gathered from its live model at its end (`lora_adapter/`,
  another path to the same tensors), under PEFT's names; `PeftModel.from_pretrained` on the base model gives the
  logits of the merged export in transformers; the merged export equals PEFT's `merge_and_unload` of that adapter
  on the base model, tensor by tensor (torch.equal: the same fp32 arithmetic, W + (B A) * scale).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from cli_errors import assert_one_line_error
from safetensors.torch import load_file
from typer.testing import CliRunner

from hf_mcore_bridge.checkpoint.dcp_reader import DCPCheckpoint
from hf_mcore_bridge.cli.main import app
from hf_mcore_bridge.grpo.backends.megatron.checkpoint import latest_step
from hf_mcore_bridge.grpo.errors import GRPOConfigError
from hf_mcore_bridge.grpo.run.config import config_from_dict
from hf_mcore_bridge.grpo.run.launch import check_resumable
from hf_mcore_bridge.grpo.run.trainer import ADAPTER_DIR, RunResult, train_grpo
from hf_mcore_bridge.megatron.lora_config import EXPERT_PROJECTIONS, PROJECTIONS

from ..lora_exports import check_lora_exports, export_both
from ..tiny_policy import WORDS, build_tiny_policy

pytestmark = pytest.mark.slow

TIMINGS = ("_s", "tokens_per_s")
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
EP1, EP2 = {"expert_model_parallel_size": 1}, {"expert_model_parallel_size": 2}


def _config(
    root: Path,
    name: str,
    steps: int,
    policy: Path,
    layout: dict[str, int] | None = None,
    experts: bool = False,
    checkpoints: Path | None = None,
) -> object:
    """The run `name` under `root`: `layout` the megatron-core sizes (TP2 unless given); `experts`: adapters on
    the attention projections and the routed experts, without dropout (PEFT's expert adapters have none), else on
    all seven projections with dropout 0.1; `checkpoints`: its checkpoint directory (else its own)."""
    prompts = root / "say7.jsonl"
    if not prompts.exists():
        rows = [{"prompt": " ".join(["Say"] + ["7"] * k) + ". Answer:", "answer": "7"} for k in range(1, 7)]
        prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    layout = layout or {"tensor_model_parallel_size": 2}
    targets = [*ATTENTION, *EXPERT_PROJECTIONS] if experts else list(PROJECTIONS)
    return config_from_dict(
        {
            "policy": {
                "model_path": str(policy),
                "megatron_cfg": {
                    **layout,
                    "micro_batch_size": 16,
                    "optimizer": {"lr": 5e-2, "weight_decay": 0.0, "clip_grad": 1.0},
                },
                "lora": {
                    "enabled": True,
                    "rank": 4,
                    "alpha": 8,
                    "dropout": 0.0 if experts else 0.1,
                    "target_modules": targets,
                },
            },
            "grpo": {"num_prompts_per_step": 4, "num_generations_per_prompt": 8, "max_num_steps": steps},
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
            "checkpointing": {
                "enabled": True,
                "checkpoint_dir": str(checkpoints or root / name / "ckpt"),
                "save_period": 2,
            },
            "logger": {"log_dir": str(root / name / "logs"), "print_progress": False},
            **({"cluster": {"gpus_per_node": 2}} if layout.get("expert_model_parallel_size", 1) > 1 else {}),
        }
    )


def _comparable(result: RunResult) -> list[dict[str, float]]:
    return [{k: v for k, v in m.items() if not k.endswith(TIMINGS) and k != "initial_refit_s"} for m in result.metrics]


def test_lora_checkpoint_resumes_and_exports(tmp_path: Path) -> None:
    policy = build_tiny_policy(tmp_path / "policy")
    straight = train_grpo(_config(tmp_path, "straight", 4, policy))
    train_grpo(_config(tmp_path, "stopped", 2, policy))
    assert latest_step(tmp_path / "stopped" / "ckpt") == 2
    resumed = train_grpo(_config(tmp_path, "stopped", 4, policy))
    assert [m["step"] for m in resumed.metrics] == [1, 2, 3, 4]
    assert _comparable(resumed) == _comparable(straight)
    assert len({m["grad_norm"] for m in straight.metrics}) == 4

    checkpoint = tmp_path / "straight" / "ckpt"
    _check_checkpoint_contents(checkpoint / "iter_0000004", policy)
    adapter, merged = export_both(checkpoint, tmp_path)
    _check_exports(adapter, merged, tmp_path / "straight" / "logs" / ADAPTER_DIR, policy)
    _check_refusals(tmp_path, checkpoint, policy)


def _check_refusals(tmp_path: Path, checkpoint: Path, policy: Path) -> None:
    """`bridge convert --to hf` of a LoRA checkpoint (it would write the base without the adapters) and a resume
    with another `policy.lora`, or without adapters: one line each."""
    result = CliRunner().invoke(
        app, ["convert", "--to", "hf", str(checkpoint), str(tmp_path / "base"), "--no-progress"]
    )
    assert_one_line_error(result, "is a LoRA run's checkpoint", "bridge export")
    assert not (tmp_path / "base").exists()
    config = _config(tmp_path, "straight", 4, policy)
    check_resumable(config, 4)
    lora = config.policy.lora
    for changed, message in (
        (dataclasses.replace(lora, rank=8), "holds LoRA rank 4, alpha 8, target_modules"),
        (dataclasses.replace(lora, enabled=False), "asks for no LoRA adapters (full training)"),
    ):
        other = dataclasses.replace(config, policy=dataclasses.replace(config.policy, lora=changed))
        with pytest.raises(GRPOConfigError, match=re.escape(message)):
            check_resumable(other, 4)


def _check_checkpoint_contents(iteration: Path, policy: Path) -> None:
    """Base weights as the HF model's (frozen), adapters whole (PEFT's shapes), optimizer state of adapters only."""
    dcp = DCPCheckpoint(iteration)
    keys = dcp.tensor_keys()
    optimizer = [k for k in keys if k.startswith("optimizer.")]
    assert optimizer and all(".lora.lora_" in k for k in optimizer), optimizer[:5]
    adapters = [k for k in keys if ".lora.lora_" in k and not k.startswith("optimizer.")]
    assert len(adapters) == 2 * (3 + 1 + 2 + 1)  # A and B of q, k, v | o | gate, up | down, stacked over layers
    # B of q at TP2: both halves of its rows stored (the split factor sharded on its axis), global shape PEFT's
    hf = load_file(policy / "model.safetensors")
    q_rows = hf["model.layers.0.self_attn.q_proj.weight"].shape[0]
    assert dcp.tensor_meta("decoder.layers.self_attention.linear_qkv.lora.lora_b.0").shape == (2, q_rows, 4)
    chunks = dcp.tensor_meta("decoder.layers.self_attention.linear_qkv.lora.lora_b.0").chunks
    assert sorted({offsets[1] for offsets, _ in chunks}) == [0, q_rows // 2]  # each TP rank's half, per layer
    embedding = dcp.read("embedding.word_embeddings.weight")
    assert torch.equal(embedding[: hf["model.embed_tokens.weight"].shape[0]], hf["model.embed_tokens.weight"])


def _check_exports(adapter: Path, merged: Path, live: Path, policy: Path) -> None:
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 4
    check_lora_exports(adapter, merged, live, policy)


def test_lora_checkpoint_with_expert_adapters_across_expert_parallel_layouts(tmp_path: Path) -> None:
    """The tiny Qwen3-MoE (layer 0 routed, 8 experts; layer 1 dense) with adapters on attention and on the experts:
    at EP2 a run stopped after step 2 and resumed logs exactly the uninterrupted run's metrics; the EP2 checkpoint
    holds every expert's adapter on the global expert axis (each EP rank's four) and optimizer state of adapters
    alone; reloaded at EP1 it gives the EP2 run's adapters (the directory written at the end of a run of no further
    step equals the EP2 run's, bit for bit), and a checkpoint written at EP1 reloads so at EP2; `bridge export`
    merged and `--peft` of the EP2 checkpoint against PEFT (`check_lora_exports`)."""
    policy = build_tiny_policy(
        tmp_path / "policy", seed=2, architecture="Qwen3MoeForCausalLM", mlp_only_layers=[1], router_aux_loss_coef=0.0
    )
    straight = train_grpo(_config(tmp_path, "straight", 4, policy, EP2, experts=True))
    train_grpo(_config(tmp_path, "stopped", 2, policy, EP2, experts=True))
    resumed = train_grpo(_config(tmp_path, "stopped", 4, policy, EP2, experts=True))
    assert [m["step"] for m in resumed.metrics] == [1, 2, 3, 4]
    assert _comparable(resumed) == _comparable(straight)
    checkpoint = tmp_path / "straight" / "ckpt"
    _check_expert_checkpoint(checkpoint / "iter_0000004", policy)

    # EP2 -> EP1: a run of no further step writes the adapters it loaded
    assert train_grpo(_config(tmp_path, "ep1", 4, policy, EP1, experts=True, checkpoints=checkpoint)).metrics == []
    _assert_same_adapters(tmp_path / "ep1" / "logs" / ADAPTER_DIR, tmp_path / "straight" / "logs" / ADAPTER_DIR)
    # EP1 -> EP2: a step at EP1 from a copy of it, saved at EP1, reloaded at EP2
    shutil.copytree(checkpoint, tmp_path / "ep1" / "ckpt")
    assert len(train_grpo(_config(tmp_path, "ep1", 5, policy, EP1, experts=True)).metrics) == 1
    back = _config(tmp_path, "back", 5, policy, EP2, experts=True, checkpoints=tmp_path / "ep1" / "ckpt")
    assert train_grpo(back).metrics == []
    _assert_same_adapters(tmp_path / "back" / "logs" / ADAPTER_DIR, tmp_path / "ep1" / "logs" / ADAPTER_DIR)

    adapter, merged = export_both(checkpoint, tmp_path)
    check_lora_exports(adapter, merged, tmp_path / "straight" / "logs" / ADAPTER_DIR, policy)


def _assert_same_adapters(mine: Path, theirs: Path) -> None:
    got, want = (load_file(d / "adapter_model.safetensors") for d in (mine, theirs))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert any(".experts." in k and k.endswith("lora_B.weight") and want[k].abs().max() > 0 for k in want)


def _check_expert_checkpoint(iteration: Path, policy: Path) -> None:
    """Each expert adapter on megatron-core's global expert axis: B of `gate_up_proj` [experts, 2 ffn, rank] stored
    as every expert's gate and up halves; optimizer state of adapters only (dense and expert optimizers)."""
    dcp = DCPCheckpoint(iteration)
    keys = dcp.tensor_keys()
    optimizer = [k for k in keys if "optimizer." in k]  # `chained_<i>.optimizer.`: dense and expert parameters
    assert optimizer and all(".lora.lora_" in k for k in optimizer), optimizer[:5]
    assert any(".experts." in k for k in optimizer)
    experts = sorted(k for k in keys if ".experts." in k and ".lora.lora_" in k and "optimizer." not in k)
    assert len(experts) == 4, experts  # A and B of linear_fc1 and linear_fc2, the routed layer
    (fc1_b,) = (k for k in experts if "linear_fc1.lora.lora_b" in k)
    gate_up = load_file(policy / "model.safetensors")["model.layers.0.mlp.experts.0.gate_proj.weight"].shape[0] * 2
    meta = dcp.tensor_meta(fc1_b)
    assert tuple(meta.shape)[-3:] == (8, gate_up, 4), meta.shape
    starts = sorted({offsets[-3:-1] for offsets, _ in meta.chunks})
    assert starts == [(e, half) for e in range(8) for half in (0, gate_up // 2)], starts  # each expert's gate, up
