"""JSONL and HF loading with their errors, and the seeded, resumable prompt iterator."""

import json
import sys
import types
from pathlib import Path

import pytest

from hf_mcore_bridge.grpo.data.prompts import PromptIterator, load_hf_dataset, load_jsonl
from hf_mcore_bridge.grpo.data.records import DataError, PromptRecord


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_load_jsonl_with_custom_fields(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "d.jsonl",
        ['{"question": "1+1?", "solution": 2, "extra": true}', "", '{"question": "Name?", "solution": "Bob"}'],
    )
    records = load_jsonl(path, prompt_field="question", answer_field="solution")
    assert records == [{"prompt": "1+1?", "answer": "2"}, {"prompt": "Name?", "answer": "Bob"}]


@pytest.mark.parametrize(
    ("lines", "fragments"),
    [
        (['{"prompt": "a", "answer": "1"}', "", '{"prompt": "b"}'], [":3:", "missing field 'answer'", "'prompt'"]),
        (['{"prompt": "a", "answer": "1"}', '{"prompt": "b", "answer": '], [":2:", "invalid JSON"]),
        (['["prompt", "answer"]'], [":1:", "expected an object", "list"]),
        (['{"prompt": 5, "answer": "1"}'], [":1:", "'prompt' must be a string", "int"]),
        (['{"prompt": "a", "answer": null}'], [":1:", "'answer' must be a string or number", "NoneType"]),
        (["", "  "], ["no records"]),
    ],
)
def test_load_jsonl_errors(tmp_path: Path, lines: list[str], fragments: list[str]) -> None:
    path = write_lines(tmp_path / "bad.jsonl", lines)
    with pytest.raises(DataError) as info:
        load_jsonl(path)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_hf_loader_without_datasets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match="pip install datasets"):
        load_hf_dataset("openai/gsm8k")


def test_hf_loader_maps_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def load_dataset(path: str, split: str, **kwargs: object) -> list[dict]:
        calls.append((path, split, kwargs))
        return [{"question": "q0", "answer": "#### 1"}, {"question": "q1", "answer": "#### 2"}]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    records = load_hf_dataset("openai/gsm8k", split="test", prompt_field="question", name="main")
    assert records == [{"prompt": "q0", "answer": "#### 1"}, {"prompt": "q1", "answer": "#### 2"}]
    assert calls == [("openai/gsm8k", "test", {"name": "main"})]
    with pytest.raises(DataError, match=r"openai/gsm8k\[train\] row 0: missing field 'prompt'"):
        load_hf_dataset("openai/gsm8k")


RECORDS = [PromptRecord(prompt=f"p{i}", answer=str(i)) for i in range(10)]


def stream(iterator: PromptIterator, batches: int, batch_size: int) -> list[str]:
    return [record["prompt"] for _ in range(batches) for record in iterator.next_batch(batch_size)]


def test_each_epoch_is_a_shuffled_permutation() -> None:
    prompts = [record["prompt"] for record in PromptIterator(RECORDS, seed=1).next_batch(30)]
    epochs = [prompts[0:10], prompts[10:20], prompts[20:30]]
    for epoch in epochs:
        assert sorted(epoch) == sorted(record["prompt"] for record in RECORDS)
    assert epochs[0] != epochs[1] != epochs[2]
    assert epochs[0] != [record["prompt"] for record in RECORDS]


def test_same_seed_same_stream_other_seed_other_stream() -> None:
    a = stream(PromptIterator(RECORDS, seed=5), 4, 5)
    assert stream(PromptIterator(RECORDS, seed=5), 4, 5) == a
    assert stream(PromptIterator(RECORDS, seed=6), 4, 5) != a


def test_unshuffled_keeps_order_across_epochs() -> None:
    iterator = PromptIterator(RECORDS, shuffle=False)
    assert [record["answer"] for record in iterator.next_batch(13)] == [str(i % 10) for i in range(13)]
    assert iterator.epoch == 1


def test_resume_sees_the_same_prompts() -> None:
    # Batches of 3 over 10 records cross epoch boundaries mid-batch.
    through = stream(PromptIterator(RECORDS, seed=11), 9, 3)

    first = PromptIterator(RECORDS, seed=11)
    head = stream(first, 4, 3)
    state = json.loads(json.dumps(first.state_dict()))
    assert state == {"epoch": 1, "position": 2, "seed": 11, "num_records": 10}

    resumed = PromptIterator(RECORDS, seed=11)
    resumed.load_state_dict(state)
    assert head + stream(resumed, 5, 3) == through


def test_load_state_dict_rejects_mismatches() -> None:
    state = PromptIterator(RECORDS, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed"):
        PromptIterator(RECORDS, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="records"):
        PromptIterator(RECORDS[:5], seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="out of range"):
        PromptIterator(RECORDS, seed=1).load_state_dict({**state, "position": 10})
    with pytest.raises(ValueError, match="at least one record"):
        PromptIterator([])
