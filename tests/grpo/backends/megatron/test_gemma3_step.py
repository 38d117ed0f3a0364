"""GRPO step one of a Gemma 3 policy (a sliding and a full layer with their own RoPE bases, four `(1 + weight)` norms
per layer, q/k norms, GeGLU, scaled tied embeddings) on the megatron-core trainer (no rollout engine: it does not
run Gemma 3 yet), against `offpolicy_reference.first_update`: HF transformers + autograd from the same initial
weights on the same rollouts, whose completions are longer than the window (3).

At TP2 with sequence parallelism, padded and packed rows (one world), and at PP2: every completion token's log-prob,
the loss, the gradient norm and every parameter's gradient as the optimizer receives it, under its HF name. Under
sequence parallelism each TP rank holds a slice of the sequence, so the gradients of the norms' weights (the
post-norms included) are partial sums that megatron-core adds up only for parameters marked `sequence_parallel`:
without the mark they are off by about half."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hf_mcore_bridge.grpo.algorithm.batching import Rollout
from hf_mcore_bridge.grpo.run.config import GRPOConfig, config_from_dict
from hf_mcore_bridge.grpo.run.ranks import start_world
from hf_mcore_bridge.grpo.run.trainer import prepare_run

from ...offpolicy_reference import ReferenceSettings, advantages_of, first_update
from ...tiny_policy import WORDS, build_tiny_policy
from .engineless_ranks import logprobs_and_gradients_rank

pytestmark = pytest.mark.slow

GROUP = 4
LAYOUTS = {
    "tp2sp": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
    "pp2": {"pipeline_model_parallel_size": 2},
}


def _rows() -> list[dict]:
    """8 rollouts (2 groups of 4) of random tokens, completions of 4 to 6 tokens after prompts of 3 to 5."""
    generator = torch.Generator().manual_seed(7)
    rows = []
    for i in range(8):
        prompt = torch.randint(1, len(WORDS), (3 + i % 3,), generator=generator).tolist()
        completion = torch.randint(1, len(WORDS), (4 + i % 3,), generator=generator).tolist()
        rows.append({"prompt_ids": prompt, "completion_ids": completion, "reward": float(i % 3 == 0)})
        rows[-1]["engine_logprobs"] = [-1.0] * len(completion)
    return rows


def _config(policy: Path, root: Path, layout: dict, packing: bool) -> GRPOConfig:
    (root / "prompts.jsonl").write_text(json.dumps({"prompt": "Say 1", "answer": "1"}))
    megatron = {**layout, "micro_batch_size": 4, "optimizer": {"lr": 1e-2}, "sequence_packing": packing}
    if packing:
        megatron["max_tokens_per_microbatch"] = 24
    return config_from_dict(
        {
            "policy": {"model_path": str(policy), "megatron_cfg": megatron},
            "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": GROUP, "max_num_steps": 1},
            "loss_fn": {"kl_coef": 0.0},
            "generation": {"max_new_tokens": 6, "stop_token_ids": [0], "max_model_len": 64},
            "data": {"train_jsonl": str(root / "prompts.jsonl")},
            "logger": {"log_dir": str(root / "run"), "print_progress": False},
        }
    )


def _rollouts(rows: list[dict]) -> list[Rollout]:
    advantages = advantages_of([r["reward"] for r in rows], GROUP)
    fields = ("prompt_ids", "completion_ids", "engine_logprobs")
    return [Rollout(*(tuple(r[f]) for f in fields), r["reward"], a) for r, a in zip(rows, advantages, strict=True)]


@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_gemma3_first_step_matches_hf_reference(layout_name: str, tmp_path: Path) -> None:
    policy = build_tiny_policy(
        tmp_path / "policy",
        seed=3,
        architecture="Gemma3ForCausalLM",
        sliding_window=3,
        layer_types=["sliding_attention", "full_attention"],
    )
    rows = _rows()
    packings = (False, True) if layout_name == "tp2sp" else (False,)
    configs = [_config(policy, tmp_path, LAYOUTS[layout_name], packing) for packing in packings]
    prepared = prepare_run(configs[0])
    start_world(prepared.plan.dims, logprobs_and_gradients_rank, configs, prepared, _rollouts(rows), str(tmp_path))
    settings = ReferenceSettings(group=GROUP, minibatches=1, temperature=1.0, lr=0.0, momentum=0.0, clip_grad=1.0,
                                 kl_coef=0.0)  # fmt: skip
    logprobs, loss, grads = first_update(policy, rows, settings)
    assert loss != 0.0 and all(g.abs().max() > 0 for g in grads.values())
    grad_norm = float(torch.sqrt(sum(g.double().pow(2).sum() for g in grads.values())))
    by_tokens = {tuple(r["prompt_ids"] + r["completion_ids"]): lp for r, lp in zip(rows, logprobs, strict=True)}
    first, last = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))  # last: a pp2 stage
    for packing, got, end in zip(packings, first, last, strict=True):
        where = (layout_name, "packed" if packing else "padded")
        values = {tuple(tokens): lp for tokens, lp in (got["logprobs"] or end["logprobs"])}
        assert sorted(values) == sorted(by_tokens), where
        for tokens, want in by_tokens.items():
            assert (values[tokens] - want).abs().max() <= 1e-5, (*where, tokens)
        assert got["metrics"]["loss"] == pytest.approx(loss, rel=1e-5, abs=1e-7), where
        assert got["metrics"]["grad_norm"] == pytest.approx(grad_norm, rel=1e-5), where
        assert got["grads"].keys() == grads.keys(), where
        for name, want in grads.items():
            error = (got["grads"][name] - want).abs().max()
            assert error <= 1e-5 * want.abs().max(), (*where, name, float(error))
