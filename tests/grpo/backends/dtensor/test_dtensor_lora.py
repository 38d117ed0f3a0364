"""LoRA on the DTensor backend (PEFT's LoRA layers under FSDP2), in a two-process gloo world at dp_shard=2, against
HF transformers + PEFT + autograd + torch's AdamW written here.

- One `train_minibatch` (two micro-batches per rank, KL term, clipping active) from the trainer's initial adapters
  (A seeded as the megatron-core backend seeds it, B zero), copied into a PEFT model: the loss, the gradient norm
  and every updated A and B equal the reference's; the base weights are untouched; the optimizer holds the adapters
  alone; the merged stream equals PEFT's `merge_and_unload` of the reference's updated adapters, with exactly the
  targeted projections changed; the base stream (`merged=False`) equals the HF checkpoint. Two cases: a Llama with
  every dense projection adapted (and adapter dropout checked), and a Qwen3-MoE with the attention projections and
  the routed experts adapted (`experts.gate_up_proj`, `experts.down_proj`: PEFT's `target_parameters`), whose
  experts the stream names per expert as the checkpoint does (the reference's fused tensors cut in the test).
- A short GRPO run with the embedded engine: every step's rollouts and probe prompt have the trainer's log-probs
  within fp32 agreement (the engine holds the merged weights), every refit after the initial one streams the
  adapted projections alone, and the run's PEFT directory loads with `PeftModel.from_pretrained`; a run started
  from that directory (`policy.lora.adapter_path`) at lr 0 writes the same adapters back.
- The same for the Qwen3-MoE with expert adapters (three steps): the engine's agreement, the refits of the adapted
  tensors alone (every expert's), the checkpoint's `bridge export` (merged and `--peft`) against PEFT.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from hf_mcore_bridge.grpo.algorithm.batching import make_microbatches
from hf_mcore_bridge.grpo.algorithm.losses import LossConfig, grpo_loss
from hf_mcore_bridge.grpo.backends.dtensor.config import DTensorConfig
from hf_mcore_bridge.megatron.lora_config import EXPERT_PROJECTIONS, PROJECTIONS, LoraConfig, expert_targets
from hf_mcore_bridge.megatron.world import run_torch_world

from ...lora_exports import check_lora_exports, export_both, per_expert
from ...tiny_policy import WORDS, build_tiny_policy
from .dtensor_ranks import lora_step_rank, lora_tp_step_rank
from .test_dtensor import ROLLOUTS, TEMPERATURE, _reference_logprobs

pytestmark = pytest.mark.slow

MICRO_BATCH, LR, WEIGHT_DECAY, CLIP = 2, 1e-2, 0.1, 0.05
LOSS = LossConfig(kl_coef=0.05)
LORA = LoraConfig(enabled=True, rank=4, alpha=8.0, target_modules=PROJECTIONS)
EXACT = 1.0001
DROPOUT = 0.25
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
EXPERT_LORA = LoraConfig(enabled=True, rank=4, alpha=8.0, target_modules=ATTENTION + EXPERT_PROJECTIONS)
MOE = {"architecture": "Qwen3MoeForCausalLM", "mlp_only_layers": [1], "router_aux_loss_coef": 0.0}
"""The tiny Qwen3-MoE: layer 0 routed (8 experts, top 2), layer 1 dense."""
EXPERT_WEIGHT = re.compile(r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight")
SLOT = re.compile(r"(.+)\[(\d+)\]")
"""An expert adapter's name on the trainer: `<fused tensor>[<expert>]`."""


def _adapted(name: str, lora: LoraConfig) -> bool:
    """Whether the HF checkpoint's tensor `name` is one the adapters of `lora` change (written independently of
    the trainer: its projection name, or a routed expert's weight with expert targets)."""
    if EXPERT_WEIGHT.fullmatch(name):
        return bool(expert_targets(lora))
    return name.endswith(".weight") and name.rsplit(".", 2)[-2] in lora.target_modules


def _peft_reference(policy: Path, initial: dict, lora: LoraConfig = LORA) -> tuple[torch.nn.Module, dict]:
    """HF + PEFT with the trainer's initial adapters; its LoRA modules by the trainer's adapter names (a fused
    expert tensor's `ParamWrapper` by that tensor's name, its factors set from the experts' pairs)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    experts = expert_targets(lora)
    hf = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32, attn_implementation="eager")
    config = PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        target_modules=[t for t in lora.target_modules if t not in experts],
        target_parameters=list(experts) or None,
    )
    model = get_peft_model(hf, config)
    modules = {}
    for name, m in model.named_modules():
        if hasattr(m, "lora_A") and "default" in m.lora_A:
            name = name.removeprefix("base_model.model.")
            if hasattr(m, "parameter_name"):  # a `ParamWrapper`: named by the fused expert tensor it adapts
                name = f"{name.replace('.base_layer', '')}.{m.parameter_name}"
            modules[name] = m
    with torch.no_grad():
        for name, m in modules.items():
            a, b = _fused(name, initial) if hasattr(m, "parameter_name") else initial[name]
            m.lora_A["default"].weight.copy_(a)
            m.lora_B["default"].weight.copy_(b)
    return model, modules


def _fused(tensor: str, pairs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts' (A_e, B_e) of `tensor` (named `tensor[e]`) as PEFT's `ParamWrapper` factors: A
    [experts * rank, in] (expert e's rows e * rank ...), B [out, rank * experts] (its `get_delta_weight` reshapes
    B to [out, rank, experts]: expert e's B is B[:, :, e])."""
    mine = sorted(
        (int(found[2]), pair) for n, pair in pairs.items() if (found := SLOT.fullmatch(n)) and found[1] == tensor
    )
    assert [e for e, _ in mine] == list(range(len(mine))) and mine, tensor
    b = torch.stack([pair[1] for _, pair in mine], dim=-1)
    return torch.cat([pair[0] for _, pair in mine]), b.reshape(b.shape[0], -1)


def _by_trainer_name(modules: dict, grad: bool = False) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The reference's adapters (or their gradients) under the trainer's names, a fused tensor's per expert."""
    result = {}
    for name, m in modules.items():
        a, b = m.lora_A["default"].weight, m.lora_B["default"].weight
        a, b = (a.grad, b.grad) if grad else (a.detach(), b.detach())
        if not hasattr(m, "parameter_name"):
            result[name] = (a, b)
            continue
        experts = m.num_experts
        rows, columns = a.reshape(experts, -1, a.shape[-1]), b.reshape(b.shape[0], -1, experts)
        for e in range(experts):
            result[f"{name}[{e}]"] = (rows[e], columns[:, :, e])
    return result


def _reference_step(policy: Path, initial: dict, lora: LoraConfig) -> tuple[torch.nn.Module, dict, float, float, dict]:
    """One step of HF + PEFT (from the trainer's `initial` adapters) with torch's AdamW over every rollout: the
    model, its LoRA modules, the loss, the gradient norm before clipping and the clipped gradients (trainer names)."""
    model, modules = _peft_reference(policy, initial, lora)
    assert sorted(_by_trainer_name(modules)) == sorted(initial)
    trainable = [p for p in model.parameters() if p.requires_grad]
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
    grads = {n: (a.clone(), b.clone()) for n, (a, b) in _by_trainer_name(modules, grad=True).items()}
    optimizer.step()
    return model, modules, total, float(norm), grads


@pytest.mark.parametrize("case", ["dense", "experts"])
def test_lora_step_at_dp_shard2_matches_hf_peft_reference(case: str, tmp_path: Path) -> None:
    lora = LORA if case == "dense" else EXPERT_LORA
    policy = build_tiny_policy(tmp_path / "policy", seed=5, **({} if case == "dense" else MOE))
    settings = DTensorConfig(enabled=True, data_parallel_shard_size=2, lr=LR, weight_decay=WEIGHT_DECAY, clip_grad=CLIP)
    out = tmp_path / "out.pt"
    dropout = None
    if case == "dense":  # expert adapters take no dropout (PEFT's `ParamWrapper` has none)
        random_adapters = _random_peft_adapter(policy, tmp_path / "random_adapter")
        dropout = dataclasses.replace(LORA, dropout=DROPOUT, adapter_path=str(tmp_path / "random_adapter"))
    run_torch_world(
        lora_step_rank, 2, str(policy), settings, lora, ROLLOUTS, MICRO_BATCH, LOSS, TEMPERATURE, str(out), dropout
    )
    got = torch.load(out, weights_only=True)
    assert all(not b.any() for _, b in got["initial"].values()) and all(a.any() for a, _ in got["initial"].values())

    model, modules, total, norm, _ = _reference_step(policy, got["initial"], lora)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert got["held"] == sum(p.numel() for p in trainable)  # the optimizer holds the adapters alone
    assert got["metrics"]["loss"] == pytest.approx(total, abs=1e-6)
    assert got["metrics"]["grad_norm"] == pytest.approx(float(norm), rel=1e-5)
    reference = _by_trainer_name(modules)
    for name, (a, b) in got["trained"].items():
        torch.testing.assert_close(a, reference[name][0], atol=1e-5, rtol=0, msg=name)
        torch.testing.assert_close(b, reference[name][1], atol=1e-5, rtol=0, msg=name)
    assert max(b.abs().max() for _, b in got["trained"].values()) > 100 * 1e-5  # the step is far larger

    hf = load_file(policy / "model.safetensors")
    assert got["base"].keys() == hf.keys() and all(torch.equal(got["base"][n], hf[n]) for n in hf)
    merged = per_expert(model.merge_and_unload().state_dict())
    changed = {n for n in hf if not torch.equal(got["merged"][n], hf[n])}
    adapted = {n for n in hf if _adapted(n, lora)}
    assert set(got["adapted"]) == adapted
    if case == "dense":
        assert changed == adapted
    else:  # an expert no token was routed to keeps B = 0 after the step: its merged weights stay the base's
        assert changed <= adapted and {n for n in changed if EXPERT_WEIGHT.fullmatch(n)}
        assert len([n for n in adapted if EXPERT_WEIGHT.fullmatch(n)]) == 3 * 8  # every expert of layer 0
    for name, tensor in got["merged"].items():
        torch.testing.assert_close(tensor, merged[name], atol=1e-5, rtol=0, msg=name)
    assert got["only"].keys() == adapted
    assert all(torch.equal(got["only"][n], got["merged"][n]) for n in got["adapted"])
    _check_checkpoint_round_trip(got, tmp_path / "ckpt" / "iter_0000001", policy, lora, sorted(modules))
    if dropout is not None:
        _check_dropout(got["dropout"], random_adapters)


@pytest.mark.parametrize(("dp_shard", "fault"), [(1, None), (2, None), (1, "no_allreduce")])
def test_lora_step_at_tp2_matches_hf_peft_reference(dp_shard: int, fault: str | None, tmp_path: Path) -> None:
    """Tensor parallelism 2 (dp_shard 1, and 2: four ranks) with every dense projection adapted: A whole and B
    column-wise on q/k/v and gate/up, A row-wise and B whole on o and down (PEFT's Megatron split). One
    `train_minibatch` equals HF + PEFT + autograd: the loss, the gradient norm, every adapter's (clipped) gradients
    and values after the step, the merged stream. `no_allreduce`: a broken plan (a row-parallel projection's
    partial A x not summed over TP), which the comparison must catch."""
    policy = build_tiny_policy(tmp_path / "policy", seed=5)
    settings = DTensorConfig(
        enabled=True,
        tensor_parallel_size=2,
        data_parallel_shard_size=dp_shard,
        lr=LR,
        weight_decay=WEIGHT_DECAY,
        clip_grad=CLIP,
    )
    out = tmp_path / "out.pt"
    run_torch_world(
        lora_tp_step_rank,
        2 * dp_shard,
        str(policy),
        settings,
        LORA,
        ROLLOUTS,
        MICRO_BATCH,
        LOSS,
        TEMPERATURE,
        str(out),
        fault,
    )
    got = torch.load(out, weights_only=True)
    model, modules, total, norm, grads = _reference_step(policy, got["initial"], LORA)
    mismatched = [n for n, (a, b) in got["grads"].items() if not _close(a, grads[n][0]) or not _close(b, grads[n][1])]
    if fault is not None:
        assert mismatched, "the broken plan went unnoticed"
        return
    q, o = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj"
    assert got["layout"][q] == ("whole", "S(0)") and got["layout"][o] == ("S(1)", "whole")  # Shard(dim)
    assert got["metrics"]["loss"] == pytest.approx(total, abs=1e-6)
    assert got["metrics"]["grad_norm"] == pytest.approx(norm, rel=1e-5)
    assert not mismatched, mismatched
    assert all(b.abs().max() > 0 for _, b in grads.values())  # every B's gradient
    reference = _by_trainer_name(modules)
    for name, (a, b) in got["trained"].items():
        torch.testing.assert_close(a, reference[name][0], atol=1e-5, rtol=0, msg=name)
        torch.testing.assert_close(b, reference[name][1], atol=1e-5, rtol=0, msg=name)
    merged = model.merge_and_unload().state_dict()
    for name, tensor in got["merged"].items():
        torch.testing.assert_close(tensor, merged[name], atol=1e-5, rtol=0, msg=name)


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return torch.allclose(got, want, atol=1e-6, rtol=1e-4)


def _random_peft_adapter(policy: Path, directory: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """PEFT's `save_pretrained` of adapters with random A and B (B nonzero) on the tiny model; by HF module name."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    model = get_peft_model(hf, PeftLoraConfig(r=LORA.rank, lora_alpha=LORA.alpha, target_modules=list(PROJECTIONS)))
    generator = torch.Generator().manual_seed(3)
    values = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            if hasattr(module, "lora_A") and "default" in module.lora_A:
                a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
                a.copy_(torch.randn(a.shape, generator=generator) * 0.2)
                b.copy_(torch.randn(b.shape, generator=generator) * 0.2)
                values[name.removeprefix("base_model.model.")] = (a.clone(), b.clone())
    model.save_pretrained(directory)
    return values


def _check_dropout(records: dict, adapters: dict) -> None:
    """Adapter dropout p on the DTensor backend: in the training forward each adapted module adds
    scale * B A (x * mask / (1 - p)), its `lora_dropout` zeroing about p of x's elements (the mask captured from its
    output) and scaling the rest; in the log-prob forward (eval mode) it adds scale * B A x, x untouched."""
    scale = LORA.alpha / LORA.rank
    assert sorted(records["train"]) == sorted(records["eval"]) == sorted(adapters)
    zeros, elements = 0, 0
    for name, (a, b) in adapters.items():
        train, evaluated = records["train"][name], records["eval"][name]
        x = train["x"]
        assert x.ne(0).all(), name
        mask = train["dropped"].ne(0).to(x.dtype)
        torch.testing.assert_close(train["dropped"], x * mask / (1 - DROPOUT), atol=1e-6, rtol=1e-6, msg=name)
        zeros, elements = zeros + int(mask.eq(0).sum()), elements + mask.numel()
        reference = F.linear(F.linear(x * mask / (1 - DROPOUT), a), b) * scale
        contribution = train["output"] - train["base"]
        torch.testing.assert_close(contribution, reference, atol=1e-5, rtol=0, msg=name)
        undropped = F.linear(F.linear(x, a), b) * scale
        assert (contribution - undropped).abs().max() > 1e-3, name  # the mask matters
        assert torch.equal(evaluated["dropped"], evaluated["x"]), name
        contribution = evaluated["output"] - evaluated["base"]
        torch.testing.assert_close(contribution, F.linear(F.linear(evaluated["x"], a), b) * scale, atol=1e-5, rtol=0)
    assert abs(zeros / elements - DROPOUT) < 0.03, zeros / elements
    # activation recomputation (torch.utils.checkpoint restores the RNG) redraws the training forward's masks
    assert sorted(records["recomputed"]) == sorted(adapters)
    for name, (forward, again) in records["recomputed"].items():
        assert torch.equal(forward, again) and torch.equal(forward, records["train"][name]["dropped"]), name


def _check_checkpoint_round_trip(
    got: dict, iteration: Path, policy: Path, wanted: LoraConfig, adapted: list[str]
) -> None:
    """The step's LoRA checkpoint: the adapters and their optimizer state alone in DCP (PEFT's tensors: an expert
    tensor's fused), the adapters whole as a PEFT directory naming the base, the base's config without weights; a
    policy loaded from it takes the next step exactly as the saved one does, and one given the adapters alone (no
    optimizer state) does not. `adapted`: the adapted tensors' names (a fused expert tensor's for its experts)."""
    from hf_mcore_bridge.checkpoint.dcp_reader import DCPCheckpoint
    from hf_mcore_bridge.megatron.lora_peft import read_peft_adapter

    dcp = DCPCheckpoint(iteration / "model_optim")
    keys = dcp.tensor_keys()
    model_keys = [k for k in keys if k.startswith("model.")]
    optim_keys = [k for k in keys if k.startswith("optim.")]
    assert len(model_keys) == 2 * len(adapted) and all(".lora_" in k for k in model_keys), model_keys[:4]
    assert optim_keys and all(".lora_" in k for k in optim_keys), optim_keys[:4]
    for name, (a, b) in got["trained"].items():
        if name in adapted:  # a dense adapter: its factors under PEFT's module name
            assert torch.equal(dcp.read(f"model.{name}.lora_A.default.weight"), a), name
            assert torch.equal(dcp.read(f"model.{name}.lora_B.default.weight"), b), name
    stored = {k.removeprefix("model."): dcp.read(k) for k in model_keys}
    for tensor in (n for n in adapted if n not in got["trained"]):  # a fused expert tensor: PEFT's fused factors
        a, b = _fused(tensor, got["trained"])
        found = [k for k, v in stored.items() if ".lora_A." in k and torch.equal(v, a)]
        assert len(found) == 1, tensor
        assert torch.equal(stored[found[0].replace(".lora_A.", ".lora_B.")], b), tensor
    lora, written = read_peft_adapter(iteration / "adapter")
    wanted_targets = sorted(wanted.target_modules)
    assert (lora.rank, lora.alpha, sorted(lora.target_modules)) == (wanted.rank, wanted.alpha, wanted_targets)
    assert written.keys() == got["trained"].keys()
    assert all(torch.equal(written[n][i], got["trained"][n][i]) for n in written for i in (0, 1))
    saved = json.loads((iteration / "adapter" / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == str(policy.resolve())
    assert (iteration / "hf" / "config.json").is_file() and not list((iteration / "hf").glob("*.safetensors"))

    continued, resumed, alone = got["continued"], got["resumed"], got["adapters_alone"]
    assert resumed["metrics"] == continued["metrics"]
    for name, (a, b) in continued["adapters"].items():
        assert torch.equal(resumed["adapters"][name][0], a) and torch.equal(resumed["adapters"][name][1], b), name
    # without the optimizer state (Adam's moments and step) the second step's update differs
    assert alone["metrics"]["grad_norm"] == continued["metrics"]["grad_norm"]
    assert not all(torch.equal(alone["adapters"][n][1], b) for n, (_, b) in continued["adapters"].items())


STEPS = 4


def _run_config(root: Path, policy: Path, name: str, **lora: object) -> dict:
    prompts = root / "say7.jsonl"
    if not prompts.exists():
        rows = [{"prompt": " ".join(["Say"] + ["7"] * k) + ". Answer:", "answer": "7"} for k in range(1, 7)]
        prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return {
        "policy": {
            "model_path": str(policy),
            "megatron_cfg": {"enabled": False},
            "dtensor_cfg": {"enabled": True, "data_parallel_shard_size": 2, "micro_batch_size": 16, "lr": 5e-2},
            "lora": {"enabled": True, "rank": 4, "alpha": 8, "dropout": 0.1, "target_modules": list(PROJECTIONS)}
            | lora,
        },
        "grpo": {"num_prompts_per_step": 4, "num_generations_per_prompt": 8, "max_num_steps": STEPS},
        "loss_fn": {"kl_coef": 0.01},
        "generation": {"max_new_tokens": 3, "stop_token_ids": [WORDS.index("[EOS]")], "max_model_len": 64},
        "data": {"train_jsonl": str(prompts)},
        "reward": {"name": "number"},
        "checkpointing": {"enabled": True, "checkpoint_dir": str(root / name / "ckpt"), "save_period": STEPS // 2},
        "logger": {"log_dir": str(root / name / "logs"), "print_progress": False},
    }


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """A four-step DTensor LoRA run at dp_shard=2 (adapter dropout 0.1) with checkpoints after steps 2 and 4."""
    from hf_mcore_bridge.grpo.run.config import config_from_dict
    from hf_mcore_bridge.grpo.run.trainer import train_grpo

    root = tmp_path_factory.mktemp("dtensor-lora")
    policy = build_tiny_policy(root / "policy")
    return train_grpo(config_from_dict(_run_config(root, policy, "straight"))), root, policy


def test_lora_run_keeps_engine_and_trainer_in_agreement(lora_run: tuple, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hf_mcore_bridge.grpo.run.config import config_from_dict
    from hf_mcore_bridge.grpo.run.trainer import ADAPTER_DIR, train_grpo

    run, root, policy = lora_run
    assert run.steps == STEPS
    for step in run.metrics:
        assert step["token_mult_prob_error"] <= EXACT, step["step"]
        assert step["probe_token_mult_prob_error"] <= EXACT, step["step"]
        assert step["grad_norm"] > 0
    weights = load_file(policy / "model.safetensors")
    adapted = sum(t.numel() * t.element_size() for n, t in weights.items() if n.rsplit(".", 2)[-2] in PROJECTIONS)
    assert run.series("refit_bytes") == [adapted] * STEPS  # after the initial refit: the adapted projections alone
    directory = root / "straight" / "logs" / ADAPTER_DIR
    written = load_file(directory / "adapter_model.safetensors")
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32), directory)
    held = {k.replace(".default", ""): v for k, v in loaded.state_dict().items() if ".lora_" in k}
    assert sorted(held) == sorted(written) and all(torch.equal(held[k], written[k]) for k in written)
    assert all(written[k].abs().max() > 0 for k in written if ".lora_B." in k)

    # a run from that directory (`policy.lora.adapter_path`) starts with its A and B: at lr 0 it writes them back
    config = _run_config(tmp_path, policy, "again", adapter_path=str(directory))
    config["policy"]["dtensor_cfg"]["lr"] = 0.0
    config["grpo"]["max_num_steps"] = 1
    config["checkpointing"]["enabled"] = False
    assert train_grpo(config_from_dict(config)).steps == 1
    again = load_file(tmp_path / "again" / "logs" / ADAPTER_DIR / "adapter_model.safetensors")
    assert again.keys() == written.keys() and all(torch.equal(again[k], written[k]) for k in written)


def test_lora_run_resumes_from_its_checkpoint_and_exports(lora_run: tuple, tmp_path: Path) -> None:
    """Resumed from the step-2 checkpoint (adapters, their optimizer state, LR schedule, prompt order; the base
    read again from policy.model_path; the dropout masks seeded by the step), steps 3-4 log exactly the
    uninterrupted run's metrics and end with its adapters. `bridge export` of the step-4 checkpoint: `--peft`
    writes the adapters the run gathered at its end; the merged export equals PEFT's `merge_and_unload` of them on
    the base, tensor by tensor, also with the base given as a megatron checkpoint."""
    from hf_mcore_bridge.checkpoint.megatron_dirs import write_tracker
    from hf_mcore_bridge.grpo.run.config import config_from_dict
    from hf_mcore_bridge.grpo.run.trainer import ADAPTER_DIR, train_grpo

    run, root, policy = lora_run
    checkpoints = root / "straight" / "ckpt"
    middle = STEPS // 2
    shutil.copytree(checkpoints / f"iter_{middle:07d}", tmp_path / "resumed" / "ckpt" / f"iter_{middle:07d}")
    write_tracker(tmp_path / "resumed" / "ckpt", middle)
    resumed = train_grpo(config_from_dict(_run_config(tmp_path, policy, "resumed")))

    def comparable(metrics: list[dict[str, float]]) -> list[dict[str, float]]:
        return [{k: v for k, v in m.items() if not k.endswith(("_s", "tokens_per_s"))} for m in metrics]

    assert [m["step"] for m in resumed.metrics] == list(range(middle + 1, STEPS + 1))
    assert comparable(resumed.metrics) == comparable(run.metrics[middle:])
    assert len({m["grad_norm"] for m in run.metrics}) == STEPS
    ours = load_file(tmp_path / "resumed" / "logs" / ADAPTER_DIR / "adapter_model.safetensors")
    theirs = load_file(root / "straight" / "logs" / ADAPTER_DIR / "adapter_model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)

    _check_exports(checkpoints, root / "straight" / "logs" / ADAPTER_DIR, policy, tmp_path)
    _check_refusals(checkpoints, policy, tmp_path)


def _check_exports(checkpoints: Path, live: Path, policy: Path, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from hf_mcore_bridge.cli.main import app

    adapter, merged = export_both(checkpoints, tmp_path)
    assert all("fsdp2" in (out / "README.md").read_text() for out in (adapter, merged))
    check_lora_exports(adapter, merged, live, policy)
    written = load_file(merged / "model.safetensors")
    changed = {k for k in written if not torch.equal(written[k], load_file(policy / "model.safetensors")[k])}
    assert changed == {k for k in written if k.rsplit(".", 2)[-2] in PROJECTIONS}

    # a run whose policy.model_path was a megatron checkpoint: the merged export converts that base first
    from hf_mcore_bridge.convert.to_mcore import convert_hf_to_mcore

    convert_hf_to_mcore(policy, tmp_path / "mcore_base", show_progress=False)
    moved = tmp_path / "from_mcore"
    shutil.copytree(checkpoints, moved)
    adapter_config = moved / f"iter_{STEPS:07d}" / "adapter" / "adapter_config.json"
    saved = json.loads(adapter_config.read_text())
    adapter_config.write_text(json.dumps(saved | {"base_model_name_or_path": str(tmp_path / "mcore_base")}))
    result = CliRunner().invoke(app, ["export", str(moved), str(tmp_path / "merged_mcore")])
    assert result.exit_code == 0, result.output
    again = load_file(tmp_path / "merged_mcore" / "model.safetensors")
    assert again.keys() == written.keys() and all(torch.equal(again[k], written[k]) for k in written)


def _check_refusals(checkpoints: Path, policy: Path, tmp_path: Path) -> None:
    """A resume with another `policy.lora` or without adapters, `bridge convert --to hf` of the checkpoint and the
    merged export of a checkpoint whose base is gone: one line each; `bridge inspect` lists the adapters."""
    import dataclasses
    import re

    from cli_errors import assert_one_line_error
    from typer.testing import CliRunner

    from hf_mcore_bridge.cli.main import app
    from hf_mcore_bridge.grpo.errors import GRPOConfigError
    from hf_mcore_bridge.grpo.run.config import config_from_dict
    from hf_mcore_bridge.grpo.run.launch import check_resumable

    config = config_from_dict(_run_config(checkpoints.parent.parent, policy, "straight"))
    check_resumable(config, STEPS)
    lora = config.policy.lora
    for changed, message in (
        (dataclasses.replace(lora, rank=8), "holds LoRA rank 4, alpha 8, target_modules"),
        (dataclasses.replace(lora, enabled=False), "asks for no LoRA adapters (full training)"),
    ):
        other = dataclasses.replace(config, policy=dataclasses.replace(config.policy, lora=changed))
        with pytest.raises(GRPOConfigError, match=re.escape(message)):
            check_resumable(other, STEPS)

    result = CliRunner().invoke(
        app, ["convert", "--to", "hf", str(checkpoints), str(tmp_path / "base"), "--no-progress"]
    )
    assert_one_line_error(result, "is a DTensor LoRA run's checkpoint", "bridge export")
    assert not (tmp_path / "base").exists()
    report = json.loads(CliRunner().invoke(app, ["inspect", str(checkpoints), "--json"]).output)
    assert report["format"].startswith(f"DTensor GRPO LoRA checkpoint (step {STEPS})")
    held = load_file(checkpoints / f"iter_{STEPS:07d}" / "adapter" / "adapter_model.safetensors")
    assert {row["name"] for row in report["tensors"]} == set(held)

    moved = tmp_path / "moved"
    shutil.copytree(checkpoints, moved)
    adapter_config = moved / f"iter_{STEPS:07d}" / "adapter" / "adapter_config.json"
    saved = json.loads(adapter_config.read_text())
    adapter_config.write_text(json.dumps(saved | {"base_model_name_or_path": str(tmp_path / "gone")}))
    result = CliRunner().invoke(app, ["export", str(moved), str(tmp_path / "no-base")])
    assert_one_line_error(result, "base weights are not stored with them", str(tmp_path / "gone"), "--peft")
    assert not (tmp_path / "no-base").exists()


EXPERT_STEPS = 3


def test_expert_lora_run_keeps_engine_and_trainer_in_agreement_and_exports(tmp_path: Path) -> None:
    """Expert adapters (PEFT's `target_parameters`) on a Qwen3-MoE, three GRPO steps at dp_shard=2 with a
    checkpoint after the last: every step's log-probs agree with the engine's (it holds the merged experts under
    their per-expert names), every refit after the initial one streams the adapted tensors alone (the attention
    projections and every expert of the routed layer); `bridge export` of the checkpoint, `--peft` and merged,
    against PEFT (`check_lora_exports`)."""

    from hf_mcore_bridge.grpo.run.config import config_from_dict
    from hf_mcore_bridge.grpo.run.trainer import ADAPTER_DIR, train_grpo

    policy = build_tiny_policy(tmp_path / "policy", seed=2, **MOE)
    targets = list(EXPERT_LORA.target_modules)
    config = _run_config(tmp_path, policy, "experts", dropout=0.0, target_modules=targets)
    config["grpo"]["max_num_steps"] = EXPERT_STEPS
    config["checkpointing"]["save_period"] = EXPERT_STEPS
    run = train_grpo(config_from_dict(config))
    assert run.steps == EXPERT_STEPS
    for step in run.metrics:
        assert step["token_mult_prob_error"] <= EXACT, step["step"]
        assert step["probe_token_mult_prob_error"] <= EXACT, step["step"]
    assert any(step["grad_norm"] > 0 for step in run.metrics)
    weights = load_file(policy / "model.safetensors")
    adapted = {n: t for n, t in weights.items() if _adapted(n, EXPERT_LORA)}
    assert len([n for n in adapted if EXPERT_WEIGHT.fullmatch(n)]) == 3 * 8
    assert run.series("refit_bytes") == [sum(t.numel() * t.element_size() for t in adapted.values())] * EXPERT_STEPS

    checkpoints = tmp_path / "experts" / "ckpt"
    adapter, merged = export_both(checkpoints, tmp_path)
    check_lora_exports(adapter, merged, tmp_path / "experts" / "logs" / ADAPTER_DIR, policy)
    written = load_file(merged / "model.safetensors")
    changed = {k for k in written if not torch.equal(written[k], weights[k])}
    assert changed <= set(adapted) and {n for n in changed if EXPERT_WEIGHT.fullmatch(n)}


def test_lora_run_at_tp2_keeps_engine_and_trainer_in_agreement_and_exports(tmp_path: Path) -> None:
    """LoRA on every dense projection at tensor_parallel_size 2 (dp_shard 1), two GRPO steps with a checkpoint after
    the last: the engine's log-probs agree with the trainer's at every step (the merged weights gathered over TP),
    the later refits stream the adapted projections alone, and `bridge export` of the checkpoint (`--peft` and
    merged) is checked against PEFT (`check_lora_exports`)."""

    from hf_mcore_bridge.grpo.run.config import config_from_dict
    from hf_mcore_bridge.grpo.run.trainer import ADAPTER_DIR, train_grpo

    policy = build_tiny_policy(tmp_path / "policy")
    config = _run_config(tmp_path, policy, "tp2", dropout=0.0)
    config["policy"]["dtensor_cfg"] |= {"tensor_parallel_size": 2, "data_parallel_shard_size": 1}
    config["cluster"] = {"gpus_per_node": 2}
    config["grpo"]["max_num_steps"] = 2
    run = train_grpo(config_from_dict(config))
    assert run.steps == 2
    for step in run.metrics:
        assert step["token_mult_prob_error"] <= EXACT, step["step"]
        assert step["probe_token_mult_prob_error"] <= EXACT, step["step"]
        assert step["grad_norm"] > 0
    weights = load_file(policy / "model.safetensors")
    adapted = sum(t.numel() * t.element_size() for n, t in weights.items() if _adapted(n, LORA))
    assert run.series("refit_bytes") == [adapted] * 2

    checkpoints = tmp_path / "tp2" / "ckpt"
    adapter, merged = export_both(checkpoints, tmp_path)
    check_lora_exports(adapter, merged, tmp_path / "tp2" / "logs" / ADAPTER_DIR, policy)
