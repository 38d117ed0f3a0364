"""The DTensor (FSDP2) training backend on CPU, in two-process gloo worlds, against independent references.

- Log-probs at dp_shard=2 and at tp=2 equal an unsharded transformers model's `log_softmax` (eager attention, each
  rollout run alone), for padded rows and for packed rows (positions restarting per rollout, no mask given).
- One `train_minibatch` (several micro-batches per rank, KL term, clipping active; padded rows at dp_shard=2, packed
  rows with activation checkpointing at tp=2) updates the weights exactly as a single process does with plain
  autograd over the whole mini-batch, `torch.optim.AdamW` and `torch.nn.utils.clip_grad_norm_`.
- A short GRPO run with `policy.dtensor_cfg.enabled: true` at dp_shard=2 (first-step invariants, refit checks,
  learning), `bridge export` of its checkpoint loaded by `AutoModelForCausalLM.from_pretrained`, and a resume from
  its middle checkpoint that repeats the run.
- A two-step GRPO run of a tiny Qwen3-MoE (full training): the routed experts streamed under the checkpoint's
  per-expert names, the engine in agreement, the export loading in transformers.
- Config validation of the backend switch.
"""

from __future__ import annotations

import itertools
import random
import re
from pathlib import Path

import pytest
import torch

from hf_mcore_bridge.grpo.algorithm.batching import MicroBatch, Rollout, make_microbatches, pack_microbatches
from hf_mcore_bridge.grpo.algorithm.losses import LossConfig, grpo_loss
from hf_mcore_bridge.grpo.backends.dtensor.config import DTensorConfig
from hf_mcore_bridge.megatron.world import run_torch_world

from ...tiny_policy import WORDS, build_tiny_policy
from .dtensor_ranks import logprobs_and_step_rank

pytestmark = pytest.mark.slow

TEMPERATURE = 0.7
MICRO_BATCH = 2
LR, WEIGHT_DECAY, CLIP = 1e-3, 0.1, 0.05
"""A first Adam step moves each weight by about `LR` whatever its gradient's size, so it turns the last bits of tiny
gradients into differences of up to `LR * 1e-3`: `LR` is kept small against the 1e-5 tolerance."""
LOSS = LossConfig(kl_coef=0.05)
LAYOUTS = {
    "dp_shard2": {"data_parallel_shard_size": 2},
    "tp2_packed_recompute_deferred": {
        "tensor_parallel_size": 2,
        "sequence_packing": True,
        "activation_checkpointing": True,
        "defer_gradient_sync": True,
    },
}
"""Two-rank worlds; the first reduce-scatters gradients after every micro-batch, the second once per mini-batch and
also trains on packed rows with activation checkpointing (its reference is the same: with token aggregation the
loss does not depend on how rollouts are grouped into micro-batches)."""


def _rollouts(count: int, seed: int) -> list[Rollout]:
    """Random prompts and completions of varying lengths over the tiny vocabulary, with made-up engine log-probs."""
    rng = random.Random(seed)
    vocab = len(WORDS)
    out = []
    for index in range(count):
        prompt = tuple(rng.randrange(vocab) for _ in range(rng.randint(2, 7)))
        completion = tuple(rng.randrange(vocab) for _ in range(rng.randint(1, 5)))
        engine = tuple(-rng.uniform(0.5, 4.0) for _ in completion)
        out.append(Rollout(prompt, completion, engine, reward=float(index % 2), advantage=rng.uniform(-1.5, 1.5)))
    return out


ROLLOUTS = _rollouts(8, seed=3)


def _hf_model(hf_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")


def _reference_logprobs(model: torch.nn.Module, batch: MicroBatch) -> torch.Tensor:
    """[B, S-1] log-probs with every rollout of a row (split where its positions restart) run alone."""
    out = torch.full(batch.mask.shape, float("nan"))
    for row in range(batch.num_rows):
        starts = [*(batch.position_ids[row] == 0).nonzero().flatten().tolist(), batch.seq_len]
        for start, stop in itertools.pairwise(starts):
            tokens = batch.tokens[row, start:stop][None]
            logits = model(input_ids=tokens).logits[0, :-1] / TEMPERATURE
            picked = torch.log_softmax(logits, dim=-1).gather(-1, tokens[0, 1:, None])[:, 0]
            out[row, start : stop - 1] = picked
    return out


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_policy(tmp_path_factory.mktemp("dtensor-policy") / "policy", seed=5)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def sharded(request: pytest.FixtureRequest, policy_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """What one two-rank world computed: log-probs, one training step's metrics and the updated full weights."""
    settings = DTensorConfig(enabled=True, lr=LR, weight_decay=WEIGHT_DECAY, clip_grad=CLIP, **LAYOUTS[request.param])
    out = tmp_path_factory.mktemp(request.param) / "out.pt"
    run_torch_world(
        logprobs_and_step_rank, 2, str(policy_dir), settings, ROLLOUTS, MICRO_BATCH, LOSS, TEMPERATURE, str(out)
    )
    return torch.load(out, weights_only=True)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_logprobs_equal_unsharded_transformers(sharded: dict, policy_dir: Path, layout: str) -> None:
    model = _hf_model(policy_dir).eval()
    batches = make_microbatches(ROLLOUTS, MICRO_BATCH) if layout == "padded" else pack_microbatches(ROLLOUTS, 64)
    assert len(batches) == len(sharded[layout])
    if layout == "packed":
        assert any((b.position_ids == 0).sum() > 1 for b in batches)  # some row really holds several rollouts
    with torch.no_grad():
        for batch, logprobs in zip(batches, sharded[layout], strict=True):
            valid = batch.mask.bool()
            reference = _reference_logprobs(model, batch)
            assert logprobs.shape == batch.mask.shape
            torch.testing.assert_close(logprobs[valid], reference[valid], atol=1e-5, rtol=0)


def _no_decay(name: str, param: torch.nn.Parameter) -> bool:
    return name.endswith(".bias") or param.dim() == 1


def test_one_training_step_equals_single_process_adamw(sharded: dict, policy_dir: Path) -> None:
    """Plain autograd over the whole mini-batch (one global token count), the clipped global norm, then AdamW with
    megatron-core's weight-decay grouping; every updated weight must agree."""
    model = _hf_model(policy_dir)
    reference = _hf_model(policy_dir).eval()
    named = list(model.named_parameters())
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for n, p in named if not _no_decay(n, p)], "weight_decay": WEIGHT_DECAY},
            {"params": [p for n, p in named if _no_decay(n, p)], "weight_decay": 0.0},
        ],
        lr=LR,
    )
    batches = make_microbatches(ROLLOUTS, MICRO_BATCH)
    count = sum(b.mask.sum() for b in batches)
    total = 0.0
    for batch in batches:
        logprobs = _reference_logprobs(model, batch).nan_to_num()
        with torch.no_grad():
            ref = _reference_logprobs(reference, batch).nan_to_num()
        loss, _ = grpo_loss(logprobs, ref, batch.advantages, batch.mask, count, LOSS, ref_logprobs=ref)
        loss.backward()
        total += float(loss.detach())
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    assert float(norm) > CLIP  # the clipping path is exercised
    optimizer.step()

    metrics = sharded["metrics"]
    assert metrics["grad_norm"] == pytest.approx(float(norm), rel=1e-5)
    assert metrics["loss"] == pytest.approx(total, abs=1e-6)
    assert metrics["lr"] == LR
    weights = sharded["weights"]
    assert set(weights) == set(model.state_dict())  # untied model: every tensor once
    for name, value in model.state_dict().items():
        torch.testing.assert_close(weights[name], value, atol=1e-5, rtol=0, msg=name)
    moved = max((weights[n] - v).abs().max() for n, v in reference.state_dict().items())
    assert moved > 100 * 1e-5  # the step is far larger than the tolerance

    model.eval()
    with torch.no_grad():
        for index, batch in enumerate(batches):
            valid = batch.mask.bool()
            updated, initial = _reference_logprobs(model, batch), _reference_logprobs(reference, batch)
            after, reference_after = sharded["padded_after_step"][index], sharded["padded_reference_after_step"][index]
            torch.testing.assert_close(after[valid], updated[valid], atol=1e-5, rtol=0)
            torch.testing.assert_close(reference_after[valid], initial[valid], atol=1e-5, rtol=0)


# A short GRPO run ------------------------------------------------------------------------------------------------

STEPS = 8
EXACT = 1.0001
"""fp32 agreement bound for `token_mult_prob_error` (1 is exact)."""


def _grpo_config(root: Path, policy: Path, **overrides: object):
    import json

    from hf_mcore_bridge.grpo.run.config import config_from_dict

    prompts = root / "say7.jsonl"
    rows = [{"prompt": " ".join(["Say"] + ["7"] * k) + ". Answer:", "answer": "7"} for k in range(1, 7)]
    prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    data = {
        "policy": {
            "model_path": str(policy),
            "megatron_cfg": {"enabled": False},
            "dtensor_cfg": {
                "enabled": True,
                "data_parallel_shard_size": 2,
                "micro_batch_size": 16,
                "lr": 1e-2,
                "weight_decay": 0.01,
                "clip_grad": 1.0,
            },
        },
        "grpo": {"num_prompts_per_step": 8, "num_generations_per_prompt": 8, "max_num_steps": STEPS, "seed": 0},
        "loss_fn": {"kl_coef": 0.01},
        "generation": {"max_new_tokens": 3, "stop_token_ids": [WORDS.index("[EOS]")], "max_model_len": 64},
        "data": {"train_jsonl": str(prompts)},
        "reward": {"name": "number"},
        "checkpointing": {"enabled": True, "checkpoint_dir": str(root / "ckpt"), "save_period": STEPS // 2},
        "logger": {"log_dir": str(root / "logs"), "print_progress": False},
    }
    return config_from_dict(data, [f"{k}={v}" for k, v in overrides.items()])


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory: pytest.TempPathFactory):
    from hf_mcore_bridge.grpo.run.trainer import train_grpo

    root = tmp_path_factory.mktemp("dtensor-grpo")
    return train_grpo(_grpo_config(root, build_tiny_policy(root / "policy"))), root


def test_grpo_first_step_invariants_and_refit(grpo_run) -> None:
    run, _ = grpo_run
    first = run.metrics[0]
    assert first["token_mult_prob_error"] <= EXACT
    assert first["kl_ref"] == 0.0 and first["approx_kl"] == 0.0 and first["clip_fraction"] == 0.0
    for step in run.metrics:
        assert step["token_mult_prob_error"] <= EXACT, step["step"]  # the engine sampled with the trainer's weights
        assert step["probe_token_mult_prob_error"] <= EXACT, step["step"]  # after the refit
        assert step["refit_checked_tensors"] == 21  # all: embeddings, 9 a layer x 2, final norm, lm_head
    assert run.metrics[-1]["kl_ref"] > 1e-3


def test_grpo_learns(grpo_run) -> None:
    run, _ = grpo_run
    rewards = run.series("reward_mean")
    print(f"mean reward per step: {[round(r, 3) for r in rewards]}")
    assert run.steps == STEPS
    assert sum(rewards[-3:]) / 3 > 2 * sum(rewards[:3]) / 3, rewards


def test_bridge_export_of_the_run_loads_in_transformers(grpo_run, tmp_path: Path) -> None:
    """`bridge export` of the final checkpoint: transformers loads it, its weights are the trained ones (as the
    distributed checkpoint holds them, read back by the project's DCP reader), and it has learned the task."""
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM
    from typer.testing import CliRunner

    from hf_mcore_bridge.checkpoint.dcp_reader import DCPCheckpoint
    from hf_mcore_bridge.cli.main import app

    _, root = grpo_run
    out = tmp_path / "export"
    result = CliRunner().invoke(app, ["export", str(root / "ckpt"), str(out)])
    assert result.exit_code == 0, result.output
    assert "fsdp2" in (out / "README.md").read_text()
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    saved = DCPCheckpoint(root / "ckpt" / f"iter_{STEPS:07d}" / "model_optim")
    state = model.state_dict()
    assert {f"model.{name}" for name in state} <= set(saved.tensor_keys())
    for name, value in state.items():
        assert torch.equal(value, saved.read(f"model.{name}")), name
    initial = AutoModelForCausalLM.from_pretrained(root / "policy", dtype=torch.float32)
    assert not torch.equal(model.lm_head.weight, initial.lm_head.weight)
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    ids = torch.tensor([tokenizer.encode("Say 7 7. Answer:").ids])
    with torch.no_grad():
        assert int(model(ids).logits[0, -1].argmax()) == WORDS.index("7")


def test_resume_from_the_middle_checkpoint_repeats_the_run(grpo_run, tmp_path: Path) -> None:
    """Resumed from the step-4 checkpoint (model, optimizer, LR schedule, prompt order), steps 5-8 log exactly the
    metrics of the uninterrupted run."""
    import shutil

    from hf_mcore_bridge.checkpoint.megatron_dirs import write_tracker
    from hf_mcore_bridge.grpo.run.trainer import train_grpo

    run, root = grpo_run
    middle = STEPS // 2
    shutil.copytree(root / "ckpt" / f"iter_{middle:07d}", tmp_path / "ckpt" / f"iter_{middle:07d}")
    write_tracker(tmp_path / "ckpt", middle)
    resumed = train_grpo(_grpo_config(tmp_path, root / "policy"))

    def comparable(metrics: list[dict[str, float]]) -> list[dict[str, float]]:
        return [{k: v for k, v in m.items() if not k.endswith(("_s", "tokens_per_s"))} for m in metrics]

    assert [m["step"] for m in resumed.metrics] == list(range(middle + 1, STEPS + 1))
    assert comparable(resumed.metrics) == comparable(run.metrics[middle:])


# Config ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        ({"dtensor_cfg": {"enabled": True}}, "policy.dtensor_cfg.enabled=true needs policy.megatron_cfg.enabled=false"),
        ({"megatron_cfg": {"enabled": False}}, "no training backend"),
        (
            {"megatron_cfg": {"enabled": False}, "dtensor_cfg": {"enabled": True, "tensor_paralel_size": 2}},
            "did you mean 'policy.dtensor_cfg.tensor_parallel_size'",
        ),
    ],
)
def test_backend_switch_errors(tmp_path: Path, policy: dict, message: str) -> None:
    from hf_mcore_bridge.grpo.errors import GRPOConfigError
    from hf_mcore_bridge.grpo.run.config import config_from_dict

    data = {"policy": {"model_path": str(tmp_path), **policy}, "data": {"task": "repeat_digit"}}
    with pytest.raises(GRPOConfigError, match=re.escape(message)):
        config_from_dict(data)


def test_dtensor_world_follows_the_config(tmp_path: Path) -> None:
    from hf_mcore_bridge.grpo.errors import GRPOConfigError
    from hf_mcore_bridge.grpo.run.config import config_from_dict
    from hf_mcore_bridge.grpo.run.plan import parallel_dims

    base = {
        "policy": {"model_path": str(tmp_path), "megatron_cfg": {"enabled": False}, "dtensor_cfg": {"enabled": True}},
        "generation": {"stop_token_ids": [0]},  # the empty model directory declares no EOS
        "data": {"task": "repeat_digit"},
    }
    config = config_from_dict(base, ["policy.dtensor_cfg.tensor_parallel_size=2", "cluster.gpus_per_node=4"])
    dims = parallel_dims(config)
    assert (dims.world, dims.dp) == (4, 2)
    assert config.policy.backend_cfg is config.policy.dtensor_cfg
    with pytest.raises(GRPOConfigError, match=re.escape("must equal policy.dtensor_cfg.data_parallel_shard_size")):
        config_from_dict(base, ["policy.dtensor_cfg.data_parallel_shard_size=2", "cluster.gpus_per_node=4"])
    with pytest.raises(GRPOConfigError, match="lr_decay_style='WSD'"):
        config_from_dict(base, ["policy.dtensor_cfg.scheduler.lr_decay_style=WSD"])
    with pytest.raises(GRPOConfigError, match="fp16"):
        config_from_dict(base, ["policy.dtype=fp16"])


def test_dtensor_run_from_a_megatron_checkpoint_takes_the_tokenizer_of_its_assets(tmp_path: Path) -> None:
    """The tokenizer is found in the checkpoint's HF assets before the checkpoint is exported to HF; the export
    is the HF directory the backend starts from."""
    from hf_mcore_bridge.convert.to_mcore import convert_hf_to_mcore
    from hf_mcore_bridge.grpo.run.config import config_from_dict
    from hf_mcore_bridge.grpo.run.trainer import prepare_run

    policy = build_tiny_policy(tmp_path / "policy")
    convert_hf_to_mcore(policy, tmp_path / "mcore", show_progress=False)
    config = config_from_dict(
        {
            "policy": {
                "model_path": str(tmp_path / "mcore"),
                "megatron_cfg": {"enabled": False},
                "dtensor_cfg": {"enabled": True},
            },
            "data": {"task": "repeat_digit"},
            "logger": {"log_dir": str(tmp_path / "logs")},
        }
    )
    prepared = prepare_run(config)
    assert prepared.tokenizer_file == tmp_path / "mcore" / "hf_assets" / "tokenizer.json"
    assert prepared.tokenizer_file.read_bytes() == (policy / "tokenizer.json").read_bytes()
    assert prepared.checkpoint_dir == tmp_path / "logs" / "initial_policy_hf"
    assert (prepared.checkpoint_dir / "model.safetensors").exists()


def test_moe_grpo_run_streams_experts_under_the_checkpoint_names(tmp_path: Path) -> None:
    """Full training of a tiny Qwen3-MoE (layer 0 routed, 8 experts): two steps at dp_shard=2 with the engine's
    log-probs in agreement at every step; the refit streams the routed experts under the checkpoint's per-expert
    names (transformers 5 holds them fused), every tensor of the checkpoint exactly once; the step-2 checkpoint's
    `bridge export` loads in transformers with the trained weights (as the distributed checkpoint holds them)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from typer.testing import CliRunner

    from hf_mcore_bridge.checkpoint.dcp_reader import DCPCheckpoint
    from hf_mcore_bridge.cli.main import app
    from hf_mcore_bridge.grpo.run.trainer import train_grpo

    policy = build_tiny_policy(
        tmp_path / "policy", seed=2, architecture="Qwen3MoeForCausalLM", mlp_only_layers=[1], router_aux_loss_coef=0.0
    )
    config = _grpo_config(tmp_path, policy, **{"grpo.max_num_steps": 2, "checkpointing.save_period": 2})
    run = train_grpo(config)
    names = load_file(policy / "model.safetensors").keys()
    assert (
        sum(bool(re.fullmatch(r"model\.layers\.0\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight", n)) for n in names)
        == 24
    )
    for step in run.metrics:
        assert step["token_mult_prob_error"] <= EXACT, step["step"]
        assert step["probe_token_mult_prob_error"] <= EXACT, step["step"]
        assert step["refit_checked_tensors"] == len(names)
    out = tmp_path / "export"
    result = CliRunner().invoke(app, ["export", str(tmp_path / "ckpt"), str(out)])
    assert result.exit_code == 0, result.output
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    saved = DCPCheckpoint(tmp_path / "ckpt" / "iter_0000002" / "model_optim")
    state = model.state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    for name, value in state.items():
        assert torch.equal(value, saved.read(f"model.{name}")), name
    initial = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32).state_dict()
    assert not torch.equal(
        state["model.layers.0.mlp.experts.down_proj"], initial["model.layers.0.mlp.experts.down_proj"]
    )
