"""Prompt datasets for GRPO: JSONL and Parquet files, optional HF `datasets`, and a seeded, resumable prompt iterator.

Every source is reduced to a list of `records.PromptRecord` (`{"prompt": str, "answer": str}`), read into memory whole;
prompt sets for RL are small next to pre-training corpora. Field names in the source are configurable, or set by a
named row format (`grpo.data.processors`); `load_train_val` reads what a config's `data` section names.

The iterator walks an endless stream of epochs, each a permutation of the records drawn from `(seed, epoch)`
alone, so that its state is two integers (`epoch`, `position`) and a resumed run sees exactly the prompts an
uninterrupted one would. Shuffling uses only `random.Random.random()` seeded with a string, the part of the
standard library's generator that Python promises to keep stable across versions (`shuffle` and `randrange`
carry no such promise).

HF `datasets` is imported only inside `load_hf_dataset`, so the package works, and its tests run, without it;
Parquet files are read with `pyarrow` (imported only for them).
"""

import json
import random
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hf_mcore_bridge.grpo.data.records import DataError, PromptRecord

__all__ = [
    "PromptIterator",
    "load_hf_dataset",
    "load_jsonl",
    "load_parquet",
    "load_records_file",
    "load_train_val",
    "records_from_rows",
]


def _to_record(row: object, prompt_field: str, answer_field: str, where: str) -> PromptRecord:
    if not isinstance(row, Mapping):
        raise DataError(f"{where}: expected an object with fields, got {type(row).__name__}")
    for field in (prompt_field, answer_field):
        if field not in row:
            raise DataError(f"{where}: missing field {field!r} (fields present: {sorted(map(str, row))})")
    prompt, answer = row[prompt_field], row[answer_field]
    if not isinstance(prompt, str):
        raise DataError(f"{where}: field {prompt_field!r} must be a string, got {type(prompt).__name__}")
    # Numeric answers are common in math sets (`"answer": 42`); their text form is what rewards compare.
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
        raise DataError(f"{where}: field {answer_field!r} must be a string or number, got {type(answer).__name__}")
    return PromptRecord(prompt=prompt, answer=str(answer))


def records_from_rows(
    rows: Iterable[object], prompt_field: str = "prompt", answer_field: str = "answer", source: str = "row"
) -> list[PromptRecord]:
    """Records from mapping rows; an unusable row raises DataError naming `source` and its 0-based index."""
    return [_to_record(row, prompt_field, answer_field, f"{source} {index}") for index, row in enumerate(rows)]


def load_jsonl(path: str | Path, prompt_field: str = "prompt", answer_field: str = "answer") -> list[PromptRecord]:
    """Read one JSON object per line; blank lines are skipped. Errors name the file and 1-based line number."""
    path = Path(path)
    records = []
    with path.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from exc
            records.append(_to_record(row, prompt_field, answer_field, where))
    if not records:
        raise DataError(f"{path}: no records")
    return records


def load_parquet(path: str | Path, prompt_field: str = "prompt", answer_field: str = "answer") -> list[PromptRecord]:
    """Read a Parquet file's rows (needs `pyarrow`). Errors name the file and the 0-based row."""
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ImportError(f"reading {path} needs the 'pyarrow' package (pip install pyarrow)") from exc
    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as exc:  # pyarrow raises its own ArrowInvalid / OSError family
        raise DataError(f"{path}: not a readable Parquet file ({exc})") from None
    if not rows:
        raise DataError(f"{path}: no records")
    return records_from_rows(rows, prompt_field, answer_field, source=f"{path} row")


def load_records_file(
    path: str | Path, prompt_field: str = "prompt", answer_field: str = "answer"
) -> list[PromptRecord]:
    """A `.parquet` file through `load_parquet`, anything else as JSONL."""
    if not Path(path).is_file():
        raise DataError(f"{path}: no such file")
    load = load_parquet if str(path).endswith(".parquet") else load_jsonl
    return load(path, prompt_field, answer_field)


def load_hf_dataset(
    path: str,
    split: str = "train",
    prompt_field: str = "prompt",
    answer_field: str = "answer",
    **load_kwargs: Any,
) -> list[PromptRecord]:
    """Records from `datasets.load_dataset(path, split=split, **load_kwargs)`; needs the `datasets` package.

    Extra keyword arguments (a config name as `name=`, `data_files=`, `revision=`...) go to `load_dataset`.
    """
    try:
        import datasets
    except ImportError as exc:
        raise ImportError(
            f"loading the HF dataset {path!r} needs the 'datasets' package (pip install datasets)"
        ) from exc
    rows = datasets.load_dataset(path, split=split, **load_kwargs)
    return records_from_rows(rows, prompt_field, answer_field, source=f"{path}[{split}] row")


def load_train_val(data: Any, val_count: int, seed: int) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """The training records and the first `val_count` validation records a `DataConfig` names: a built-in task
    (validation: a disjoint seed of it), a file or an HF dataset (validation: `val_jsonl` / `hf_val_split`, else the
    first training records), through `data.processor` where one is set."""
    from hf_mcore_bridge.grpo.data.processors import apply_processor, check_processor
    from hf_mcore_bridge.grpo.data.tasks import generate_records

    if data.task is not None:
        train = generate_records(data.task, data.num_records, seed=seed)
        return train, generate_records(data.task, val_count, seed=seed + 1_000_003)
    fields = (data.prompt_field, data.answer_field)
    if data.processor is not None:
        processor = check_processor(data.processor)
        fields = (processor.prompt_field, processor.answer_field)

    def read(source: str, split: str | None) -> list[PromptRecord]:
        if data.hf_dataset is not None:
            subset = {"name": data.hf_subset} if data.hf_subset else {}
            records = load_hf_dataset(source, split or "train", *fields, **subset)
        else:
            records = load_records_file(source, *fields)
        return apply_processor(data.processor, records, source) if data.processor is not None else records

    if data.hf_dataset is not None:
        train = read(data.hf_dataset, data.hf_split)
        val = read(data.hf_dataset, data.hf_val_split) if data.hf_val_split else train
    else:
        train = read(data.train_jsonl, None)
        val = read(data.val_jsonl, None) if data.val_jsonl else train
    return train, val[:val_count]


def _permutation(size: int, seed: int, epoch: int) -> list[int]:
    """Fisher-Yates over `range(size)` driven only by `random()`, whose sequence per seed is stable."""
    rng = random.Random(f"{seed}:{epoch}")
    order = list(range(size))
    for i in range(size - 1, 0, -1):
        j = min(int(rng.random() * (i + 1)), i)
        order[i], order[j] = order[j], order[i]
    return order


class PromptIterator:
    """An endless, seeded stream of records over repeated epochs, resumable from `state_dict()`.

    With `shuffle=False` every epoch is the records in their given order.
    """

    def __init__(self, records: Sequence[PromptRecord], seed: int = 0, shuffle: bool = True) -> None:
        if not records:
            raise ValueError("PromptIterator needs at least one record")
        self._records = records
        self._seed = seed
        self._shuffle = shuffle
        self._epoch = 0
        self._position = 0
        self._order: list[int] = []
        self._order_epoch = -1

    @property
    def epoch(self) -> int:
        """Epochs completed so far (0 during the first pass)."""
        return self._epoch

    def _current_order(self) -> list[int]:
        if self._order_epoch != self._epoch:
            size = len(self._records)
            self._order = _permutation(size, self._seed, self._epoch) if self._shuffle else list(range(size))
            self._order_epoch = self._epoch
        return self._order

    def __iter__(self) -> "PromptIterator":
        return self

    def __next__(self) -> PromptRecord:
        record = self._records[self._current_order()[self._position]]
        self._position += 1
        if self._position == len(self._records):
            self._epoch += 1
            self._position = 0
        return record

    def next_batch(self, batch_size: int) -> list[PromptRecord]:
        """The next `batch_size` records; a batch that runs past an epoch's end continues into the next one."""
        return [next(self) for _ in range(batch_size)]

    def state_dict(self) -> dict[str, int]:
        """Where the stream stands, plus the seed and size it was built with (checked on restore)."""
        return {
            "epoch": self._epoch,
            "position": self._position,
            "seed": self._seed,
            "num_records": len(self._records),
        }

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Continue from a `state_dict()` of an iterator with the same seed over the same number of records."""
        if state["seed"] != self._seed:
            raise ValueError(f"iterator state was saved with seed {state['seed']}, this iterator has {self._seed}")
        if state["num_records"] != len(self._records):
            raise ValueError(
                f"iterator state is for {state['num_records']} records, this dataset has {len(self._records)}"
            )
        if not 0 <= state["position"] < len(self._records) or state["epoch"] < 0:
            raise ValueError(f"iterator state out of range: {dict(state)}")
        self._epoch = state["epoch"]
        self._position = state["position"]
