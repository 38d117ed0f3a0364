"""The first GRPO step at TP1, TP2, PP2 (megatron-core's 1F1B pipeline schedule, 4 micro-batches), context
parallelism (CP2, with TP, SP, PP, EP and packed rows) and TP2 with packed rows (block-diagonal masks) against an
independent reference: HF transformers' model of the same initial weights, fed the logged rollouts unpacked, with
the loss of `grpo_loss` and plain autograd. Loss and gradient norm must agree, which checks log-probs (temperature,
padded vocabulary), packing, the loss scaling through the schedule's micro-batch averaging and the gradient path.

The engine's first weights come from each run's own refit, so equal rollouts (rewards) also confirm that the
refit gathered the TP shards and the pipeline stages into the same model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from hf_mcore_bridge.grpo.run.config import config_from_dict
from hf_mcore_bridge.grpo.run.trainer import train_grpo

from ..tiny_policy import build_tiny_policy

pytestmark = pytest.mark.slow

LAYOUTS = {
    "tp1": {"tp": 1},
    "tp2": {"tp": 2},
    "pp2": {"pp": 2},
    "dp2": {"world": 2},
}
"""name -> parallel sizes (`world`: ranks started, so data parallel = world / (TP x PP)); defaults tp=pp=ep=1."""
MORE_LAYOUTS = {
    "tp2_packed": {"tp": 2, "packing": True},
    "tp2_sp": {"tp": 2, "sequence_parallel": True},
    "pp2_dp2": {"pp": 2, "world": 4},
}
"""Combinations of the above (`extended`: packing and sequence parallelism also run at TP2 x CP2 below)."""

MOE_LAYOUTS = {
    "ep2": {"ep": 2},
    "tp2_ep2_sp": {"tp": 2, "ep": 2, "sequence_parallel": True},
    "ep2_cp2": {"ep": 2, "cp": 2},
    "pp2": {"pp": 2},
}
"""Mixture-of-experts layouts (EP2 on two ranks makes two data-parallel replicas of the dense layers). PP > 1 runs
megatron-core's all-to-all token dispatcher (variable sequence lengths; on the CPU with `cpu_patches`' stand-in
CUDA streams)."""


def _run(
    root: Path,
    name: str,
    policy: Path,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    packing: bool = False,
    world: int | None = None,
    sequence_parallel: bool = False,
    cp: int = 1,
    steps: int = 1,
    checkpoint_dir: Path | None = None,
    bias_update_rate: float = 0.0,
) -> dict[str, float]:
    prompts = root / "prompts.jsonl"
    rows = [{"prompt": f"Repeat the digit {d}. Answer:", "answer": str(d)} for d in range(10)]
    prompts.write_text("\n".join(json.dumps(r) for r in rows))
    config = config_from_dict(
        {
            "policy": {
                "model_path": str(policy),
                "megatron_cfg": {
                    "tensor_model_parallel_size": tp,
                    "pipeline_model_parallel_size": pp,
                    "expert_model_parallel_size": ep,
                    "context_parallel_size": cp,
                    "sequence_parallel": sequence_parallel,
                    "micro_batch_size": 8,
                    "sequence_packing": packing,
                    "max_tokens_per_microbatch": 96,
                    "optimizer": {"lr": 1e-2},
                    **({"moe_router_bias_update_rate": bias_update_rate} if bias_update_rate else {}),
                },
            },
            "grpo": {"num_prompts_per_step": 4, "num_generations_per_prompt": 8, "max_num_steps": steps},
            "loss_fn": {"kl_coef": 0.01},
            "generation": {"max_new_tokens": 3, "stop_token_ids": [0], "max_model_len": 64},
            "data": {"train_jsonl": str(prompts)},
            "logger": {"log_dir": str(root / name), "print_progress": False},
            "checkpointing": {
                "enabled": checkpoint_dir is not None,
                "checkpoint_dir": str(checkpoint_dir or root / name / "ckpt"),
                "save_period": 1,
            },
            "cluster": {"gpus_per_node": world},
        }
    )
    return train_grpo(config).metrics[0]


def _hf_reference(policy: Path, rollouts_file: Path) -> dict[str, float]:
    """Loss and gradient norm of step 1 computed with HF transformers from the logged rollouts."""
    import torch
    from transformers import AutoModelForCausalLM

    from hf_mcore_bridge.grpo.algorithm.batching import Rollout, make_microbatches
    from hf_mcore_bridge.grpo.algorithm.losses import LossConfig, grpo_loss

    rows = [json.loads(line) for line in rollouts_file.read_text().splitlines()]
    fields = ("prompt_ids", "completion_ids", "engine_logprobs")
    rollouts = [Rollout(*(tuple(r[f]) for f in fields), r["reward"], r["advantage"]) for r in rows if r["step"] == 1]
    (batch,) = make_microbatches(rollouts, len(rollouts))
    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    logits = model(batch.tokens).logits[:, :-1]  # right padding is invisible to earlier positions
    logprobs = torch.log_softmax(logits, -1).gather(-1, batch.tokens[:, 1:, None])[..., 0]
    loss, _ = grpo_loss(
        logprobs, None, batch.advantages, batch.mask, batch.mask.sum(), LossConfig(kl_coef=0.01), logprobs.detach()
    )
    loss.backward()
    grad_norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in model.parameters() if p.grad is not None))
    return {
        "loss": float(loss.detach()),
        "grad_norm": float(grad_norm),
        "reward_mean": sum(r.reward for r in rollouts) / len(rollouts),
    }


def _check_against_reference(steps: dict[str, dict[str, float]], reference: dict[str, float]) -> None:
    for name, step in steps.items():
        assert step["reward_mean"] == reference["reward_mean"], name
        assert step["loss"] == pytest.approx(reference["loss"], rel=1e-4, abs=1e-7), name
        assert step["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-4), name
        assert step["token_mult_prob_error"] <= 1.0001, name
        assert step["probe_token_mult_prob_error"] <= 1.0001, name


def test_first_step_matches_hf_reference_at_every_layout(tmp_path: Path) -> None:
    policy = build_tiny_policy(tmp_path / "policy", seed=2)
    steps = {name: _run(tmp_path, name, policy, **layout) for name, layout in LAYOUTS.items()}
    reference = _hf_reference(policy, tmp_path / "tp1" / "rollouts.jsonl")
    assert steps["tp1"]["reward_std"] > 0  # some signal, so the loss and gradient are not trivially 0
    _check_against_reference(steps, reference)
    # the refit's phases: only a pipeline moves tensors between ranks to reach the engine on rank 0, and only
    # tensor parallelism gathers shards
    assert steps["pp2"]["refit_transfer_s"] > 0 and steps["tp2"]["refit_transfer_s"] == 0
    for name, step in steps.items():
        assert (step["refit_gather_s"] > 0) == (LAYOUTS[name].get("tp", 1) > 1), name
        assert step["refit_convert_s"] >= 0 and step["refit_load_s"] > 0, name
        assert step["refit_gather_s"] + step["refit_convert_s"] + step["refit_load_s"] <= step["refit_s"], name


@pytest.mark.extended
def test_first_step_matches_hf_reference_at_more_layouts(tmp_path: Path) -> None:
    policy = build_tiny_policy(tmp_path / "policy", seed=2)
    steps = {name: _run(tmp_path, name, policy, **layout) for name, layout in {"tp1": {}, **MORE_LAYOUTS}.items()}
    _check_against_reference(steps, _hf_reference(policy, tmp_path / "tp1" / "rollouts.jsonl"))


def test_moe_first_step_matches_hf_reference(tmp_path: Path) -> None:
    """Qwen3-MoE (a routed layer and a dense one), no auxiliary loss so HF's loss is the whole objective: the
    experts' gradients flow through megatron-core's router and dispatcher, and refit gathers them over EP."""
    policy = build_tiny_policy(
        tmp_path / "policy", seed=2, architecture="Qwen3MoeForCausalLM", mlp_only_layers=[1], router_aux_loss_coef=0.0
    )
    steps = {name: _run(tmp_path, name, policy, **layout) for name, layout in MOE_LAYOUTS.items()}
    reference = _hf_reference(policy, tmp_path / "ep2" / "rollouts.jsonl")
    assert steps["ep2"]["reward_std"] > 0
    _check_against_reference(steps, reference)


def test_glm_first_step_matches_hf_reference(tmp_path: Path) -> None:
    """GLM-4.5 at EP2 (sigmoid router with score bias choosing 4 of 8 experts in 2 of 4 groups, scaled by 2.5; an
    ungated shared expert; half-rotary attention with q/k norms and q/k/v biases; a dense first layer): step one's
    loss and gradient norm equal HF + autograd's. The router's expert bias stays as the checkpoint has it
    (`policy.megatron_cfg.moe_router_bias_update_rate` 0); asked for a rate, megatron-core moves each expert's bias
    by it after the step (towards balanced loads), and step one is the same."""
    from safetensors.torch import load_file

    from hf_mcore_bridge.checkpoint.dcp_reader import DCPCheckpoint

    policy = build_tiny_policy(tmp_path / "policy", seed=2, architecture="Glm4MoeForCausalLM")
    rate = 0.01
    steps, saved = {}, {}
    for name, bias_rate in (("ep2", 0.0), ("ep2_bias_updates", rate)):
        ckpt = tmp_path / f"{name}_ckpt"
        steps[name] = _run(tmp_path, name, policy, ep=2, checkpoint_dir=ckpt, bias_update_rate=bias_rate)
        saved[name] = DCPCheckpoint(ckpt / "iter_0000001").read("decoder.layers.1.mlp.router.expert_bias")
    reference = _hf_reference(policy, tmp_path / "ep2" / "rollouts.jsonl")
    assert steps["ep2"]["reward_std"] > 0
    _check_against_reference(steps, reference)
    initial = load_file(policy / "model.safetensors")["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert torch.equal(saved["ep2"], initial)
    moved = (saved["ep2_bias_updates"] - initial).abs()
    assert ((moved - rate).abs() < 1e-6).sum() >= 4 and bool(((moved < 1e-6) | ((moved - rate).abs() < 1e-6)).all())


CP_LAYOUTS = {
    "cp2": {"cp": 2, "steps": 2},
    "tp2_cp2_sp_packed": {"tp": 2, "cp": 2, "packing": True, "sequence_parallel": True},
}
"""Context-parallel layouts (`context_parallel`; MoE at EP2 x CP2 is in `MOE_LAYOUTS`)."""
MORE_CP_LAYOUTS = {"pp2_cp2": {"pp": 2, "cp": 2}, "dp2_cp2": {"cp": 2, "world": 4}}
"""PP2 x CP2 (1F1B schedule) and DP2 x CP2 (gradients averaged over data x context ranks): `extended`."""


def test_context_parallel_first_step_matches_hf_reference(tmp_path: Path) -> None:
    """CP2 (padded rows) and TP2 x CP2 x SP (packed rows): step one's metrics equal the HF reference (as CP1's do
    in the test above); the engine/trainer log-prob gate (`on_logprob_mismatch=stop`) passes on every step (two at
    CP2); the CP2 run's checkpoint resumes at CP1 to the same step 2."""
    policy = build_tiny_policy(tmp_path / "policy", seed=2)
    ckpt = tmp_path / "cp2_ckpt"
    steps = {
        name: _run(tmp_path, name, policy, **layout, checkpoint_dir=ckpt if name == "cp2" else None)
        for name, layout in CP_LAYOUTS.items()
    }
    assert len((tmp_path / "cp2" / "metrics.jsonl").read_text().splitlines()) == 2
    reference = _hf_reference(policy, tmp_path / "cp2" / "rollouts.jsonl")
    assert steps["cp2"]["reward_std"] > 0
    _check_against_reference(steps, reference)
    # the CP2 checkpoint of step 1 resumed at CP1 repeats the CP2 run's step 2
    resumed = tmp_path / "resumed_ckpt"
    shutil.copytree(ckpt, resumed)
    shutil.rmtree(resumed / "iter_0000002")
    (resumed / "latest_checkpointed_iteration.txt").write_text("1")
    _run(tmp_path, "resumed_cp1", policy, steps=2, checkpoint_dir=resumed)
    (want,) = [m for m in _metrics(tmp_path / "cp2") if m["step"] == 2]
    (got,) = [m for m in _metrics(tmp_path / "resumed_cp1") if m["step"] == 2]
    assert got["reward_mean"] == want["reward_mean"]
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-4, abs=1e-7)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)


@pytest.mark.extended
def test_context_parallel_first_step_matches_hf_reference_at_more_layouts(tmp_path: Path) -> None:
    policy = build_tiny_policy(tmp_path / "policy", seed=2)
    steps = {name: _run(tmp_path, name, policy, **layout) for name, layout in {"tp1": {}, **MORE_CP_LAYOUTS}.items()}
    _check_against_reference(steps, _hf_reference(policy, tmp_path / "tp1" / "rollouts.jsonl"))


def _metrics(log_dir: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


MLA_POLICIES = {
    "deepseek_v3": ("DeepseekV3ForCausalLM", {}, 3),
    "glm4_moe_lite": ("Glm4MoeLiteForCausalLM", {"mlp_layer_types": ["dense", "sparse"]}, 4),
}
"""Multi-latent policies (2 layers, a dense one then a MoE one): name -> (architecture, overrides, seed)."""


@pytest.mark.parametrize(
    "name", [pytest.param("deepseek_v3", marks=pytest.mark.extended), "glm4_moe_lite"]
)  # GLM-4.7-Flash's attention is DeepSeek-V3's: one of them in the default run
def test_mla_first_step_matches_hf_reference(name: str, tmp_path: Path) -> None:
    """DeepSeek-V3 and GLM-4.7-Flash at EP2 (multi-latent attention, rollouts from the engine's latent cache;
    sigmoid router with expert bias and groups; shared experts; a dense first layer): step one's loss and gradient
    norm equal HF + autograd's, and the engine's log-probs the trainer's (`token_mult_prob_error`)."""
    architecture, overrides, seed = MLA_POLICIES[name]
    policy = build_tiny_policy(tmp_path / "policy", seed=seed, architecture=architecture, **overrides)
    steps = {"ep2": _run(tmp_path, "ep2", policy, ep=2)}
    reference = _hf_reference(policy, tmp_path / "ep2" / "rollouts.jsonl")
    assert steps["ep2"]["reward_std"] > 0
    _check_against_reference(steps, reference)
