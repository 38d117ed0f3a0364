"""A GRPO run with `policy.lora` end to end on CPU: the tiny Llama at TP2 and at PP2 with the embedded engine,
adapters on all seven projections, four steps; and the tiny Qwen3-MoE at EP2 (an engine a rank) with adapters on
the attention projections and on the routed experts (`experts.gate_up_proj`, `experts.down_proj`), three steps.

The engine is an independent forward pass refitted each step with the trainer's merged weights (base + alpha/rank
B A, `megatron.lora.merged`), or with the adapters themselves, which it applies in its linears (`engine.lora`,
`policy.lora.refit: adapters`): every step's rollouts and the probe prompt after every refit must have the trainer's
log-probs within fp32 agreement (`token_mult_prob_error` <= 1.0001, the run's gate would stop it otherwise). A
refit of the unmerged base, or of wrongly merged weights, leaves the engine a different model than the trainer's
from the first refit on (with `merged` made a no-op the run stops after step 1: probe prompt, 1.119 > 1.0001).
Every refit after the initial one streams the adapted projections alone, or the adapters alone (`refit_bytes`);
the engine keeps the others from the initial refit. The trained adapters are written as a PEFT directory that
`PeftModel.from_pretrained` loads. Learning the toy task needs the embeddings, which LoRA leaves frozen: no
learning curve here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hf_mcore_bridge.errors import BridgeError
from hf_mcore_bridge.grpo.run.config import config_from_dict
from hf_mcore_bridge.grpo.run.trainer import ADAPTER_DIR, train_grpo
from hf_mcore_bridge.megatron.lora_config import EXPERT_PROJECTIONS, PROJECTIONS

from ..tiny_policy import WORDS, build_tiny_policy

pytestmark = pytest.mark.slow

STEPS = 4
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.mark.parametrize(("layout", "refit"), [("tp2", "merged"), ("tp2", "adapters"), ("pp2", "adapters")])
def test_lora_run_keeps_engine_and_trainer_in_agreement(tmp_path: Path, layout: str, refit: str) -> None:
    """Merged refits at TP2 (each rank streams its own half of the adapted projections, shard-local); adapter
    refits (the engine applies A and B itself, `engine.lora`) at TP2 (the base shard-local at the first refit,
    then the adapters whole, each engine rank cutting its parts) and at PP2 (each stage's adapters sent to the
    other's ranks). At TP2 with merged refits a second run starts from the first one's adapter directory
    (`policy.lora.adapter_path`)."""
    run = train_grpo(_config(tmp_path / "first", layout, refit=refit))
    assert run.steps == STEPS
    errors = run.series("token_mult_prob_error")
    assert len(errors) == STEPS and all(e <= 1.0001 for e in errors), errors
    assert all(g > 0 for g in run.series("grad_norm"))
    # every refit after the initial one streams the adapted projections alone (merged: at TP2 each rank its own
    # half, shard-local) or the adapters alone (whole: every A and B, as the PEFT directory holds them)
    weights = load_file(tmp_path / "policy" / "model.safetensors")
    adapted = sum(t.numel() * t.element_size() for n, t in weights.items() if n.rsplit(".", 2)[-2] in PROJECTIONS)
    trained = tmp_path / "first" / "logs" / ADAPTER_DIR
    written = load_file(trained / "adapter_model.safetensors")
    adapters = sum(t.numel() * t.element_size() for t in written.values())
    shard_local = layout == "tp2"
    assert run.series("refit_shard_local") == [float(shard_local)] * STEPS
    expected = adapters if refit == "adapters" else adapted / 2 if shard_local else adapted
    assert run.series("refit_bytes") == [expected] * STEPS
    _check_adapter_directory(trained, tmp_path / "policy")
    if refit == "merged":  # a run from that adapter starts with its A and B: at lr 0 it writes them back unchanged
        again = train_grpo(_config(tmp_path / "second", layout, steps=1, lr=0.0, adapter_path=str(trained)))
        assert again.steps == 1
        written = load_file(tmp_path / "second" / "logs" / ADAPTER_DIR / "adapter_model.safetensors")
        start = load_file(trained / "adapter_model.safetensors")
        assert written.keys() == start.keys() and all(written[k].equal(start[k]) for k in start)


def test_an_engine_applying_adapters_at_a_wrong_scale_stops_the_run(tmp_path: Path, monkeypatch) -> None:
    """The break of the adapter refit: an engine whose adapters are scaled twice the trainer's is another model
    from the first step on, and the run's log-prob gate stops it (one line naming the step)."""
    from hf_mcore_bridge.grpo.run import plan

    engine_lora = plan._engine_lora  # the plan is made here and handed to the ranks with the engine's config

    def doubled(config: object) -> dict[str, object]:
        settings = engine_lora(config)
        return settings | {"lora_scale": 2 * settings["lora_scale"]}

    monkeypatch.setattr(plan, "_engine_lora", doubled)
    with pytest.raises(BridgeError, match="token_mult_prob_error"):
        train_grpo(_config(tmp_path / "run", "tp2", steps=2, refit="adapters"))


def test_lora_run_with_expert_adapters_at_ep2_keeps_engine_and_trainer_in_agreement(tmp_path: Path) -> None:
    """Qwen3-MoE (layer 0 routed, layer 1 dense) at EP2: each rank trains its half of the experts' adapters and
    refits its own engine with every targeted expert's merged weights, gathered over the expert-parallel group.
    Engine and trainer log-probs agree in fp32 on every step's rollouts and on the probe prompt after every refit;
    every refit after the initial one streams exactly the attention projections and every expert weight of the
    routed layer; the PEFT directory loads in `PeftModel.from_pretrained`, each expert's adapter trained on both fused
    tensors or on neither, and trained for every expert HF's router sends a step-1 token that carries gradient to.
    (With the experts left out of `merged` the run stops after step 1: probe prompt, 1.0101 > 1.0001.)"""
    steps, targets = 3, (*ATTENTION, *EXPERT_PROJECTIONS)
    policy = build_tiny_policy(
        tmp_path / "policy", seed=2, architecture="Qwen3MoeForCausalLM", mlp_only_layers=[1], router_aux_loss_coef=0.0
    )
    run = train_grpo(_config(tmp_path / "first", "ep2", steps=steps, target_modules=list(targets)))
    assert run.steps == steps
    errors = run.series("token_mult_prob_error") + run.series("probe_token_mult_prob_error")
    assert len(errors) == 2 * steps and all(e <= 1.0001 for e in errors), errors
    assert all(g > 0 for g in run.series("grad_norm"))
    weights = load_file(policy / "model.safetensors")
    experts = [n for n in weights if ".mlp.experts." in n]
    adapted = [n for n in weights if n.rsplit(".", 2)[-2] in ATTENTION] + experts
    assert len(experts) == 3 * 8  # the routed layer's 8 experts: gate, up and down
    assert run.series("refit_shard_local") == [0.0] * steps
    assert run.series("refit_bytes") == [sum(weights[n].numel() * weights[n].element_size() for n in adapted)] * steps
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    trained = tmp_path / "first" / "logs" / ADAPTER_DIR
    written = load_file(trained / "adapter_model.safetensors")
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32), trained)
    held = {k.replace(".default", ""): v for k, v in model.state_dict().items() if ".lora_" in k}
    assert sorted(held) == sorted(written) and all(torch.equal(held[k], written[k]) for k in written)
    # per layer: A and B of each attention projection; of the routed layer: A and B of both fused expert tensors
    assert len(written) == 2 * len(ATTENTION) * 2 + 2 * 2
    # each expert's B (PEFT's [out, rank * experts], expert e in columns e, e + 8, ...) is trained on both fused
    # tensors or neither; every expert HF's router sends a token of step 1 that carries gradient to is trained
    untrained = {
        name: {e for e, part in enumerate(b.reshape(b.shape[0], -1, 8).unbind(-1)) if part.abs().max() == 0}
        for name, b in written.items()
        if ".lora_B." in name and ".experts." in name
    }
    assert len(untrained) == 2 and len({frozenset(v) for v in untrained.values()}) == 1, untrained
    assert not next(iter(untrained.values())) & _routed_at_step_one(policy, tmp_path / "first" / "logs"), untrained


def _routed_at_step_one(policy: Path, log_dir: Path) -> set[int]:
    """The experts HF's router of layer 0 (the initial weights: B = 0, the policy of step 1) picks for a token whose
    output reaches step 1's loss: of a rollout with a nonzero advantage, any position but the last."""
    from transformers import AutoModelForCausalLM

    from ..offpolicy_reference import read_rollouts

    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    picked: list[torch.Tensor] = []
    model.model.layers[0].mlp.gate.register_forward_hook(lambda _m, _i, out: picked.append(out[2]))
    routed: set[int] = set()
    with torch.no_grad():
        for row in read_rollouts(log_dir / "rollouts.jsonl")[1]:
            if row["advantage"] != 0:
                picked.clear()
                model(torch.tensor([list(row["prompt_ids"]) + list(row["completion_ids"])]))
                routed |= set(picked[0][:-1].flatten().tolist())
    return routed


def _config(tmp_path: Path, layout: str, steps: int = STEPS, lr: float = 5e-2, **lora: object) -> object:
    """The run: the tiny policy at `layout` with adapters on every projection (`lora`: more of `policy.lora`),
    `steps` steps at `lr`, logged in `tmp_path / "logs"`; at `ep2` the policy built in `tmp_path.parent` first."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    prompts = tmp_path / "say7.jsonl"
    rows = [{"prompt": " ".join(["Say"] + ["7"] * k) + ". Answer:", "answer": "7"} for k in range(1, 7)]
    prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return config_from_dict(
        {
            "policy": {
                "model_path": str(
                    tmp_path.parent / "policy" if layout == "ep2" else build_tiny_policy(tmp_path.parent / "policy")
                ),
                "megatron_cfg": {
                    "tensor_model_parallel_size": 2 if layout == "tp2" else 1,
                    "pipeline_model_parallel_size": 2 if layout == "pp2" else 1,
                    "expert_model_parallel_size": 2 if layout == "ep2" else 1,
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
            **({"cluster": {"gpus_per_node": 2}} if layout == "ep2" else {}),
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
