"""The CPU recipe `examples/grpo_cpu_chat.yaml` runs end to end on the files `python -m
hf_mcore_bridge.grpo.data.tiny_chat` writes (two steps here, validating at the second), and every metric it logs is
named in docs/METRICS.md."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from hf_mcore_bridge.grpo.run.config import load_config
from hf_mcore_bridge.grpo.run.trainer import train_grpo

pytestmark = pytest.mark.slow

RECIPE = Path(__file__).parents[3] / "examples" / "grpo_cpu_chat.yaml"
DOCS = Path(__file__).parents[3] / "docs" / "METRICS.md"


def test_cpu_recipe_runs(tmp_path: Path) -> None:
    out = tmp_path / "tiny_chat"
    subprocess.run([sys.executable, "-m", "hf_mcore_bridge.grpo.data.tiny_chat", str(out)], check=True)
    overrides = [
        f"policy.model_path={out / 'model'}",
        f"data.train_jsonl={out / 'train.jsonl'}",
        f"data.val_jsonl={out / 'val.jsonl'}",
        f"logger.log_dir={tmp_path / 'logs'}",
        "logger.print_progress=false",
        "grpo.max_num_steps=2",
        "grpo.val_period=2",
    ]
    result = train_grpo(load_config(RECIPE, overrides))
    assert result.steps == 2
    last = result.metrics[-1]
    assert {"val_pass_at_1", "val_pass_at_2", "val_pass_at_4", "reward_timeouts"} <= set(last)
    assert last["token_mult_prob_error"] <= 1.0001
    assert (tmp_path / "logs" / "val_samples.jsonl").read_text().count("\n") == 2
    documented = set(re.findall(r"`([a-z_]+)`", DOCS.read_text()))
    for record in result.metrics:
        undocumented = {k for k in record if k != "step" and not re.fullmatch(r"val_pass_at_\d+", k)} - documented
        assert not undocumented, f"metrics missing from docs/METRICS.md: {sorted(undocumented)}"
