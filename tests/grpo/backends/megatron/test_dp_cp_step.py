"""GRPO step one at DP2 x CP2 on the megatron-core trainer (no rollout engine), in the default test run, against
`offpolicy_reference.first_update`: HF transformers + autograd on the same rollouts from the same initial weights.

One 4-rank world (two data-parallel replicas of a 2-rank context-parallel group) checks, for padded and for packed
rows, every completion token's log-prob, the step's loss and gradient norm, and every parameter's gradient as the
optimizer receives it. What it guards against:
- the CP gather of per-token log-probs putting the ranks' chunks back in the wrong order (e.g. reversed): the
  log-probs of misplaced tokens, and with them the loss and gradients, differ from HF's;
- the loss normalised by a wrong token count under DP x CP (this rank's tokens only, or the DP group's count summed
  over the context-parallel ranks too, which hold the same tokens), or scaled for the wrong number of ranks, or
  gradients averaged over the data-parallel ranks only: the loss and gradients are off by a factor.
The full run through the engine at DP2 x CP2 (`test_layouts.py`, `extended`) checks the same loss and gradient norm
more slowly.
"""

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

GROUP, DP, CP = 4, 2, 2


def _rows() -> list[dict]:
    """8 rollouts (2 groups of 4) of random tokens, as the trainer logs them. Rollout i goes to data-parallel rank
    i % 2; those of rank 1 have the longer completions (22 tokens against 10), so a count of one rank's tokens is
    not half the global one."""
    generator = torch.Generator().manual_seed(5)
    rows = []
    for i in range(8):
        prompt = torch.randint(1, len(WORDS), (3 + i % 3,), generator=generator).tolist()
        completion = torch.randint(1, len(WORDS), (2 + 3 * (i % 2) + i // 4,), generator=generator).tolist()
        rows.append({"prompt_ids": prompt, "completion_ids": completion, "reward": float(i % 3 == 0)})
        rows[-1]["engine_logprobs"] = [-1.0] * len(completion)
    return rows


def _config(policy: Path, root: Path, packing: bool) -> GRPOConfig:
    (root / "prompts.jsonl").write_text(json.dumps({"prompt": "Say 1", "answer": "1"}))
    return config_from_dict(
        {
            "policy": {
                "model_path": str(policy),
                "megatron_cfg": {
                    "context_parallel_size": CP,
                    "micro_batch_size": 2,  # two micro-batches per data-parallel rank
                    "sequence_packing": packing,
                    "max_tokens_per_microbatch": 24,  # two packed rows per data-parallel rank
                    "optimizer": {"lr": 1e-2},
                },
            },
            "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": GROUP, "max_num_steps": 1},
            "loss_fn": {"kl_coef": 0.0},
            "generation": {"max_new_tokens": 6, "stop_token_ids": [0], "max_model_len": 64},
            "data": {"train_jsonl": str(root / "prompts.jsonl")},
            "logger": {"log_dir": str(root / "run"), "print_progress": False},
            "cluster": {"gpus_per_node": DP * CP},
        }
    )


def _rollouts(rows: list[dict]) -> list[Rollout]:
    advantages = advantages_of([r["reward"] for r in rows], GROUP)
    fields = ("prompt_ids", "completion_ids", "engine_logprobs")
    return [Rollout(*(tuple(r[f]) for f in fields), r["reward"], a) for r, a in zip(rows, advantages, strict=True)]


def test_dp2_cp2_step_matches_hf_reference(tmp_path: Path) -> None:
    """Guards against a reversed (or otherwise misordered) CP gather of log-probs and against a wrong loss
    normaliser or gradient averaging under DP x CP (see the module docstring): on every rank, each completion
    token's log-prob, the step's loss and gradient norm and every parameter's gradient equal HF + autograd's."""
    policy = build_tiny_policy(tmp_path / "policy", seed=4)
    rows = _rows()
    configs = {"padded": _config(policy, tmp_path, False), "packed": _config(policy, tmp_path, True)}
    prepared = prepare_run(configs["padded"])
    world_args = (list(configs.values()), prepared, _rollouts(rows), str(tmp_path))
    start_world(prepared.plan.dims, logprobs_and_gradients_rank, *world_args)

    settings = ReferenceSettings(group=GROUP, minibatches=1, temperature=1.0, lr=0.0, momentum=0.0, clip_grad=1.0,
                                 kl_coef=0.0)  # fmt: skip
    logprobs, loss, grads = first_update(policy, rows, settings)
    assert loss != 0.0 and all(g.abs().max() > 0 for g in grads.values())
    grad_norm = float(torch.sqrt(sum(g.double().pow(2).sum() for g in grads.values())))
    by_tokens = {tuple(r["prompt_ids"] + r["completion_ids"]): lp for r, lp in zip(rows, logprobs, strict=True)}
    assert len(by_tokens) == len(rows)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(DP * CP)]
    for i, layout in enumerate(configs):
        results = [r[i] for r in ranks]
        assert {(r["dp_rank"], r["cp_rank"]) for r in results} == {(d, c) for d in range(DP) for c in range(CP)}
        for rank, result in enumerate(results):
            where = (layout, f"rank {rank}")
            # this data-parallel rank's rollouts (every DP-th), the same on both of its context-parallel ranks
            mine = list(by_tokens)[result["dp_rank"] :: DP]
            got = {tuple(tokens): values for tokens, values in result["logprobs"]}
            assert sorted(got) == sorted(mine), where
            for tokens in mine:
                assert got[tokens].shape == by_tokens[tokens].shape, where
                assert (got[tokens] - by_tokens[tokens]).abs().max() <= 1e-5, (*where, tokens)
            assert result["metrics"]["loss"] == pytest.approx(loss, rel=1e-5, abs=1e-7), where
            assert result["metrics"]["grad_norm"] == pytest.approx(grad_norm, rel=1e-5), where
            assert result["grads"].keys() == grads.keys(), where
            for name, want in grads.items():
                error = (result["grads"][name] - want).abs().max()
                assert error <= 1e-5 * want.abs().max(), (*where, name, float(error))
