"""GRPO end to end on CPU: a tiny Llama at TP2 (two gloo ranks) learns "the answer is 7" with the embedded engine.

The task: prompts `Say 7 ... 7. Answer:` of varying length, reward 1 when the completion's first word is `7`.
A random policy over the 19-token vocabulary says it now and then (about 1 in 8 samples here), so rewards carry a
signal from the first step. The vocabulary pads to 256 at TP2, so the second TP rank's vocabulary slice is all
padding: trainer/engine agreement also checks that padding logits take no probability mass.

First-step invariants are checked against the embedded engine, an independent implementation of the forward
pass: the trainer's log-probs of the sampled tokens equal the engine's (`token_mult_prob_error`), and the first
update is on-policy (KL to the reference 0, no clipping). After every refit the engine and the trainer must agree
on a probe prompt, which fails if any tensor is streamed wrongly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_mcore_bridge.grpo.run.config import config_from_dict
from hf_mcore_bridge.grpo.run.trainer import train_grpo

from ..tiny_policy import WORDS, build_tiny_policy

pytestmark = pytest.mark.slow

STEPS = 20
EXACT = 1.0001
"""fp32 agreement bound for `token_mult_prob_error` (1 is exact)."""


def _prompts(path: Path) -> Path:
    rows = [{"prompt": " ".join(["Say"] + ["7"] * k) + ". Answer:", "answer": "7"} for k in range(1, 7)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("grpo-learning")
    config = config_from_dict(
        {
            "policy": {
                "model_path": str(build_tiny_policy(root / "policy")),
                "megatron_cfg": {
                    "tensor_model_parallel_size": 2,
                    "micro_batch_size": 16,
                    "optimizer": {"lr": 1e-2, "weight_decay": 0.01, "clip_grad": 1.0},
                },
            },
            "grpo": {"num_prompts_per_step": 8, "num_generations_per_prompt": 8, "max_num_steps": STEPS, "seed": 0},
            "loss_fn": {"kl_coef": 0.01},
            "generation": {
                "max_new_tokens": 3,
                "stop_token_ids": [WORDS.index("[EOS]")],
                "max_model_len": 64,
                # on a GPU: nothing compiled in the test's trainer processes (the compiled kernels have their own
                # GPU tests); on the CPU these are the defaults
                "decode_attention": "gather",
                "torch_compile": False,
            },
            "data": {"train_jsonl": str(_prompts(root / "say7.jsonl"))},
            "reward": {"name": "number"},
            "checkpointing": {"enabled": True, "checkpoint_dir": str(root / "ckpt"), "save_period": STEPS},
            "logger": {"log_dir": str(root / "logs"), "print_progress": False},
        }
    )
    return train_grpo(config), root


def test_learns(run) -> None:
    run, _ = run
    rewards = run.series("reward_mean")
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print(f"mean reward per step: {[round(r, 3) for r in rewards]}")
    assert run.steps == STEPS
    assert last >= 0.8, rewards
    assert last >= 3 * first, rewards


def test_first_step_invariants(run) -> None:
    run, _ = run
    step = run.metrics[0]
    assert step["token_mult_prob_error"] <= EXACT
    assert step["kl_ref"] == 0.0
    assert step["approx_kl"] == 0.0
    assert step["clip_fraction"] == 0.0


def test_every_step_on_policy_and_refit_consistent(run) -> None:
    run, _ = run
    for step in run.metrics:
        assert step["token_mult_prob_error"] <= EXACT, step["step"]  # engine sampled with the trainer's weights
        assert step["probe_token_mult_prob_error"] <= EXACT, step["step"]  # after the refit
        assert step["first_minibatch_clip_fraction"] == 0.0
        assert step["refit_checked_tensors"] == 21  # all: embeddings, 9 a layer x 2, final norm, lm_head
    assert run.metrics[-1]["kl_ref"] > 1e-3  # the policy moved away from the reference


def test_metrics_file_and_timings(run) -> None:
    run, _ = run
    lines = (run.log_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, STEPS + 1))
    for step in run.metrics:
        assert step["tokens_per_s"] > 0 and step["refit_s"] > 0 and step["generation_s"] > 0


def test_final_checkpoint_exports_to_hf_and_transformers_says_7(run, tmp_path: Path) -> None:
    """The trained policy, saved as a Megatron checkpoint and exported by the converter, runs in transformers
    (an implementation independent of trainer and engine) and has learned the task."""
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    from hf_mcore_bridge.convert.to_hf import convert_mcore_to_hf

    _, root = run
    exported = tmp_path / "hf"
    convert_mcore_to_hf(root / "ckpt", exported, show_progress=False)
    model = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    initial = AutoModelForCausalLM.from_pretrained(root / "policy", dtype=torch.float32)
    tokenizer = Tokenizer.from_file(str(exported / "tokenizer.json"))
    ids = torch.tensor([tokenizer.encode("Say 7 7. Answer:").ids])
    with torch.no_grad():
        assert int(model(ids).logits[0, -1].argmax()) == WORDS.index("7")
    assert not torch.equal(model.lm_head.weight, initial.lm_head.weight)


def test_bridge_export_writes_the_card_and_uploads(run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`bridge export`: the folder that would be uploaded, and the Hub calls made (the Hub is not reachable here)."""
    from types import SimpleNamespace

    from typer.testing import CliRunner

    from hf_mcore_bridge.cli.main import app

    _, root = run
    calls: list[tuple[str, dict]] = []

    class RecordingApi:
        def create_repo(self, **kwargs):
            calls.append(("create_repo", kwargs))

        def upload_folder(self, **kwargs):
            calls.append(("upload_folder", kwargs))
            return SimpleNamespace(commit_url="https://huggingface.co/org/tiny-grpo/commit/1")

    monkeypatch.setattr("huggingface_hub.HfApi", RecordingApi)
    out = tmp_path / "export"
    result = CliRunner().invoke(
        app,
        ["export", str(root / "ckpt"), str(out), "--push-to-hub", "org/tiny-grpo", "--private", "--base-model", "tiny"],
    )
    assert result.exit_code == 0, result.output
    card = (out / "README.md").read_text()
    assert "base_model: tiny" in card and f"| {STEPS} |" in card and f"max_num_steps: {STEPS}" in card
    assert (out / "training_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "config.json").exists() and any(out.glob("*.safetensors"))
    assert [name for name, _ in calls] == ["create_repo", "upload_folder"]
    assert calls[0][1]["repo_id"] == "org/tiny-grpo" and calls[0][1]["private"] is True
    assert calls[1][1]["folder_path"] == str(out)
    assert (run_dir_plot := root / "logs" / "training_curves.png").exists(), run_dir_plot
