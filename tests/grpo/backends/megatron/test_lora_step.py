"""A GRPO step with `policy.lora` on the megatron-core trainer (no rollout engine) against HF transformers + PEFT +
autograd + torch's AdamW on the same rollouts, from the same initial adapters: the tiny Llama at TP2 (adapters on
all seven projections), without and with sequence parallelism (the replicated factors' gradients then summed over
TP by megatron-core's `finalize_model_grads`), the latter on padded and on packed rows (`sequence_packing`), and the
tiny Qwen3-MoE at EP2 (layer 0 routed, layer 1 dense; adapters on the attention and dense MLP projections and on
the routed experts, `experts.gate_up_proj` and `experts.down_proj`, which the reference targets through PEFT's
`target_parameters`).

The trainer's adapters are initialised by the trainer (A seeded, B zero); the reference PEFT model takes those A
and B (its own initial values are not the trainer's; an expert's per-expert pair goes into its slice of PEFT's
fused factors), then both run one step: the loss, the gradient norm and the gradients of every A and B (gathered
whole, the experts' over the expert-parallel group) equal the reference's; the refit stream before the step
equals the HF checkpoint bit for bit (B = 0 leaves the merged weights the base's) and after it equals PEFT's
`merge_and_unload` of the reference's updated adapters (each expert's merged weights against its slice of the
fused tensors), with exactly the targeted projections changed (every expert's among them); the base parameters
are untouched and the optimizer holds the adapters alone. At EP2 the same comparison fails against a reference
with two experts' adapters exchanged (`FAULTS`), in those experts' B gradients and merged weights alone. The
stream after the step would show a wrong merge (scale, rows) or a refit of the unmerged base; the gradients,
adapters placed on the wrong rows (`tests/megatron/test_lora` shows those checks failing).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hf_mcore_bridge.grpo.algorithm.batching import Rollout
from hf_mcore_bridge.grpo.run.config import GRPOConfig, config_from_dict
from hf_mcore_bridge.grpo.run.ranks import start_world
from hf_mcore_bridge.grpo.run.trainer import prepare_run
from hf_mcore_bridge.megatron.lora_config import EXPERT_PROJECTIONS, PROJECTIONS

from ...offpolicy_reference import ReferenceSettings, _minibatch_loss, advantages_of, completion_logprobs
from ...tiny_policy import WORDS, build_tiny_policy
from .lora_step_ranks import lora_step_rank

pytestmark = pytest.mark.slow

GROUP, RANK, ALPHA, LR = 4, 4, 8.0, 1e-2
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
LAYOUTS = {
    "tp2": ({"tensor_model_parallel_size": 2}, PROJECTIONS),
    "tp2_sp": ({"tensor_model_parallel_size": 2, "sequence_parallel": True}, PROJECTIONS),
    "tp2_sp_packed": (
        {"tensor_model_parallel_size": 2, "sequence_parallel": True, "sequence_packing": True},
        PROJECTIONS,
    ),
    "ep2": ({"expert_model_parallel_size": 2}, ATTENTION + EXPERT_PROJECTIONS),
    "moe_tp2_sp": (
        {"tensor_model_parallel_size": 2, "sequence_parallel": True, "expert_tensor_parallel_size": 1},
        ATTENTION + EXPERT_PROJECTIONS,
    ),
    "moe_tp2_sp_etp2": ({"tensor_model_parallel_size": 2, "sequence_parallel": True}, ATTENTION + EXPERT_PROJECTIONS),
}
"""name -> (megatron_cfg parallel sizes, target_modules)."""
FAULTS = ("experts_swapped",)
"""Breaks of the EP2 reference the comparison must catch: experts 0 and 1 of layer 0 exchanging their initial
adapters (on both fused tensors); `expert_scale` (the experts' adapters scaled by 2 alpha / rank) is caught as well
(their B gradients, the merged experts and the gradient norm differ) but costs another reference step."""
EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")
"""A routed expert's weight in the checkpoint and the refit stream: its fused tensor, expert, projection."""
SLOT = re.compile(r"(.+)\[(\d+)\]")
"""An expert adapter's name on megatron-core: `<fused tensor>[<expert>]`."""


def _rows() -> list[dict]:
    generator = torch.Generator().manual_seed(7)
    rows = []
    for i in range(8):
        prompt = torch.randint(1, len(WORDS), (3 + i % 3,), generator=generator).tolist()
        completion = torch.randint(1, len(WORDS), (2 + 3 * (i % 2),), generator=generator).tolist()
        rows.append({"prompt_ids": prompt, "completion_ids": completion, "reward": float(i % 3 == 0)})
        rows[-1]["engine_logprobs"] = [-1.0] * len(completion)
    return rows


def _policy(layout: str, directory: Path) -> Path:
    if layout.startswith("tp2"):
        return build_tiny_policy(directory, seed=3)
    return build_tiny_policy(
        directory, seed=2, architecture="Qwen3MoeForCausalLM", mlp_only_layers=[1], router_aux_loss_coef=0.0
    )


def _config(layout: str, policy: Path, root: Path) -> GRPOConfig:
    sizes, targets = LAYOUTS[layout]
    (root / "prompts.jsonl").write_text(json.dumps({"prompt": "Say 1", "answer": "1"}))
    return config_from_dict(
        {
            "policy": {
                "model_path": str(policy),
                "megatron_cfg": {**sizes, "micro_batch_size": 4, "optimizer": {"lr": LR, "weight_decay": 0.0}},
                "lora": {"enabled": True, "rank": RANK, "alpha": ALPHA, "target_modules": list(targets)},
            },
            "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": GROUP, "max_num_steps": 1},
            "loss_fn": {"kl_coef": 0.0},
            "generation": {"max_new_tokens": 6, "stop_token_ids": [0], "max_model_len": 64},
            "data": {"train_jsonl": str(root / "prompts.jsonl")},
            "logger": {"log_dir": str(root / "run"), "print_progress": False},
            "cluster": {"gpus_per_node": 2},
        }
    )


def _held(layout: str, initial: dict[str, tuple[torch.Tensor, torch.Tensor]], experts: list[str]) -> int:
    """What rank 0's optimizer holds: a dense column-parallel adapter's A whole and B split over TP, a row-parallel
    one's A split and B whole; an expert's the same over expert TP (its fc1 column-, its fc2 row-parallel), and
    half of the experts at EP2."""
    tp = 2 if "tp2" in layout else 1
    etp = tp if layout.endswith("etp2") else 1
    ep = 2 if layout == "ep2" else 1
    held = 0
    for name, (a, b) in initial.items():
        split = etp if name in experts else tp
        row = name.split("[")[0].endswith(("o_proj", "down_proj"))
        count = a.numel() // split + b.numel() if row else a.numel() + b.numel() // split
        held += count // ep if name in experts else count
    return held


def _fused(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert (A_e, B_e), in expert order, as PEFT's `ParamWrapper` factors of the fused tensor: A
    [experts * rank, in] (expert e's rows e * rank ...), B [out, rank * experts] (its `get_delta_weight` reshapes B
    to [out, rank, experts]: expert e's B is B[:, :, e])."""
    a = torch.cat([pair[0] for pair in pairs])
    b = torch.stack([pair[1] for pair in pairs], dim=-1)
    return a, b.reshape(b.shape[0], -1)


def _by_peft_module(adapters: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """The trainer's adapters (or their gradients) by the reference's names: a dense module's HF name, a fused
    expert tensor's (`...mlp.experts.gate_up_proj`) with its experts' pairs stacked as PEFT holds them."""
    result, experts = {}, {}
    for name, pair in adapters.items():
        slot = SLOT.fullmatch(name)
        if slot is None:
            result[name] = pair
        else:
            experts.setdefault(slot[1], {})[int(slot[2])] = pair
    for name, pairs in experts.items():
        assert sorted(pairs) == list(range(len(pairs))), (name, sorted(pairs))
        result[name] = _fused([pairs[e] for e in range(len(pairs))])
    return result


def _reference(
    policy: Path, targets: tuple[str, ...], rows: list[dict], initial: dict, fault: str | None = None
) -> tuple[float, float, dict, dict]:
    """One step of HF + PEFT + autograd + AdamW (megatron-core's CPU optimizer is torch's AdamW): loss, gradient
    norm (before clipping at 1.0), the adapters' gradients by HF module name (a fused expert tensor's by its name)
    and the merged model's weights. `fault`: one of `FAULTS`, applied to the reference."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    parameters = [t for t in targets if t in EXPERT_PROJECTIONS]
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32),
        LoraConfig(
            r=RANK,
            lora_alpha=ALPHA,
            lora_dropout=0.0,
            target_modules=[t for t in targets if t in PROJECTIONS],
            **({"target_parameters": parameters} if parameters else {}),
        ),
    )
    modules = {}
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            key = name.removeprefix("base_model.model.")
            if hasattr(module, "parameter_name"):  # a `ParamWrapper`: the fused expert tensor it adapts
                key = f"{key.replace('.base_layer', '')}.{module.parameter_name}"
            modules[key] = module
    start = _by_peft_module(initial)
    assert sorted(modules) == sorted(start)
    with torch.no_grad():
        for name, m in modules.items():
            a, b = start[name]
            if fault == "experts_swapped" and name.startswith("model.layers.0.mlp.experts."):
                a, b = a.clone(), b.reshape(b.shape[0], RANK, -1).clone()
                a[: 2 * RANK] = torch.cat((a[RANK : 2 * RANK], a[:RANK]))
                b[:, :, :2] = b[:, :, [1, 0]]
                b = b.reshape(b.shape[0], -1)
            if fault == "expert_scale" and hasattr(m, "parameter_name"):
                m.scaling["default"] *= 2
            m.lora_A["default"].weight.copy_(a)
            m.lora_B["default"].weight.copy_(b)
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


def _checkpoint_name(name: str, merged: dict[str, torch.Tensor]) -> torch.Tensor:
    """The reference's merged tensor under a checkpoint name: an expert's weight is its slice of the fused tensor
    (`gate_up_proj[e]` = [gate; up] rows)."""
    found = EXPERT.fullmatch(name)
    if found is None:
        return merged[name]
    if found[3] == "down":
        return merged[f"{found[1]}.down_proj"][int(found[2])]
    return merged[f"{found[1]}.gate_up_proj"][int(found[2])].chunk(2)[0 if found[3] == "gate" else 1]


def _mismatches(got: dict, reference: tuple[float, float, dict, dict]) -> list[str]:
    """What of the trainer's step differs from the reference's: `loss`, `grad_norm`, `<adapter> A|B` (A within
    1e-6, zero at step one as B = 0; B within 1e-5 of its largest element), `<stream tensor>` (within 1e-6)."""
    loss, grad_norm, grads, merged = reference
    wrong = []
    if got["metrics"]["loss"] != pytest.approx(loss, rel=1e-5, abs=1e-7):
        wrong.append("loss")
    if got["metrics"]["grad_norm"] != pytest.approx(grad_norm, rel=1e-5):
        wrong.append("grad_norm")
    mine = _by_peft_module(got["grads"])
    assert sorted(mine) == sorted(grads)
    for name, (want_a, want_b) in grads.items():
        mine_a, mine_b = mine[name]
        if (mine_a - want_a).abs().max() > 1e-6:
            wrong.append(f"{name} A")
        if (mine_b - want_b).abs().max() > 1e-5 * want_b.abs().max():
            wrong.append(f"{name} B")
    for name, tensor in got["after"].items():
        if (tensor - _checkpoint_name(name, merged)).abs().max() > 1e-6:
            wrong.append(name)
    return wrong


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_lora_step_matches_hf_peft_reference(layout: str, tmp_path: Path) -> None:
    policy = _policy(layout, tmp_path / "policy")
    targets = LAYOUTS[layout][1]
    rows = _rows()
    config = _config(layout, policy, tmp_path)
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
    # rank 0's optimizer: at TP2 A whole and half of B on a column-parallel linear, half of A and B whole on a
    # row-parallel one; at EP2 every dense adapter whole and the adapters of its half of the experts
    experts = [n for n in got["initial"] if SLOT.fullmatch(n)]
    assert (not layout.startswith("tp2")) == bool(experts)
    assert got["trainable"] == _held(layout, got["initial"], experts)

    reference = _reference(policy, targets, rows, got["initial"])
    assert reference[0] != 0.0
    assert _mismatches(got, reference) == []
    assert all(b.abs().max() > 0 for _, b in got["grads"].values())  # every B's gradient, each expert's too
    changed = {n for n in base if not torch.equal(got["after"][n], base[n])}
    expert_weights = {n for n in base if EXPERT.fullmatch(n)}
    dense = tuple(t for t in targets if t in PROJECTIONS)
    targeted = {n for n in base if n.rsplit(".", 2)[-2] in dense and not EXPERT.fullmatch(n)}
    targeted |= {n for n in base if EXPERT.fullmatch(n)} if EXPERT_PROJECTIONS[0] in targets else set()
    assert changed == targeted, sorted(changed ^ targeted)
    if layout != "tp2" and not layout.startswith(
        "tp2"
    ):  # every expert of the routed layer (gate, up and down) is among them
        assert len(expert_weights) == 3 * json.loads((policy / "config.json").read_text())["num_local_experts"]
        assert expert_weights <= changed
        for fault in FAULTS:
            wrong = _mismatches(got, _reference(policy, targets, rows, got["initial"], fault))
            # the swapped experts' B gradients (A's are zero at step one), their merged weights, the gradient norm
            swapped = {
                f"model.layers.0.mlp.experts.{e}.{p}_proj.weight" for e in (0, 1) for p in ("gate", "up", "down")
            }
            fused = {f"model.layers.0.mlp.experts.{p} B" for p in ("gate_up_proj", "down_proj")}
            assert sorted(wrong) == sorted({"grad_norm"} | fused | swapped), (fault, wrong)
