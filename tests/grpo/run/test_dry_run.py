"""`bridge train grpo --dry-run`: validates, prints the first prompts as the engine will see them, writes nothing."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from typer.testing import CliRunner

from hf_mcore_bridge.cli.main import app

from ..tiny_chat import IM_END, IM_START, build_chat_policy, ids

runner = CliRunner()


def _config(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "run.yaml"
    config = {
        "policy": {"model_path": str(build_chat_policy(tmp_path / "policy"))},
        "data": data,
        "logger": {"log_dir": str(tmp_path / "logs")},
    }
    path.write_text(yaml.safe_dump(config))
    return path


def test_dry_run_prints_rendered_prompts(tmp_path: Path) -> None:
    rows = [{"question": "Say 7", "answer": "so 7\n#### 7"}, {"question": "Say 3", "answer": "#### 3"}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = {"train_jsonl": str(tmp_path / "d.jsonl"), "processor": "gsm8k", "shuffle": False}
    result = runner.invoke(app, ["train", "grpo", "--config", str(_config(tmp_path, data)), "--dry-run"])
    assert result.exit_code == 0, result.output
    expected = ids(IM_START, "user", "Say", "7", IM_END, IM_START, "assistant")
    assert "config OK: 2 training prompts, 2 validation; chat template on" in result.output
    assert f"stop tokens: 0 '[EOS]', {ids(IM_END)[0]} '{IM_END}'" in result.output
    assert f"--- prompt 1: {len(expected)} tokens, answer '7'" in result.output
    assert f"{IM_START}user\nSay 7{IM_END}\n{IM_START}assistant\n" in result.output
    assert not (tmp_path / "logs").exists()


def test_dry_run_bad_data_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "d.jsonl").write_text(json.dumps({"question": "Say 7", "answer": "7"}) + "\n")
    data = {"train_jsonl": str(tmp_path / "d.jsonl"), "processor": "gsm8k"}
    result = runner.invoke(app, ["train", "grpo", "--config", str(_config(tmp_path, data)), "--dry-run"])
    assert result.exit_code == 2
    assert result.output.strip() == f"error: {tmp_path / 'd.jsonl'} row 0: gsm8k answer: no '####' final answer"
