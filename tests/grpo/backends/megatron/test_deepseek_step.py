"""GRPO step one of a DeepSeek-V3 policy (multi-latent attention, sigmoid router with expert bias, shared experts,
a dense first layer) on the megatron-core trainer at EP2 and at TP2 x EP2 with sequence parallelism (one 2-rank
world, one layout after the other), against `offpolicy_reference.first_update`: HF transformers + autograd from the
same initial weights on the same rollouts. Loss, gradient norm and every parameter's gradient must agree; the refit's
weight stream (gathered over TP and EP through the mapping table) must equal the HF checkpoint bit for bit.

At TP2 x SP this guards the local spec's multi-latent attention under sequence parallelism: latent norms that
megatron-core's own norms refuse to build, latent norm gradients not summed over TP (`sequence_parallel_norm`), and
the shared rotary key's gradient left with each rank's own heads' share (`mla_sequence_parallel`) each fail it.

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
from hf_mcore_bridge.grpo.run.config import GRPOConfig, config_from_dict
from hf_mcore_bridge.grpo.run.ranks import start_world
from hf_mcore_bridge.grpo.run.trainer import prepare_run

from ...offpolicy_reference import ReferenceSettings, advantages_of, first_update
from ...tiny_policy import WORDS, build_tiny_policy
from .engineless_ranks import layouts_rank

pytestmark = pytest.mark.slow

GROUP, KL = 4, 0.01


def _rows(path: Path) -> list[dict]:
    """16 rollouts (4 groups of 4) of random prompts and completions over the tiny vocabulary, as the trainer logs
    them (also written to `path`)."""
    generator = torch.Generator().manual_seed(11)
    rows = []
    for i in range(16):
        prompt = torch.randint(1, len(WORDS), (3 + i % 3,), generator=generator).tolist()
        completion = torch.randint(1, len(WORDS), (2 + i % 2,), generator=generator).tolist()
        rows.append({"step": 1, "prompt_ids": prompt, "completion_ids": completion, "reward": float(i % 3 == 0)})
    for row in rows:
        row["engine_logprobs"] = [-1.0] * len(row["completion_ids"])
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return rows


def _rollouts(rows: list[dict]) -> list[Rollout]:
    advantages = advantages_of([r["reward"] for r in rows], GROUP)
    fields = ("prompt_ids", "completion_ids", "engine_logprobs")
    return [Rollout(*(tuple(r[f]) for f in fields), r["reward"], a) for r, a in zip(rows, advantages, strict=True)]


LAYOUTS = {
    "ep2": {"expert_model_parallel_size": 2},
    "tp2_ep2_sp": {
        "tensor_model_parallel_size": 2,
        "expert_model_parallel_size": 2,
        "expert_tensor_parallel_size": 1,
        "sequence_parallel": True,
    },
}
"""The world's layouts, one after the other on its 2 ranks: EP2 (two data-parallel replicas of the dense layers),
then TP2 x EP2 with sequence parallelism (the latents and their norms sequence-sharded over the TP ranks)."""


def _config(policy: Path, root: Path, megatron: dict) -> GRPOConfig:
    (root / "prompts.jsonl").write_text(json.dumps({"prompt": "Say 1", "answer": "1"}))
    return config_from_dict(
        {
            "policy": {
                "model_path": str(policy),
                "megatron_cfg": {**megatron, "micro_batch_size": 4, "optimizer": {"lr": 1e-2}},
            },
            "grpo": {"num_prompts_per_step": 4, "num_generations_per_prompt": GROUP, "max_num_steps": 1},
            "loss_fn": {"kl_coef": KL},
            "generation": {"max_new_tokens": 3, "stop_token_ids": [0], "max_model_len": 64},
            "data": {"train_jsonl": str(root / "prompts.jsonl")},
            "logger": {"log_dir": str(root / "run"), "print_progress": False},
            "cluster": {"gpus_per_node": 2},
        }
    )


def _per_expert(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' fused expert gradients (`experts.gate_up_proj` `[E, 2F, H]`, gate rows first;
    `experts.down_proj` `[E, H, F]`) under the checkpoint's per-expert names, as the refit streams them."""
    out = {}
    for name, grad in grads.items():
        prefix, _, kind = name.rpartition(".")
        if not prefix.endswith(".experts"):
            out[name] = grad
            continue
        for expert, part in enumerate(grad):
            if kind == "gate_up_proj":
                gate, up = part.chunk(2)
                out[f"{prefix}.{expert}.gate_proj.weight"], out[f"{prefix}.{expert}.up_proj.weight"] = gate, up
            else:
                out[f"{prefix}.{expert}.{kind}.weight"] = part
    return out


def test_deepseek_v3_first_step_at_ep2_and_tp2_ep2_sp_matches_hf_reference(tmp_path: Path) -> None:
    """At each layout: step one's loss, gradient norm and every parameter's gradient (as the optimizer receives it,
    gathered over TP and EP under its HF name) equal HF + autograd's, and the refit stream equals the checkpoint.
    At TP2 x SP this checks that the latent norms (`q_a_layernorm`, `kv_a_layernorm`), which normalise each TP
    rank's slice of the sequence, have their gradients summed over TP."""
    policy = build_tiny_policy(
        tmp_path / "policy", seed=3, architecture="DeepseekV3ForCausalLM", num_hidden_layers=2
    )  # layer 0 dense, layer 1 routed (first_k_dense_replace=1)
    rows = _rows(tmp_path / "rollouts.jsonl")
    configs = [_config(policy, tmp_path, megatron) for megatron in LAYOUTS.values()]
    runs = [(config, prepare_run(config)) for config in configs]
    assert [prepared.plan.dims.world for _, prepared in runs] == [2, 2]
    start_world(runs[0][1].plan.dims, layouts_rank, runs, _rollouts(rows), str(tmp_path / "step.pt"))
    results = torch.load(tmp_path / "step.pt", weights_only=True)
    settings = ReferenceSettings(group=GROUP, minibatches=1, temperature=1.0, lr=0.0, momentum=0.0, clip_grad=1.0,
                                 kl_coef=KL)  # fmt: skip
    _, loss, fused = first_update(policy, rows, settings)
    grads = _per_expert(fused)
    grad_norm = float(torch.sqrt(sum(g.double().pow(2).sum() for g in grads.values())))
    latent_norms = [name for name in grads if "_a_layernorm" in name]
    assert len(latent_norms) == 4 and all(grads[name].abs().max() > 0 for name in latent_norms)
    hf = load_file(policy / "model.safetensors")
    for layout, result in zip(LAYOUTS, results, strict=True):
        metrics = result["metrics"]
        assert metrics["loss"] == pytest.approx(loss, rel=1e-4, abs=1e-7), layout
        assert metrics["grad_norm"] == pytest.approx(grad_norm, rel=1e-4), layout
        assert set(result["grads"]) - set(grads) == {"model.layers.1.mlp.gate.e_score_correction_bias"}, layout
        for name, want in grads.items():
            error = (result["grads"][name] - want).abs().max()
            assert error <= 1e-4 * want.abs().max(), (layout, name, float(error))
        assert sorted(result["weights"]) == sorted(hf), layout
        for name, tensor in hf.items():
            assert torch.equal(result["weights"][name], tensor), (layout, name)
