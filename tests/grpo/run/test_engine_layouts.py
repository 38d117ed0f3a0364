"""GRPO runs with the engine's tensor parallelism equal to and different from the trainer's, fp32 on CPU.

- TP2 trainer + TP2 engine: the engine is sharded over megatron-core's own TP group and each rank refits its
  engine from its own shards (`refit_shard_local` = 1) with no all-gather but the two vocabulary tensors';
- TP2 trainer + TP1 engine: each rank an engine of its own, refit from full tensors (reshard: gathered over TP);
- PP2 trainer + TP2 engine: one engine over both pipeline ranks (a group made for it), refit from the stages'
  exchanged full tensors;
- TP2 x PP2 trainer + TP2 engine: an engine on each stage's TP group, each rank refit from its own shards and
  the other stage's parts for its TP rank (exchanged over the pipeline group);
- Qwen3-MoE at EP2: an engine on each rank, refit with every expert gathered over EP.

And, at TP2 for every dense architecture, the shard-local stream against the engine's own slices of the gathered
tensors and against the refit check's reference cut from them on the trainer's side (`refit.reference`).

Each run's refits pass the transfer check on every rank and the engine-vs-trainer log-prob gate at its fp32
default on every step (a run stops otherwise; that the checks fire is shown in `refit/test_refit_checks.py`, including
a bad copy on rank 1 of a TP2 engine). The three engines, refit by three different paths, must sample the same
first-step rollouts: the reference for each is the others, and the TP1 engine's are those of an engine loaded
from the HF file directly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_mcore_bridge.grpo.run.config import config_from_dict

from ..tiny_policy import WORDS, build_tiny_policy

pytestmark = pytest.mark.slow

STEPS = 2
EXACT = 1.0001
"""fp32 agreement bound of `token_mult_prob_error` (1 is exact)."""

LAYOUTS = {
    "tp2_engine_tp2": ({"tp": 2}, None),
    "tp2_engine_tp1": ({"tp": 2}, 1),
    "pp2_engine_tp2": ({"pp": 2}, 2),
    "tp2pp2_engine_tp2": ({"tp": 2, "pp": 2}, None),
}
"""name -> (trainer layout, generation.tensor_parallel_size; None: the trainer's TP). Ranks: TP x PP."""


def _config(root: Path, policy: Path, name: str, layout: dict[str, int], engine_tp: int | None):
    return config_from_dict(
        {
            "policy": {
                "model_path": str(policy),
                "megatron_cfg": {
                    "tensor_model_parallel_size": layout.get("tp", 1),
                    "pipeline_model_parallel_size": layout.get("pp", 1),
                    "expert_model_parallel_size": layout.get("ep", 1),
                    "micro_batch_size": 8,
                    "optimizer": {"lr": 1e-2},
                },
            },
            "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 4, "max_num_steps": STEPS},
            "reward": {"name": "grpo.refit.refit_ranks:varied_reward"},
            "generation": {
                "max_new_tokens": 3,
                "stop_token_ids": [WORDS.index("[EOS]")],
                "max_model_len": 64,
                "tensor_parallel_size": engine_tp,
            },
            "data": {"task": "repeat_digit"},
            "logger": {"log_dir": str(root / name), "print_progress": False},
            "cluster": {"gpus_per_node": layout.get("tp", 1) * layout.get("pp", 1) * layout.get("ep", 1)},
        }
    )


def _step1(log_dir: Path) -> list[tuple]:
    rows = [json.loads(line) for line in (log_dir / "rollouts.jsonl").read_text().splitlines()]
    return [(r["prompt_ids"], r["completion_ids"]) for r in rows if r["step"] == 1]


def test_engine_tp_equal_to_and_different_from_the_trainer(tmp_path: Path) -> None:
    import torch

    from hf_mcore_bridge.engine import Engine, EngineConfig
    from hf_mcore_bridge.grpo.run.trainer import _sampling_params, _seed, train_grpo

    policy = build_tiny_policy(tmp_path / "policy")
    configs = {name: _config(tmp_path, policy, name, *spec) for name, spec in LAYOUTS.items()}
    runs = {name: train_grpo(config) for name, config in configs.items()}
    for name, run in runs.items():
        assert run.steps == STEPS, name
        assert max(run.series("token_mult_prob_error")) <= EXACT, name
        assert max(run.series("probe_token_mult_prob_error")) <= EXACT, name
        assert all(n == 21 for n in run.series("refit_checked_tensors")), name  # rank 0's engine: every tensor

    local, tp1, pp2, stages = (runs[n].metrics for n in LAYOUTS)
    assert all(m["refit_shard_local"] == 1 and m["refit_gathers"] == 2 for m in local)  # embed_tokens, lm_head
    assert all(m["refit_shard_local"] == 0 and m["refit_gathers"] > 2 for m in tp1)
    assert all(m["refit_shard_local"] == 0 and m["refit_transfer_s"] > 0 for m in pp2)
    # each stage's TP group an engine: rank 0 gathers only embed_tokens, and receives the other stage's parts
    assert all(m["refit_shard_local"] == 1 and m["refit_gathers"] == 1 and m["refit_transfer_s"] > 0 for m in stages)
    assert [m["generation_replicas"] for m in (local[0], tp1[0], pp2[0], stages[0])] == [1, 2, 1, 2]

    # the same first-step samples from every engine, and from an engine loaded from the HF file itself
    first = {name: _step1(run.log_dir) for name, run in runs.items()}
    assert first["tp2_engine_tp2"] == first["tp2_engine_tp1"] == first["pp2_engine_tp2"] == first["tp2pp2_engine_tp2"]
    engine = Engine.from_pretrained(policy, EngineConfig(dtype=torch.float32, device="cpu", max_model_len=64))
    config = configs["tp2_engine_tp2"]
    prompts = [list(p) for p, _ in first["tp2_engine_tp2"][::4]]  # 4 samples a prompt, in prompt order
    outputs = engine.generate(prompts, _sampling_params(config, 4, _seed(config, 1)))
    assert [(p, s.token_ids) for p, out in zip(prompts, outputs, strict=True) for s in out.samples] == first[
        "tp2_engine_tp2"
    ]


def test_qwen3_moe_at_ep2_generates_on_both_replicas_with_every_refit_checked(tmp_path: Path) -> None:
    """Qwen3-MoE at EP2: two engine replicas (one a rank), each refit with every expert (gathered over EP), the
    transfer check on both ranks and the log-prob gate passing at every step."""
    from hf_mcore_bridge.grpo.run.trainer import train_grpo

    policy = build_tiny_policy(
        tmp_path / "policy", seed=2, architecture="Qwen3MoeForCausalLM", mlp_only_layers=[1], router_aux_loss_coef=0.0
    )
    run = train_grpo(_config(tmp_path, policy, "ep2", {"ep": 2}, None))
    assert run.steps == STEPS
    assert max(run.series("token_mult_prob_error")) <= EXACT
    assert max(run.series("probe_token_mult_prob_error")) <= EXACT
    assert all(m["generation_replicas"] == 2 and m["generation_replica1_s"] > 0 for m in run.metrics)
    assert all(m["refit_shard_local"] == 0 and m["refit_gathers"] > 0 for m in run.metrics)
    first = _step1(run.log_dir)
    assert len(first) == 8 and len({tuple(p) for p, _ in first}) == 2  # both prompts' groups, gathered in order


@pytest.mark.parametrize(
    "architecture, layout, engine_tp",
    [("Qwen3_5ForCausalLM", {"tp": 2}, None), ("Qwen3NextForCausalLM", {"ep": 2}, None)],
    ids=["qwen3_5-tp2-engine-tp2", "qwen3_next-ep2"],  # the refit from each rank's shards, and from gathered tensors
)
def test_gated_delta_net_models_train_with_every_refit_checked(
    architecture: str, layout: dict[str, int], engine_tp: int | None, tmp_path: Path
) -> None:
    """Qwen3.5 at TP2 with the engine on the trainer's TP group (each rank refits its engine from its own shards,
    Gated DeltaNet's parts included), Qwen3-Next at EP2 (an engine a rank, refit from gathered tensors): the
    transfer check on every rank and the log-prob gate at its fp32 default at every step."""
    from hf_mcore_bridge.grpo.run.trainer import train_grpo

    policy = build_tiny_policy(
        tmp_path / "policy", seed=4, architecture=architecture, layer_types=["linear_attention", "full_attention"]
    )
    run = train_grpo(_config(tmp_path, policy, "run", layout, engine_tp))
    assert run.steps == STEPS
    assert max(run.series("token_mult_prob_error")) <= EXACT
    assert max(run.series("probe_token_mult_prob_error")) <= EXACT
    shard_local = layout.get("tp", 1) == 2 and engine_tp is None
    assert all(m["refit_shard_local"] == int(shard_local) for m in run.metrics)


ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def test_shard_local_stream_is_the_engines_part_of_the_gathered_tensors(tmp_path: Path) -> None:
    """Every dense architecture at TP2: each rank's shard-local stream equals the engine's own slice of the
    tensor the gathered stream gives (q/k/v by heads and query groups, Qwen2's biases, Qwen3's q/k norms,
    gate/up, rows), only the vocabulary tensors come whole, and an engine loaded from it holds those slices."""
    import torch

    from hf_mcore_bridge.convert.layout import Layout
    from hf_mcore_bridge.megatron.world import run_world

    from ..refit.refit_ranks import shard_local_rank

    dirs = [str(build_tiny_policy(tmp_path / arch, architecture=arch)) for arch in ARCHITECTURES]
    out = tmp_path / "result.pt"
    run_world(shard_local_rank, Layout(tp=2), dirs, str(out))
    results = torch.load(out)
    for arch in ARCHITECTURES:
        got = results[arch]
        assert got["same_names"] and got["equal"] == got["count"], (arch, got)
        # the refit check's reference (`refit.reference`) is megatron-core's own split of every sharded tensor, on
        # both ranks
        assert got["reference_equal"] == got["reference_count"] == 2 * (got["count"] - len(got["whole"])), (arch, got)
        vocab = {"model.embed_tokens.weight", "lm_head.weight"}
        assert got["whole"] == sorted(n for n in got["names"] if "norm" in n or n in vocab), arch
        assert got["engine_equal"] == got["engine_count"] == got["count"], (arch, got)
