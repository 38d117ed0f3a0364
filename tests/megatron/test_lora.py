"""LoRA on megatron-core's tensor-parallel linears against PEFT's LoRA on the HF model (fp32, CPU).

The reference is independent: `peft.get_peft_model` on the transformers model with the same rank, alpha and
targets, A and B set to random nonzero values (B starts at zero), one forward and backward of
sum(logits * weights). One TP2 world runs every case (`lora_ranks`): the logits must agree to 1e-4 and the
gradients of every A and B, gathered whole, to 1e-4 of their largest element; the replicated factors' gradients
are equal on both ranks; only adapters require gradients and megatron-core's DDP and optimizer hold nothing
else; the model's HF weight stream with the adapters merged equals PEFT's `merge_and_unload`; the adapters
written as a PEFT directory load with `PeftModel.from_pretrained` and give the same logits. The same world
shows the comparison failing with the scale alpha / rank doubled and with adapters on the wrong rows of the
fused `linear_qkv` (k and v exchanged) and `linear_fc1` (gate and up exchanged). With adapter dropout (p = 0.3)
the training forward and its gradients equal PEFT's with the same masks in its `lora_dropout` (captured from the
ranks, equal on both), and the eval forward equals PEFT without dropout. The same world runs the tiny Llama with
sequence parallelism (through megatron-core's DDP and `finalize_model_grads`, as the trainer does): logits and
gradients equal PEFT's, with dropout too (each mask one of the whole sequence); with the replicated factors'
gradients left unreduced (their `sequence_parallel` mark taken off) exactly those gradients fail; and the tiny
Qwen3-MoE at expert tensor parallelism 2 (= TP, EP1) with attention and expert adapters (`_check_expert_tp`).
Last, the same world re-initialised as CP2 (TP1): logits and gradients (summed over the CP ranks) equal PEFT's.
An EP2 world does
the same (without dropout) for attention and routed-expert adapters on tiny MoE models against PEFT's
`target_parameters` adapters of the fused expert tensors (`test_lora_at_ep2_on_moe_equals_peft`).
"""

from __future__ import annotations

import json

import pytest
import torch
from lora_ranks import LoraCase, lora_rank

from hf_mcore_bridge.checkpoint.hf_dir import read_json
from hf_mcore_bridge.convert.config_bridge import megatron_spec
from hf_mcore_bridge.convert.layout import Layout
from hf_mcore_bridge.megatron.lora import add_lora, column_rows
from hf_mcore_bridge.megatron.lora_checkpoint import checkpoint_adapters
from hf_mcore_bridge.megatron.lora_config import PROJECTIONS, LoraConfig
from hf_mcore_bridge.megatron.world import run_world
from hf_mcore_bridge.models.mapping_types import FusedQKV

RANK, ALPHA = 4, 8.0
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
EXPERTS = ("experts.gate_up_proj", "experts.down_proj")
FAULTS = ("scale", "qkv_rows", "gate_up_rows")
MOE_FAULTS = ("experts_swapped", "expert_gate_up")
DROPOUT = 0.3


def _peft(hf_dir, targets: tuple[str, ...], seed: int):
    """The PEFT model of `hf_dir` with random A and B; returns it and name -> (module, A, B): a module's HF name,
    or for the experts' fused tensors (PEFT's `target_parameters`, `lora.ParamWrapper`) the tensor's HF name."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    modules = [t for t in targets if t not in EXPERTS]
    parameters = {"target_parameters": [t for t in targets if t in EXPERTS]} if set(EXPERTS) & set(targets) else {}
    config = PeftLoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=modules, **parameters)
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    values = {}
    with torch.no_grad():
        for name, module in peft_model.named_modules():
            if not hasattr(module, "lora_A") or "default" not in module.lora_A:
                continue
            a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
            a.copy_(torch.randn(a.shape, generator=generator) * 0.2)
            b.copy_(torch.randn(b.shape, generator=generator) * 0.2)
            key = name.removeprefix("base_model.model.")
            if hasattr(module, "parameter_name"):  # a ParamWrapper: the fused tensor it adapts
                key = f"{key.replace('.base_layer', '')}.{module.parameter_name}"
            values[key] = (module, a.clone(), b.clone())
    return peft_model, values


def _per_expert(name: str, a: torch.Tensor, b: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """PEFT's `ParamWrapper` factors of a fused expert tensor split per expert, as its `get_delta_weight` reads
    them: A [experts * rank, in] reshaped [experts, rank, in], B [out, rank * experts] reshaped [out, rank, experts]
    (expert e's delta B[:, :, e] @ A[e]). Keyed `<tensor>[<expert>]`, the adapters' names on megatron-core."""
    experts = a.shape[0] // RANK
    b = b.reshape(b.shape[0], RANK, experts)
    return {f"{name}[{e}]": (a.reshape(experts, RANK, -1)[e].clone(), b[:, :, e].clone()) for e in range(experts)}


def _fused(name: str, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `_per_expert`: the per-expert pairs of `name` stacked back into PEFT's two factors."""
    found = sorted((int(key[len(name) + 1 : -1]), pair) for key, pair in pairs.items() if key.startswith(f"{name}["))
    assert [e for e, _ in found] == list(range(len(found))), (name, [e for e, _ in found])
    a = torch.cat([pair[0] for _, pair in found])
    b = torch.stack([pair[1] for _, pair in found], dim=-1)
    return a, b.reshape(b.shape[0], -1)


def _whole_values(values: dict) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """`_peft`'s values as the adapters' names on megatron-core hold them: experts' split per expert."""
    whole = {}
    for name, (_, a, b) in values.items():
        whole |= _per_expert(name, a, b) if name.endswith(EXPERTS) else {name: (a, b)}
    return whole


def _reference(peft_model, values, tokens, weights):
    logits = peft_model(tokens).logits
    (logits * weights).sum().backward()
    grads = {
        name: (m.lora_A["default"].weight.grad.clone(), m.lora_B["default"].weight.grad.clone())
        for name, (m, _, _) in values.items()
    }
    return logits.detach(), grads


def _relative(mine: torch.Tensor, reference: torch.Tensor) -> float:
    """max |mine - reference| over max |reference|: fp32 gradients through 8 layers differ in the 5th digit."""
    return float((mine - reference).abs().max() / reference.abs().max())


SP = (("sequence_parallel", True),)
MOE_TARGETS = (*ATTENTION, *EXPERTS)
ETP2 = {"eval_forward": True}
TP2_PLANS = {
    "llama": ("llama", PROJECTIONS, {"optimizer": True, "merged": True}),
    "qwen3": ("qwen3", ATTENTION, {}),
    **{f"llama_{fault}": ("llama", PROJECTIONS, {"fault": fault}) for fault in FAULTS},
    "llama_dropout": ("llama", PROJECTIONS, {"dropout": DROPOUT}),
    "llama_sp": ("llama", PROJECTIONS, {"overrides": SP, "ddp": True}),
    "llama_sp_unreduced": ("llama", PROJECTIONS, {"overrides": SP, "ddp": True, "fault": "sp_unreduced"}),
    "llama_sp_dropout": ("llama", PROJECTIONS, {"overrides": SP, "ddp": True, "dropout": DROPOUT}),
    # the tiny Qwen3-MoE at expert tensor parallelism 2 (= TP, EP1): its experts as `SequentialMLP`, as
    # `GroupedExperts`, and with the `expert_tp_rows` fault
    "moe_etp2": (
        "qwen3_moe",
        MOE_TARGETS,
        {"eval_forward": True, "optimizer": True, "merged": True, "checkpoint": True},
    ),
    "moe_etp2_grouped": ("qwen3_moe", MOE_TARGETS, {"eval_forward": True, "overrides": (("moe_grouped_gemm", True),)}),
    "moe_etp2_expert_tp_rows": ("qwen3_moe", MOE_TARGETS, {"eval_forward": True, "fault": "expert_tp_rows"}),
    "llama_cp": ("llama", PROJECTIONS, {"context_parallel": 2}),  # last: the world stays CP2
}
"""The cases of the TP2 world: name -> (model, target_modules, `LoraCase` fields)."""
EXACT = ("llama", "qwen3", "llama_sp", "llama_cp")
"""Cases whose logits and gradients must equal PEFT's."""


@pytest.mark.slow
def test_lora_at_tp2_equals_peft(tiny_models, tiny_moe_models, tmp_path):
    """Dense adapters at TP2 (and, re-initialised in the same world, CP2: see the module docstring) and, in the same
    world, attention and expert adapters on the tiny Qwen3-MoE at expert tensor parallelism 2 (`_check_expert_tp`)."""
    tokens = torch.randint(0, 211, (2, 12), generator=torch.Generator().manual_seed(1))
    weights = torch.randn(2, 12, 211, generator=torch.Generator().manual_seed(2))
    torch.save(weights, tmp_path / "weights.pt")
    references, cases = {}, []
    for seed, (case, (model, targets, fields)) in enumerate(TP2_PLANS.items()):
        hf_dir = (tiny_moe_models if model == "qwen3_moe" else tiny_models)[model]
        peft_model, values = _peft(hf_dir, targets, seed)
        references[case] = _reference(peft_model, values, tokens, weights)
        torch.save(_whole_values(values), tmp_path / f"{case}.adapters.pt")
        path = str(tmp_path / f"{case}.adapters.pt")
        cases.append(LoraCase(case, str(hf_dir), path, RANK, ALPHA, targets, **fields))
        if "dropout" in fields:
            references[case] = peft_model, values
        if case == "moe_etp2":
            references["moe_etp2_seed"] = seed
    run_world(lora_rank, Layout(tp=2), cases, tokens, str(tmp_path / "weights.pt"), str(tmp_path))
    _check_expert_tp(tmp_path, references, tiny_moe_models["qwen3_moe"], tokens)

    for case in EXACT:
        logits, grads = references[case]
        got = torch.load(tmp_path / f"{case}.pt")
        assert (got["logits"] - logits).abs().max() <= 1e-4, case
        assert sorted(got["grads"]) == sorted(grads)
        for name, (grad_a, grad_b) in grads.items():
            mine_a, mine_b = got["grads"][name]
            assert grad_a.abs().max() > 0 and grad_b.abs().max() > 0, name
            assert _relative(mine_a, grad_a) <= 1e-4, (case, name, "A", _relative(mine_a, grad_a))
            assert _relative(mine_b, grad_b) <= 1e-4, (case, name, "B", _relative(mine_b, grad_b))
        assert got["trainable"] and all(".lora.lora_" in n for n in got["trainable"]), got["trainable"]
        rank0, rank1 = (torch.load(tmp_path / f"{case}.replicated.{r}.pt") for r in (0, 1))
        assert all(torch.equal(rank0[n], rank1[n]) for n in rank0), case

    # each rank: A whole and half of B on a column-parallel linear, half of A and B whole on a row-parallel one
    whole = torch.load(tmp_path / "llama.adapters.pt")
    row = ("o_proj", "down_proj")
    adapters = sum(
        a.numel() // 2 + b.numel() if n.endswith(row) else a.numel() + b.numel() // 2 for n, (a, b) in whole.items()
    )
    held = torch.load(tmp_path / "llama.pt")["optimizer"]
    assert held == {"ddp": adapters, "optimizer": adapters}, (held, adapters)

    _check_merged(torch.load(tmp_path / "llama.pt"), tiny_models["llama"])
    _check_peft_directory(tmp_path, "llama", tiny_models["llama"], tokens, PROJECTIONS)

    for fault in FAULTS:
        got = torch.load(tmp_path / f"llama_{fault}.pt")
        assert (got["logits"] - references[f"llama_{fault}"][0]).abs().max() > 1e-2, fault
    _check_unreduced(torch.load(tmp_path / "llama_sp_unreduced.pt"), references["llama_sp_unreduced"], row)

    _check_dropout(tmp_path, "llama_dropout", *references["llama_dropout"], tokens, weights)
    _check_dropout(tmp_path, "llama_sp_dropout", *references["llama_sp_dropout"], tokens, weights)


def _check_unreduced(got: dict, reference: tuple, row: tuple[str, ...]) -> None:
    """Under sequence parallelism with the replicated factors' gradients not summed over TP (their
    `sequence_parallel` mark taken off): the forward is unchanged, the split factors' gradients still PEFT's, and
    every replicated factor's (A of a column-parallel linear, B of a row-parallel one) fails the comparison."""
    logits, grads = reference
    assert (got["logits"] - logits).abs().max() <= 1e-4
    for name, (grad_a, grad_b) in grads.items():
        mine_a, mine_b = got["grads"][name]
        (split, want_split), (replicated, want) = ((mine_a, grad_a), (mine_b, grad_b))
        if not name.endswith(row):
            (split, want_split), (replicated, want) = ((mine_b, grad_b), (mine_a, grad_a))
        assert _relative(split, want_split) <= 1e-4, name
        assert _relative(replicated, want) > 1e-2, (name, _relative(replicated, want))


class _Masked(torch.nn.Module):
    """PEFT's `lora_dropout` with given masks ([batch, seq, width], one per forward): x * mask / (1 - p)."""

    def __init__(self, masks: list[torch.Tensor], p: float) -> None:
        super().__init__()
        self.masks, self.p = list(masks), p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.masks.pop(0) / (1 - self.p)


def _check_dropout(tmp_path, case: str, peft_model, values, tokens, weights) -> None:
    """Adapter dropout at TP2 (with or without sequence parallelism): the training forward's logits and every
    adapter gradient equal PEFT's with the same masks in its `lora_dropout` (each projection its own mask of the
    whole input, drawn alike on both ranks, about p of them zeros, the two halves of the sequence masked
    differently); the eval forward drops nothing (PEFT without dropout); the dropped logits are not the undropped
    ones."""
    got = torch.load(tmp_path / f"{case}.pt")
    masks, other = (torch.load(tmp_path / f"{case}.masks.{r}.pt") for r in (0, 1))
    assert sorted(masks) == sorted(values) and all(len(m) == 1 for m in masks.values())
    assert all(torch.equal(masks[n][0], other[n][0]) for n in masks)  # one mask of the whole input on every rank
    assert not torch.equal(masks["model.layers.0.self_attn.q_proj"][0], masks["model.layers.0.self_attn.k_proj"][0])
    zeros = torch.cat([m[0].flatten() for m in masks.values()]).eq(0).float().mean()
    assert abs(float(zeros) - DROPOUT) < 0.02, float(zeros)
    q = masks["model.layers.0.self_attn.q_proj"][0]  # [seq, batch, hidden]: whole, its halves not alike
    assert q.shape[0] == tokens.shape[1] and not torch.equal(q[: q.shape[0] // 2], q[q.shape[0] // 2 :])

    with torch.no_grad():
        plain = peft_model(tokens).logits
    assert (got["eval_logits"] - plain).abs().max() <= 1e-4
    peft_model.zero_grad(set_to_none=True)
    for name, (module, _, _) in values.items():
        module.lora_dropout["default"] = _Masked([m.transpose(0, 1) for m in masks[name]], DROPOUT)
    logits, grads = _reference(peft_model, values, tokens, weights)
    assert (got["logits"] - logits).abs().max() <= 1e-4
    assert (got["logits"] - plain).abs().max() > 1e-2  # the masks matter
    for name, (grad_a, grad_b) in grads.items():
        mine_a, mine_b = got["grads"][name]
        assert _relative(mine_a, grad_a) <= 1e-4, (name, "A", _relative(mine_a, grad_a))
        assert _relative(mine_b, grad_b) <= 1e-4, (name, "B", _relative(mine_b, grad_b))


@pytest.mark.slow
def test_lora_at_ep2_on_moe_equals_peft(tiny_moe_models, tmp_path):
    """Attention and expert adapters on tiny MoE models at EP2 (experts and their adapters split over the two ranks,
    attention adapters whole on each): Qwen3-MoE (a heterogeneous stack, layer 1 dense) with the experts as
    `SequentialMLP` and as `GroupedExperts` (`moe_grouped_gemm`), and Mixtral; PEFT's reference targets the experts'
    fused tensors (`target_parameters`). Logits and every A and B gradient against PEFT as at TP2 (the experts'
    per-expert gradients stacked into PEFT's factors; each expert ran the tokens of both ranks, which ran the same
    batch, so its gradients are twice PEFT's, as its base weights' would be: megatron-core's DDP scales expert
    gradients by 1 / data-parallel size like the dense ones); the attention factors' gradients equal on both ranks; only
    adapters trainable, DDP holding the experts' adapters in its expert buffers; the merged stream equal to PEFT's
    `merge_and_unload`, the adapted weights exactly the moved ones, and the PEFT directory loading in
    `PeftModel.from_pretrained`. Each rank's first two experts' adapters exchanged, or gate and up exchanged in
    the experts' `linear_fc1` adapters, move the logits."""
    vocab = 211
    tokens = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(3))
    weights = torch.randn(2, 12, vocab, generator=torch.Generator().manual_seed(4))
    torch.save(weights, tmp_path / "weights.pt")
    targets = (*ATTENTION, *EXPERTS)
    plans = {"qwen3_moe": ("qwen3_moe", ()), "mixtral": ("mixtral", ())}
    plans["qwen3_moe_grouped"] = ("qwen3_moe", (("moe_grouped_gemm", True),))
    plans.update({f"qwen3_moe_{fault}": ("qwen3_moe", ()) for fault in MOE_FAULTS})
    references, cases = {}, []
    for seed, (case, (model, overrides)) in enumerate(plans.items()):
        peft_model, values = _peft(tiny_moe_models[model], targets, seed)
        references[case] = _reference(peft_model, values, tokens, weights)
        torch.save(_whole_values(values), tmp_path / f"{case}.adapters.pt")
        fault = case.removeprefix("qwen3_moe_") if case.removeprefix("qwen3_moe_") in MOE_FAULTS else None
        cases.append(
            LoraCase(
                case,
                str(tiny_moe_models[model]),
                str(tmp_path / f"{case}.adapters.pt"),
                RANK,
                ALPHA,
                targets,
                fault,
                merged=case == "qwen3_moe",
                optimizer=case == "qwen3_moe",
                overrides=overrides,
            )
        )
    run_world(lora_rank, Layout(ep=2), cases, tokens, str(tmp_path / "weights.pt"), str(tmp_path))

    for case in ("qwen3_moe", "mixtral", "qwen3_moe_grouped"):
        logits, grads = references[case]
        got = torch.load(tmp_path / f"{case}.pt")
        module = "GroupedExperts" if case.endswith("grouped") else "SequentialMLP"
        assert got["experts"] == [(module, None)], got["experts"]
        assert (got["logits"] - logits).abs().max() <= 1e-4, case
        config = read_json(tiny_moe_models[plans[case][0]] / "config.json")
        moe_layers = config["num_hidden_layers"] - len(config.get("mlp_only_layers", []))
        experts = config.get("num_experts") or config["num_local_experts"]
        assert len(grads) == 4 * config["num_hidden_layers"] + 2 * moe_layers, sorted(grads)
        assert len(got["grads"]) == 4 * config["num_hidden_layers"] + 2 * moe_layers * experts
        for name, (grad_a, grad_b) in grads.items():
            mine_a, mine_b = got["grads"][name] if not name.endswith(EXPERTS) else _fused(name, got["grads"])
            if name.endswith(EXPERTS):  # an expert runs both ranks' tokens (the same batch twice): twice the sum
                mine_a, mine_b = mine_a / 2, mine_b / 2
            assert grad_a.abs().max() > 0 and grad_b.abs().max() > 0, name
            assert _relative(mine_a, grad_a) <= 1e-4, (case, name, "A", _relative(mine_a, grad_a))
            assert _relative(mine_b, grad_b) <= 1e-4, (case, name, "B", _relative(mine_b, grad_b))
        assert got["trainable"] and all(".lora.lora_" in n for n in got["trainable"]), got["trainable"]
        rank0, rank1 = (torch.load(tmp_path / f"{case}.replicated.{r}.pt") for r in (0, 1))
        assert sorted(rank0) == sorted(rank1) and all(torch.equal(rank0[n], rank1[n]) for n in rank0), case

    # each rank: the attention adapters whole, its four experts' adapters (in DDP's expert buffers)
    whole = torch.load(tmp_path / "qwen3_moe.adapters.pt")
    attention = sum(a.numel() + b.numel() for n, (a, b) in whole.items() if "[" not in n)
    expert = sum(a.numel() + b.numel() for n, (a, b) in whole.items() if "[" in n) // 2
    held = torch.load(tmp_path / "qwen3_moe.pt")["optimizer"]
    assert held == {"ddp": attention, "ddp_experts": expert, "optimizer": attention + expert}, held

    _check_merged_moe(torch.load(tmp_path / "qwen3_moe.pt"), tiny_moe_models["qwen3_moe"], targets)
    _check_peft_directory(tmp_path, "qwen3_moe", tiny_moe_models["qwen3_moe"], tokens, targets)

    for fault in MOE_FAULTS:
        got = torch.load(tmp_path / f"qwen3_moe_{fault}.pt")
        assert (got["logits"] - references[f"qwen3_moe_{fault}"][0]).abs().max() > 1e-2, fault


def _check_expert_tp(tmp_path, references: dict, hf_dir, tokens) -> None:
    """The tiny Qwen3-MoE at TP2 with expert tensor parallelism 2 (EP1; each expert's fc1 B split by rows as
    [gate_r; up_r], its fc2 A by columns), experts as `SequentialMLP` and `GroupedExperts`: logits within 1e-4 of
    PEFT's; every A and B gradient within 1e-4 of its largest element (the experts' twice PEFT's: without sequence
    parallelism both TP ranks hand the dispatcher the same tokens, which each expert then runs twice, as its base
    weights would); the experts' gradient norm as megatron-core's optimizer takes it (replicated factors counted
    once per group) is twice PEFT's; DDP and the optimizer hold each rank's parts of the adapters alone; the merged
    stream equals PEFT's `merge_and_unload`; the PEFT directory loads with the same logits; the model's checkpoint
    (megatron-core's `dist_checkpointing` of its sharded state dict) read back by HF name holds PEFT's A and B
    exactly. With each rank's fc1 B rows taken as a contiguous chunk of [gate; up] the logits move."""
    targets = (*ATTENTION, *EXPERTS)
    for case, (module, _) in (("moe_etp2", ("SequentialMLP", None)), ("moe_etp2_grouped", ("GroupedExperts", None))):
        logits, grads = references[case]
        got = torch.load(tmp_path / f"{case}.pt")
        assert got["experts"] == [(module, None)], got["experts"]
        assert (got["logits"] - logits).abs().max() <= 1e-4, case
        squares = 0.0
        for name, (grad_a, grad_b) in grads.items():
            expert = name.endswith(EXPERTS)
            mine_a, mine_b = _fused(name, got["grads"]) if expert else got["grads"][name]
            if expert:  # each expert runs the tokens of both TP ranks (the same batch): twice the sum
                mine_a, mine_b = mine_a / 2, mine_b / 2
                squares += float(grad_a.pow(2).sum() + grad_b.pow(2).sum())
            assert grad_a.abs().max() > 0 and grad_b.abs().max() > 0, name
            assert _relative(mine_a, grad_a) <= 1e-4, (case, name, "A", _relative(mine_a, grad_a))
            assert _relative(mine_b, grad_b) <= 1e-4, (case, name, "B", _relative(mine_b, grad_b))
        assert abs(got["expert_norm"] / 2 - squares**0.5) <= 1e-4 * squares**0.5, (got["expert_norm"], squares**0.5)
        rank0, rank1 = (torch.load(tmp_path / f"{case}.replicated.{r}.pt") for r in (0, 1))
        assert all(torch.equal(rank0[n], rank1[n]) for n in rank0), case

    # each rank: half of every split factor (attention's and the experts'), the replicated ones whole
    def held(name: str, a: torch.Tensor, b: torch.Tensor) -> int:
        row = ".o_proj" in name or ".down_proj[" in name  # A split by columns, B whole; else B split by rows
        return a.numel() // 2 + b.numel() if row else a.numel() + b.numel() // 2

    whole = torch.load(tmp_path / "moe_etp2.adapters.pt")
    attention = sum(held(n, a, b) for n, (a, b) in whole.items() if "[" not in n)
    experts = sum(held(n, a, b) for n, (a, b) in whole.items() if "[" in n)
    got = torch.load(tmp_path / "moe_etp2.pt")
    assert got["optimizer"] == {"ddp": attention, "ddp_experts": experts, "optimizer": attention + experts}, got
    _check_merged_moe(got, hf_dir, targets, seed=references["moe_etp2_seed"])
    _check_peft_directory(tmp_path, "moe_etp2", hf_dir, tokens, targets)
    # the checkpoint written at ETP2 holds PEFT's whole A and B of every adapter (the experts' fc1 B as [gate; up])
    lora = LoraConfig(enabled=True, rank=RANK, alpha=ALPHA, target_modules=targets)
    saved = checkpoint_adapters(tmp_path / "moe_etp2.ckpt", megatron_spec(read_json(hf_dir / "config.json")), lora)
    assert sorted(saved) == sorted(whole)
    assert all(torch.equal(saved[n][0], whole[n][0]) and torch.equal(saved[n][1], whole[n][1]) for n in whole)
    broken = torch.load(tmp_path / "moe_etp2_expert_tp_rows.pt")
    assert (broken["logits"] - references["moe_etp2_expert_tp_rows"][0]).abs().max() > 1e-2


def _check_merged_moe(got: dict, hf_dir, targets: tuple[str, ...], seed: int = 0) -> None:
    """The merged stream (per-expert HF names) equals PEFT's `merge_and_unload` (transformers 5's fused experts:
    `gate_up_proj[e]` = [gate; up] rows, `down_proj[e]`), name for name; the moved tensors are exactly the
    attention projections and every expert's, which are the weights the adapters name for the refit. `seed`: the
    case's (the same A and B)."""
    import re

    from safetensors.torch import load_file

    peft_model, _ = _peft(hf_dir, targets, seed=seed)
    reference = peft_model.merge_and_unload().state_dict()
    base = load_file(hf_dir / "model.safetensors")
    stream = got["merged"]
    assert got["restored"] and sorted(stream) == sorted(base)
    expert = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")
    for name, tensor in stream.items():
        found = expert.fullmatch(name)
        if found is None:
            want = reference[name]
        elif found[3] == "down":
            want = reference[f"{found[1]}.down_proj"][int(found[2])]
        else:
            gate_up = reference[f"{found[1]}.gate_up_proj"][int(found[2])]
            want = gate_up.chunk(2)[0 if found[3] == "gate" else 1]
        torch.testing.assert_close(tensor, want, atol=1e-6, rtol=0, msg=name)
    moved = {name for name in stream if not torch.equal(stream[name], base[name])}
    wanted = {n for n in base if n.rsplit(".", 2)[-2] in ATTENTION or expert.fullmatch(n)}
    assert moved == wanted, sorted(moved ^ wanted)
    assert got["adapted"] == wanted, sorted(got["adapted"] ^ wanted)


def _check_merged(got: dict, hf_dir) -> None:
    """The stream of the merged model equals PEFT's `merge_and_unload` of the same adapters, name for name; the
    targeted weights moved away from the base (so the comparison could fail), exactly the weights the adapters name
    for the refit (`adapted_weights`), and the model was restored."""
    from safetensors.torch import load_file

    peft_model, _ = _peft(hf_dir, PROJECTIONS, seed=0)  # the "llama" case's seed: the same A and B
    reference = peft_model.merge_and_unload().state_dict()
    base = load_file(hf_dir / "model.safetensors")
    stream = got["merged"]
    assert got["restored"] and sorted(stream) == sorted(base)
    for name, tensor in stream.items():
        torch.testing.assert_close(tensor, reference[name], atol=1e-6, rtol=0, msg=name)
    moved = {name for name in stream if not torch.equal(stream[name], base[name])}
    assert moved == {n for n in base if n.rsplit(".", 2)[-2] in PROJECTIONS}, sorted(moved)
    assert got["adapted"] == moved  # what the adapters name for the refit (`adapted_weights`)


def _check_peft_directory(tmp_path, case: str, hf_dir, tokens, targets: tuple[str, ...]) -> None:
    """The adapters written as a PEFT directory load with `PeftModel.from_pretrained` onto the base model (the
    file's tensors are exactly the adapter parameters PEFT builds for the config) and give the megatron-core model's
    logits; read back, they are the adapters set, bit for bit."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from hf_mcore_bridge.megatron.lora_peft import read_peft_adapter

    directory = tmp_path / f"{case}.peft"
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32), directory)
    loaded = {n.replace(".default", ""): p for n, p in model.named_parameters() if ".lora_" in n}
    assert sorted(loaded) == sorted(load_file(directory / "adapter_model.safetensors"))
    with torch.no_grad():
        logits = model(tokens).logits
    assert (logits - torch.load(tmp_path / f"{case}.pt")["logits"]).abs().max() <= 1e-4
    lora, values = read_peft_adapter(directory)
    assert (lora.rank, lora.alpha, lora.target_modules) == (RANK, ALPHA, tuple(sorted(targets)))
    written = torch.load(tmp_path / f"{case}.adapters.pt")
    assert sorted(values) == sorted(written)
    assert all(torch.equal(values[n][0], written[n][0]) and torch.equal(values[n][1], written[n][1]) for n in values)


def test_fused_qkv_rows_follow_the_query_groups():
    """TP2, 4 query groups of 2 q heads (head dim 1): rank 1 holds groups 2 and 3, as q q k v per group, and the
    adapters' concatenated output (q's rows 4-7 of its 8, then k's 2-3 of 4, then v's 2-3) is placed there."""
    from hf_mcore_bridge.models.mapping_types import Dims

    entry = FusedQKV("decoder.layers.{layer}.self_attention.linear_qkv.weight", q="q", k="k", v="v")
    dims = Dims(num_attention_heads=8, num_query_groups=4, head_dim=1, vocab_size=1, padded_vocab_size=1)
    rows = column_rows(entry, {"q": 8, "k": 4, "v": 4}, dims, tp=2, rank=1)
    # concatenation: q4 q5 q6 q7 k2 k3 v2 v3 -> positions 0..7; fused rank-1 rows: q4 q5 k2 v2 q6 q7 k3 v3
    assert rows.tolist() == [0, 1, 4, 6, 2, 3, 5, 7]


def _spec(hf_dir):
    return megatron_spec(read_json(hf_dir / "config.json"))


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (LoraConfig(enabled=True, dropout=1.0), "dropout 1.0: must be in"),
        (
            LoraConfig(enabled=True, dropout=0.1, target_modules=("experts.down_proj",)),
            "dropout 0.1 on experts' adapters: not implemented",
        ),
        (LoraConfig(enabled=True, target_modules=("q_proj",)), "target all of ['q_proj', 'k_proj', 'v_proj']"),
        (LoraConfig(enabled=True, target_modules=("up_proj",)), "target all of ['gate_proj', 'up_proj']"),
    ],
)
def test_unimplemented_adapters_are_refused_by_name(config, message, tiny_models):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        add_lora(torch.nn.Linear(1, 1), _spec(tiny_models["llama"]), config)


@pytest.mark.parametrize(
    ("model", "targets", "message"),
    [
        ("gpt_oss", ("experts.gate_up_proj",), "experts.gate_up_proj of GptOssForCausalLM: its experts are not plain"),
        ("gpt_oss", ("experts.down_proj",), "experts.down_proj of GptOssForCausalLM: its experts are not plain"),
        ("llama", ("experts.down_proj",), "experts.down_proj: LlamaForCausalLM is a dense model"),
        ("qwen2_moe", ("gate_proj", "up_proj", "down_proj"), "gate_proj, up_proj, down_proj of Qwen2MoeForCausalLM"),
        ("qwen3_moe", ("q_proj", "k_proj", "v_proj", "down_proj"), "down_proj of Qwen3MoeForCausalLM, a mixture-of"),
    ],
)
def test_unimplemented_expert_adapters_are_refused_by_name(model, targets, message, tiny_models, tiny_moe_models):
    """GPT-OSS's interleaved experts, expert targets on a dense model, the dense MLP names on a MoE model (Qwen2-MoE's
    shared expert, Qwen3-MoE's dense layer: PEFT reads those names as the experts' there,
    `test_peft_reads_dense_mlp_names_as_the_experts_on_moe_models`)."""
    directory = {**tiny_models, **tiny_moe_models}[model]
    with pytest.raises(ValueError, match=message):
        add_lora(torch.nn.Linear(1, 1), _spec(directory), LoraConfig(enabled=True, target_modules=targets))


def test_peft_reads_dense_mlp_names_as_the_experts_on_moe_models(tiny_moe_models):
    """Why `add_lora` refuses `gate_proj` / `up_proj` / `down_proj` on a MoE model: PEFT (transformers 5) puts those
    target_modules on the routed experts' fused tensors of the tiny Qwen3-MoE and adapts no MLP of its dense layer
    1; the project's expert targets name the experts' linears alone."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from hf_mcore_bridge.megatron.lora import targeted_entries

    hf_dir = tiny_moe_models["qwen3_moe"]
    assert read_json(hf_dir / "config.json")["mlp_only_layers"] == [1]
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, PeftLoraConfig(r=RANK, target_modules=["gate_proj", "up_proj", "down_proj"]))
    adapted = sorted(n for n, m in peft_model.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A)
    assert adapted and all(".mlp.experts" in n for n in adapted), adapted
    experts = LoraConfig(enabled=True, target_modules=("experts.down_proj",))
    found = [entry.mcore for entry in targeted_entries(_spec(hf_dir), experts)]
    assert found == ["decoder.layers.{layer}.mlp.experts.local_experts.{expert}.linear_fc2.weight"], found


@pytest.mark.parametrize(
    ("config", "tensors", "message"),
    [
        ({"use_dora": True}, None, "use_dora=True is not implemented"),
        ({"peft_type": "IA3"}, None, "peft_type 'IA3', not LORA"),
        ({}, {"model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(4, 64)}, "not a PEFT LoRA tensor name"),
        ({}, {"base_model.model.model.layers.0.mlp.up_proj.lora_A.weight": torch.ones(4, 64)}, "not lora_A and lora_B"),
    ],
)
def test_unsupported_peft_directories_are_refused_by_name(config, tensors, message, tmp_path):
    from hf_mcore_bridge.megatron.lora_peft import CONFIG_FILE, read_peft_adapter, write_peft_adapter

    name = "model.layers.0.mlp.up_proj"
    write_peft_adapter({name: (torch.ones(4, 64), torch.ones(96, 4))}, LoraConfig(rank=4), tmp_path, None)
    written = json.loads((tmp_path / CONFIG_FILE).read_text())
    (tmp_path / CONFIG_FILE).write_text(json.dumps(written | config))
    if tensors is not None:
        from safetensors.torch import save_file

        save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match=message):
        read_peft_adapter(tmp_path)


@pytest.mark.parametrize("target", EXPERTS)
def test_one_expert_target_alone_loads_in_peft(target, tiny_moe_models, tmp_path):
    """A PEFT directory of one expert target alone (no `base_layer` nesting, `target_modules` empty): PEFT loads
    every tensor of it, and its merged model adds s * B_e A_e to expert e's slice of the fused tensor, written here
    from the per-expert factors."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hf_mcore_bridge.megatron.lora_peft import write_peft_adapter

    hf_dir = tiny_moe_models["qwen3_moe"]
    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).state_dict()
    parameter = target.split(".")[1]
    fused = {n.removesuffix(f".{parameter}") for n in base if n.endswith(f"mlp.experts.{parameter}")}
    generator = torch.Generator().manual_seed(5)
    values = {}
    for module in sorted(fused):
        experts, out, columns = base[f"{module}.{parameter}"].shape
        for e in range(experts):
            a, b = torch.randn(RANK, columns, generator=generator), torch.randn(out, RANK, generator=generator)
            values[f"{module}.{parameter}[{e}]"] = (a, b)
    lora = LoraConfig(enabled=True, rank=RANK, alpha=ALPHA, target_modules=(target,))
    write_peft_adapter(values, lora, tmp_path, str(hf_dir))
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32), tmp_path)
    assert json.loads((tmp_path / "adapter_config.json").read_text())["target_parameters"] == [target]
    loaded = [n for n, _ in model.named_parameters() if ".lora_" in n]
    assert len(loaded) == 2 * len(fused) and not any("base_layer" in n for n in loaded), loaded
    merged = model.merge_and_unload().state_dict()
    for name, (a, b) in values.items():
        module, e = name.split("[")[0], int(name.split("[")[1][:-1])
        want = base[module][e] + (ALPHA / RANK) * (b @ a)
        torch.testing.assert_close(merged[module][e], want, atol=1e-5, rtol=1e-5, msg=name)
