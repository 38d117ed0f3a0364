"""One GRPO step on each training backend with a chat-template policy: what a new user's math run goes through.

A tiny ChatML tokenizer and Llama built in code; prompts from a GSM8K-format Parquet file through the `gsm8k`
processor, a prompt template and a system prompt; the `math` reward (math-verify) in a worker process; validation
with two samples a prompt; an MLflow file store. Checked against values written here: the prompt ids the engine
generated from and the trainer trained on (hand-made from the vocabulary), the stop tokens (EOS plus the
template's `<|im_end|>`), engine/trainer agreement on those ids, pass@k keys, the sample table and the MLflow run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from hf_mcore_bridge.grpo.run.config import config_from_dict
from hf_mcore_bridge.grpo.run.trainer import train_grpo

from ..tiny_chat import IM_END, IM_START, build_chat_policy, ids

pytestmark = pytest.mark.slow

BACKENDS = {
    "megatron": {},
    "dtensor": {"megatron_cfg": {"enabled": False}, "dtensor_cfg": {"enabled": True, "data_parallel_shard_size": 1}},
}
QUESTIONS = ["Say 7", "Say 3 3"]


def _parquet(path: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"question": q, "answer": f"Say {q[-1]} .\n#### {q[-1]}"} for q in QUESTIONS]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.mark.parametrize(
    "backend", [pytest.param(b, marks=pytest.mark.extended) if b == "dtensor" else b for b in sorted(BACKENDS)]
)
def test_one_chat_step(backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("pyarrow")
    pytest.importorskip("mlflow")
    data = _parquet(tmp_path / "gsm8k.parquet")
    config = config_from_dict(
        {
            "policy": {"model_path": str(build_chat_policy(tmp_path / "policy")), **BACKENDS[backend]},
            "grpo": {
                "num_prompts_per_step": 2,
                "num_generations_per_prompt": 2,
                "max_num_steps": 1,
                "val_period": 1,
                "val_num_prompts": 2,
                "val_num_generations": 2,
            },
            "generation": {
                "max_new_tokens": 3,
                "max_model_len": 64,
                "decode_attention": "gather",
                "torch_compile": False,
            },
            "data": {
                "train_jsonl": str(data),
                "processor": "gsm8k",
                "shuffle": False,
                "system_prompt": "Repeat the digit",
                "prompt_template": "{question} Answer :",
            },
            "reward": {"name": "math", "num_workers": 1},
            "logger": {
                "log_dir": str(tmp_path / "logs"),
                "print_progress": False,
                "mlflow_enabled": True,
                "mlflow": {"experiment_name": "chat", "run_name": backend},
                "num_val_samples_to_print": 1,
            },
        }
    )
    result = train_grpo(config)
    logs = tmp_path / "logs"

    expected = [
        ids(IM_START, "system", "Repeat", "the", "digit", IM_END, IM_START, "user", *q.split(), "Answer", ":", IM_END)
        + ids(IM_START, "assistant")
        for q in QUESTIONS
    ]
    rollouts = [json.loads(line) for line in (logs / "rollouts.jsonl").read_text().splitlines()]
    assert [r["prompt_ids"] for r in rollouts] == [expected[0]] * 2 + [expected[1]] * 2
    saved = yaml.safe_load((logs / "grpo_config.yaml").read_text())
    assert saved["generation"]["stop_token_ids"] == [0, *ids(IM_END)]
    (step,) = result.metrics
    assert step["token_mult_prob_error"] <= 1.0001  # the trainer scored the engine's ids with the engine's weights
    assert {"val_reward", "val_pass_at_1", "val_pass_at_2", "reward_timeouts"} <= set(step)
    assert 0.0 <= step["val_pass_at_1"] <= step["val_pass_at_2"] <= 1.0
    (sample,) = [json.loads(line) for line in (logs / "val_samples.jsonl").read_text().splitlines()]
    assert sample["answer"] == "7" and sample["prompt"].startswith(f"{IM_START}system\nRepeat the digit{IM_END}")
    import mlflow

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads its file store only with this set
    client = mlflow.MlflowClient((logs / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("chat").experiment_id])
    assert run.info.run_name == backend
    assert run.data.metrics["val_pass_at_2"] == step["val_pass_at_2"]
    assert run.data.params["data.processor"] == "gsm8k"
