"""Data set processors by name, from JSONL, Parquet and (a stand-in for) HF `datasets`, through `load_train_val`."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from hf_mcore_bridge.grpo.data.config import DataConfig
from hf_mcore_bridge.grpo.data.processors import check_processor, gsm8k_answer
from hf_mcore_bridge.grpo.data.prompts import load_train_val
from hf_mcore_bridge.grpo.data.records import DataError

ROWS = {
    "gsm8k": [{"question": "How many?", "answer": "Add them.\n48 + 24 = <<48+24=72>>72\n#### 1,072"}],
    "math": [{"problem": "What is $\\frac{1}{2}+\\frac{1}{4}$?", "answer": "\\frac{3}{4}", "level": "Level 1"}],
    "deepscaler": [{"problem": "Find x.", "answer": "[1, 2)", "solution": "..."}],
    "openmathinstruct2": [{"problem": "Compute 2^3.", "expected_answer": "8", "generated_solution": "..."}],
}
EXPECTED = {
    "gsm8k": [{"prompt": "How many?", "answer": "1072"}],
    "math": [{"prompt": "What is $\\frac{1}{2}+\\frac{1}{4}$?", "answer": "\\frac{3}{4}"}],
    "deepscaler": [{"prompt": "Find x.", "answer": "[1, 2)"}],
    "openmathinstruct2": [{"prompt": "Compute 2^3.", "answer": "8"}],
}


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("name", sorted(ROWS))
def test_processor_from_jsonl_and_parquet(name: str, tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow", reason="Parquet needs pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(ROWS[name]), tmp_path / "train.parquet")
    for file in (_jsonl(tmp_path / "train.jsonl", ROWS[name]), tmp_path / "train.parquet"):
        train, val = load_train_val(DataConfig(train_jsonl=str(file), processor=name), 4, seed=0)
        assert train == EXPECTED[name] and val == EXPECTED[name], file


def test_processor_through_hf_datasets(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def load_dataset(path: str, split: str, **kwargs: object) -> list[dict]:
        calls.append((path, split, kwargs))
        return ROWS["gsm8k"] * (3 if split == "train" else 1)

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    config = DataConfig(hf_dataset="openai/gsm8k", hf_subset="main", hf_val_split="test", processor="gsm8k")
    train, val = load_train_val(config, 8, seed=0)
    assert train == EXPECTED["gsm8k"] * 3 and val == EXPECTED["gsm8k"]
    assert calls == [("openai/gsm8k", "train", {"name": "main"}), ("openai/gsm8k", "test", {"name": "main"})]


def test_errors(tmp_path: Path) -> None:
    assert gsm8k_answer("x\n#### 5\n#### 6") == "6"
    bad = _jsonl(tmp_path / "bad.jsonl", [*ROWS["gsm8k"], {"question": "q", "answer": "no marker"}])
    with pytest.raises(DataError, match=r"bad.jsonl row 1: gsm8k answer: no '####' final answer"):
        load_train_val(DataConfig(train_jsonl=str(bad), processor="gsm8k"), 1, seed=0)
    wrong_fields = _jsonl(tmp_path / "math.jsonl", ROWS["math"])
    with pytest.raises(DataError, match="missing field 'expected_answer'"):
        load_train_val(DataConfig(train_jsonl=str(wrong_fields), processor="openmathinstruct2"), 1, seed=0)
    with pytest.raises(ValueError, match="did you mean 'gsm8k'"):
        check_processor("gsm8")
    with pytest.raises(DataError, match="no such file"):
        load_train_val(DataConfig(train_jsonl=str(tmp_path / "missing.parquet")), 1, seed=0)
    (tmp_path / "broken.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match="not a readable Parquet file"):
        load_train_val(DataConfig(train_jsonl=str(tmp_path / "broken.parquet")), 1, seed=0)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.processor=gsm9k"], "did you mean 'gsm8k'"),
        (["data.prompt_template=Ask {q}"], "must contain {question}"),
        (["data.task=repeat_digit", "data.train_jsonl=null", "data.processor=math"], "not to data.task"),
        (["grpo.val_num_generations=0"], "val_num_generations must be >= 1"),
        (["reward.num_workers=-1"], "num_workers must be >= 0"),
        (["logger.wandb_enabled=true"], "needs the 'wandb' package"),
        (["reward.name=math"], "needs the 'math-verify' package"),
    ],
)
def test_config_refusals(overrides: list[str], message: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from hf_mcore_bridge.grpo.errors import GRPOConfigError
    from hf_mcore_bridge.grpo.run.config import config_from_dict

    real = importlib.util.find_spec
    missing = ("wandb", "math_verify")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in missing else real(name, *a))
    base = {"policy": {"model_path": "/m"}, "data": {"train_jsonl": "/d.jsonl"}, "reward": {"name": "number"}}
    with pytest.raises(GRPOConfigError, match=message):
        config_from_dict(base, overrides)
