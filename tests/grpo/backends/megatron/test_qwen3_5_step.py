"""GRPO step one of a Qwen3.5 policy (a Gated DeltaNet layer and a gated full-attention layer, zero-centred norms,
partial rotary) on the megatron-core trainer at TP2, and of a Qwen3-Next policy (projections fused per key
head, routed experts, a gated shared expert) at EP2, against `offpolicy_reference.first_update`: HF
transformers + autograd from the same initial weights on the same rollouts (made here, without the engine): every
completion token's log-prob, the loss, the gradient norm and every parameter's gradient as the optimizer receives
it, under its HF name. Rows padded after each sequence and, at TP2 in the same world, packed (the convolution and
the recurrent state restart at every sequence boundary). At TP2 each rank normalises only its value heads in the
gated output norm, so that norm's gradient is a partial sum the trainer must add up over the TP group. What the
trainer does not compute for these layers (sequence and context parallelism) is refused naming the model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hf_mcore_bridge.errors import BridgeError
from hf_mcore_bridge.grpo.algorithm.batching import Rollout
from hf_mcore_bridge.grpo.run.config import GRPOConfig, config_from_dict
from hf_mcore_bridge.grpo.run.ranks import start_world
from hf_mcore_bridge.grpo.run.trainer import prepare_run

from ...offpolicy_reference import ReferenceSettings, advantages_of, first_update
from ...tiny_policy import WORDS, build_tiny_policy
from .engineless_ranks import logprobs_and_gradients_rank

GROUP = 4
LAYOUTS = {"tp2": {"tensor_model_parallel_size": 2}, "ep2": {"expert_model_parallel_size": 2}}
ARCHITECTURES = {"tp2": "Qwen3_5ForCausalLM", "ep2": "Qwen3NextForCausalLM"}
"""The dense Qwen3.5 at TP2; Qwen3-Next (projections fused per key head, routed experts and a gated shared expert)
at EP2. (Pipeline stages of these models: `tests/megatron/test_gated_delta_net.py`'s PP2 logits.)"""
LAYER_TYPES = ["linear_attention", "full_attention"]


def _policy(root: Path, architecture: str = "Qwen3_5ForCausalLM") -> Path:
    return build_tiny_policy(root / "policy", seed=5, architecture=architecture, layer_types=LAYER_TYPES)


def _rows() -> list[dict]:
    """8 rollouts (2 groups of 4) of random tokens, completions of 4 to 6 tokens after prompts of 3 to 5."""
    generator = torch.Generator().manual_seed(9)
    rows = []
    for i in range(8):
        prompt = torch.randint(1, len(WORDS), (3 + i % 3,), generator=generator).tolist()
        completion = torch.randint(1, len(WORDS), (4 + i % 3,), generator=generator).tolist()
        rows.append({"prompt_ids": prompt, "completion_ids": completion, "reward": float(i % 3 == 0)})
        rows[-1]["engine_logprobs"] = [-1.0] * len(completion)
    return rows


def _config(policy: Path, root: Path, megatron: dict, packing: bool = False) -> GRPOConfig:
    (root / "prompts.jsonl").write_text(json.dumps({"prompt": "Say 1", "answer": "1"}))
    if packing:
        megatron = {**megatron, "sequence_packing": True, "max_tokens_per_microbatch": 24}
    return config_from_dict(
        {
            "policy": {
                "model_path": str(policy),
                "megatron_cfg": {"micro_batch_size": 4, "optimizer": {"lr": 1e-2}, **megatron},
            },
            "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": GROUP, "max_num_steps": 1},
            "loss_fn": {"kl_coef": 0.0},
            "generation": {"max_new_tokens": 6, "stop_token_ids": [0], "max_model_len": 64},
            "data": {"train_jsonl": str(root / "prompts.jsonl")},
            "logger": {"log_dir": str(root / "run"), "print_progress": False},
        }
    )


def _per_expert(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5's fused experts (`mlp.experts.gate_up_proj` [E, 2F, H], each expert's gate rows then its up
    rows; `mlp.experts.down_proj` [E, H, F]) cut into the per-expert linear layers the checkpoints on the Hub hold
    (the names the trainer's gradients stream under)."""
    out = {}
    for name, grad in grads.items():
        prefix = name.removesuffix("gate_up_proj").removesuffix("down_proj")
        if not name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            out[name] = grad
        elif name.endswith("gate_up_proj"):
            for expert, (gate, up) in enumerate(g.chunk(2) for g in grad):
                out[f"{prefix}{expert}.gate_proj.weight"], out[f"{prefix}{expert}.up_proj.weight"] = gate, up
        else:
            for expert, down in enumerate(grad):
                out[f"{prefix}{expert}.down_proj.weight"] = down
    return out


def _rollouts(rows: list[dict]) -> list[Rollout]:
    advantages = advantages_of([r["reward"] for r in rows], GROUP)
    fields = ("prompt_ids", "completion_ids", "engine_logprobs")
    return [Rollout(*(tuple(r[f]) for f in fields), r["reward"], a) for r, a in zip(rows, advantages, strict=True)]


@pytest.mark.slow
@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_qwen3_5_first_step_matches_hf_reference(layout_name: str, tmp_path: Path) -> None:
    policy = _policy(tmp_path, ARCHITECTURES[layout_name])
    rows = _rows()
    packings = (False, True) if layout_name == "tp2" else (False,)
    configs = [_config(policy, tmp_path, LAYOUTS[layout_name], packing) for packing in packings]
    prepared = prepare_run(configs[0])
    start_world(prepared.plan.dims, logprobs_and_gradients_rank, configs, prepared, _rollouts(rows), str(tmp_path))
    settings = ReferenceSettings(group=GROUP, minibatches=1, temperature=1.0, lr=0.0, momentum=0.0, clip_grad=1.0,
                                 kl_coef=0.0)  # fmt: skip
    logprobs, loss, grads = first_update(policy, rows, settings)
    grads = _per_expert(grads)
    assert loss != 0.0 and all(g.abs().max() > 0 for g in grads.values())
    assert any(".linear_attn." in name for name in grads)  # both kinds of layer are trained
    grad_norm = float(torch.sqrt(sum(g.double().pow(2).sum() for g in grads.values())))
    by_tokens = {tuple(r["prompt_ids"] + r["completion_ids"]): lp for r, lp in zip(rows, logprobs, strict=True)}
    first, last = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    for packing, got, end in zip(packings, first, last, strict=True):
        where = (layout_name, "packed" if packing else "padded")
        # rank 1 is the last PP stage, the other TP rank, or (EP2: two data-parallel ranks) the other rows' rank
        values = {tuple(tokens): lp for tokens, lp in got["logprobs"] + end["logprobs"]}
        assert sorted(values) == sorted(by_tokens), where
        for tokens, want in by_tokens.items():
            assert (values[tokens] - want).abs().max() <= 1e-5, (*where, tokens)
        assert got["metrics"]["loss"] == pytest.approx(loss, rel=1e-5, abs=1e-7), where
        assert got["metrics"]["grad_norm"] == pytest.approx(grad_norm, rel=1e-5), where
        assert got["grads"].keys() == grads.keys(), where
        for name, want in grads.items():
            error = (got["grads"][name] - want).abs().max()
            # the floor: a few per-head parameters (dt_bias) have gradients near 1e-5, where float32 sums differ
            assert error <= 1e-5 * want.abs().max() + 1e-8, (*where, name, float(error))


@pytest.mark.parametrize(
    "megatron, start",
    [
        ({"tensor_model_parallel_size": 2, "sequence_parallel": True}, "policy.megatron_cfg.sequence_parallel: "),
        ({"context_parallel_size": 2}, "cp=2: "),
    ],
)
def test_what_gated_delta_net_layers_cannot_take_is_refused_by_name(megatron: dict, start: str, tmp_path: Path) -> None:
    """Sequence and context parallelism (a MoE hybrid therefore trains at TP 1: megatron-core takes experts under
    TP only with sequence parallelism, which the config's own checks require)."""
    architecture = "Qwen3_5ForCausalLM"
    config = _config(_policy(tmp_path, architecture), tmp_path, megatron)
    with pytest.raises(BridgeError) as caught:
        prepare_run(config)
    assert str(caught.value).startswith(f"{start}{architecture}'s Gated DeltaNet layers")
    assert "\n" not in str(caught.value)
