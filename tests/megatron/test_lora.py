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
ranks, equal on both), and the eval forward equals PEFT without dropout.
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
from hf_mcore_bridge.megatron.lora_config import PROJECTIONS, LoraConfig
from hf_mcore_bridge.megatron.world import run_world
from hf_mcore_bridge.models.mapping_types import FusedQKV

RANK, ALPHA = 4, 8.0
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
FAULTS = ("scale", "qkv_rows", "gate_up_rows")
DROPOUT = 0.3


def _peft(hf_dir, targets: tuple[str, ...], seed: int):
    """The PEFT model of `hf_dir` with random A and B; returns it and HF module name -> (A, B)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    config = PeftLoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=list(targets))
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
            values[name.removeprefix("base_model.model.")] = (module, a.clone(), b.clone())
    return peft_model, values


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


@pytest.mark.slow
def test_lora_at_tp2_equals_peft(tiny_models, tmp_path):
    tokens = torch.randint(0, 211, (2, 12), generator=torch.Generator().manual_seed(1))
    weights = torch.randn(2, 12, 211, generator=torch.Generator().manual_seed(2))
    torch.save(weights, tmp_path / "weights.pt")
    plans = {"llama": ("llama", PROJECTIONS), "qwen3": ("qwen3", ATTENTION)}
    plans.update({f"llama_{fault}": ("llama", PROJECTIONS) for fault in FAULTS})
    plans["llama_dropout"] = ("llama", PROJECTIONS)
    references, cases = {}, []
    for seed, (case, (model, targets)) in enumerate(plans.items()):
        peft_model, values = _peft(tiny_models[model], targets, seed)
        references[case] = _reference(peft_model, values, tokens, weights)
        torch.save({n: (a, b) for n, (_, a, b) in values.items()}, tmp_path / f"{case}.adapters.pt")
        fault = case.removeprefix("llama_") if case.startswith("llama_") and case != "llama_dropout" else None
        cases.append(
            LoraCase(
                case,
                str(tiny_models[model]),
                str(tmp_path / f"{case}.adapters.pt"),
                RANK,
                ALPHA,
                targets,
                fault,
                optimizer=case == "llama",
                merged=case == "llama",
                dropout=DROPOUT if case == "llama_dropout" else 0.0,
            )
        )
        if case == "llama_dropout":
            references[case] = peft_model, values
    run_world(lora_rank, Layout(tp=2), cases, tokens, str(tmp_path / "weights.pt"), str(tmp_path))

    for case in ("llama", "qwen3"):
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
    _check_peft_directory(tmp_path, tiny_models["llama"], tokens)

    for fault in FAULTS:
        got = torch.load(tmp_path / f"llama_{fault}.pt")
        assert (got["logits"] - references[f"llama_{fault}"][0]).abs().max() > 1e-2, fault

    _check_dropout(tmp_path, *references["llama_dropout"], tokens, weights)


class _Masked(torch.nn.Module):
    """PEFT's `lora_dropout` with given masks ([batch, seq, width], one per forward): x * mask / (1 - p)."""

    def __init__(self, masks: list[torch.Tensor], p: float) -> None:
        super().__init__()
        self.masks, self.p = list(masks), p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.masks.pop(0) / (1 - self.p)


def _check_dropout(tmp_path, peft_model, values, tokens, weights) -> None:
    """Adapter dropout at TP2: the training forward's logits and every adapter gradient equal PEFT's with the same
    masks in its `lora_dropout` (each projection its own mask, drawn alike on both ranks, about p of them zeros);
    the eval forward drops nothing (PEFT without dropout); the dropped logits are not the undropped ones."""
    got = torch.load(tmp_path / "llama_dropout.pt")
    masks, other = (torch.load(tmp_path / f"llama_dropout.masks.{r}.pt") for r in (0, 1))
    assert sorted(masks) == sorted(values) and all(len(m) == 1 for m in masks.values())
    assert all(torch.equal(masks[n][0], other[n][0]) for n in masks)  # one mask of the whole input on every rank
    assert not torch.equal(masks["model.layers.0.self_attn.q_proj"][0], masks["model.layers.0.self_attn.k_proj"][0])
    zeros = torch.cat([m[0].flatten() for m in masks.values()]).eq(0).float().mean()
    assert abs(float(zeros) - DROPOUT) < 0.02, float(zeros)

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
    """Attention adapters on tiny MoE models at EP2 (experts split over the two ranks, adapters whole on each):
    Qwen3-MoE (a heterogeneous stack, layer 1 dense) and Mixtral. Logits and every A and B gradient against PEFT as
    at TP2; the factors' gradients equal on both ranks (both ran the same tokens); only adapters trainable."""
    vocab = 211
    tokens = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(3))
    weights = torch.randn(2, 12, vocab, generator=torch.Generator().manual_seed(4))
    torch.save(weights, tmp_path / "weights.pt")
    references, cases = {}, []
    for seed, model in enumerate(("qwen3_moe", "mixtral")):
        peft_model, values = _peft(tiny_moe_models[model], ATTENTION, seed)
        references[model] = _reference(peft_model, values, tokens, weights)
        torch.save({n: (a, b) for n, (_, a, b) in values.items()}, tmp_path / f"{model}.adapters.pt")
        cases.append(
            LoraCase(model, str(tiny_moe_models[model]), str(tmp_path / f"{model}.adapters.pt"), RANK, ALPHA, ATTENTION)
        )
    run_world(lora_rank, Layout(ep=2), cases, tokens, str(tmp_path / "weights.pt"), str(tmp_path))

    for model in ("qwen3_moe", "mixtral"):
        logits, grads = references[model]
        got = torch.load(tmp_path / f"{model}.pt")
        assert (got["logits"] - logits).abs().max() <= 1e-4, model
        layers = read_json(tiny_moe_models[model] / "config.json")["num_hidden_layers"]
        assert sorted(got["grads"]) == sorted(grads) and len(grads) == 4 * layers  # q, k, v, o of every layer
        for name, (grad_a, grad_b) in grads.items():
            mine_a, mine_b = got["grads"][name]
            assert grad_a.abs().max() > 0 and grad_b.abs().max() > 0, name
            assert _relative(mine_a, grad_a) <= 1e-4, (model, name, "A", _relative(mine_a, grad_a))
            assert _relative(mine_b, grad_b) <= 1e-4, (model, name, "B", _relative(mine_b, grad_b))
        assert got["trainable"] and all(".lora.lora_" in n for n in got["trainable"]), got["trainable"]
        rank0, rank1 = (torch.load(tmp_path / f"{model}.replicated.{r}.pt") for r in (0, 1))
        assert all(torch.equal(rank0[n], rank1[n]) for n in rank0), model


def _check_merged(got: dict, hf_dir) -> None:
    """The stream of the merged model equals PEFT's `merge_and_unload` of the same adapters, name for name; the
    targeted weights moved away from the base (so the comparison could fail), and the model was restored."""
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


def _check_peft_directory(tmp_path, hf_dir, tokens) -> None:
    """The adapters written as a PEFT directory load with `PeftModel.from_pretrained` onto the base model and give
    the megatron-core model's logits; read back, they are the adapters set, bit for bit."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hf_mcore_bridge.megatron.lora_peft import read_peft_adapter

    directory = tmp_path / "llama.peft"
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32), directory)
    with torch.no_grad():
        logits = model(tokens).logits
    assert (logits - torch.load(tmp_path / "llama.pt")["logits"]).abs().max() <= 1e-4
    lora, values = read_peft_adapter(directory)
    assert (lora.rank, lora.alpha, lora.target_modules) == (RANK, ALPHA, tuple(sorted(PROJECTIONS)))
    written = torch.load(tmp_path / "llama.adapters.pt")
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
        (LoraConfig(enabled=True, dropout=0.1), "dropout 0.1: only 0 is implemented"),
        (LoraConfig(enabled=True, target_modules=("q_proj",)), "target all of ['q_proj', 'k_proj', 'v_proj']"),
        (LoraConfig(enabled=True, target_modules=("up_proj",)), "target all of ['gate_proj', 'up_proj']"),
    ],
)
def test_unimplemented_adapters_are_refused_by_name(config, message, tiny_models):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        add_lora(torch.nn.Linear(1, 1), _spec(tiny_models["llama"]), config)


def test_adapters_on_experts_are_refused(tiny_moe_models):
    config = LoraConfig(enabled=True, target_modules=("gate_proj", "up_proj", "down_proj"))
    with pytest.raises(ValueError, match="adapters on experts are not implemented"):
        add_lora(torch.nn.Linear(1, 1), _spec(tiny_moe_models["qwen3_moe"]), config)


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
