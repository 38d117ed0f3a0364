"""Named row formats of the math data sets RL recipes train on (`data.processor`): which fields hold the question
and the answer, and how a reference answer is reduced to what the reward compares.

- `gsm8k` (openai/gsm8k): `question`, and `answer` a worked solution ending in `#### 72`; the reference is the
  number after `####`, thousands separators removed (`1,234` would otherwise read as a tuple to math-verify).
- `math` (MATH-500 and other `problem`/`answer` sets) and `deepscaler` (agentica-org/DeepScaleR-Preview-Dataset,
  whose rows also carry a `solution`): `problem`, `answer` as given.
- `openmathinstruct2` (nvidia/OpenMathInstruct-2): `problem`, `expected_answer`.

The table is explicit; a format is added as one entry.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hf_mcore_bridge.grpo.data.records import DataError, PromptRecord

__all__ = ["PROCESSORS", "Processor", "apply_processor", "check_processor", "gsm8k_answer"]


def gsm8k_answer(solution: str) -> str:
    """The final answer of a GSM8K solution: the text after its last `####`, without thousands separators."""
    _, marker, tail = solution.rpartition("####")
    if not marker:
        raise ValueError("no '####' final answer")
    answer = tail.strip().replace(",", "")
    if not answer:
        raise ValueError("empty '####' final answer")
    return answer


@dataclass(frozen=True)
class Processor:
    """One row format: its question and answer fields and the reduction of the answer."""

    prompt_field: str
    answer_field: str
    reduce_answer: Callable[[str], str] = str.strip


PROCESSORS: dict[str, Processor] = {
    "gsm8k": Processor("question", "answer", gsm8k_answer),
    "math": Processor("problem", "answer"),
    "deepscaler": Processor("problem", "answer"),
    "openmathinstruct2": Processor("problem", "expected_answer"),
}


def check_processor(name: str) -> Processor:
    """The processor called `name`; ValueError naming the known ones (and the closest) otherwise."""
    if name in PROCESSORS:
        return PROCESSORS[name]
    close = difflib.get_close_matches(name, PROCESSORS, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"unknown data.processor {name!r}: one of {sorted(PROCESSORS)}{hint}")


def apply_processor(name: str, records: Sequence[PromptRecord], source: str) -> list[PromptRecord]:
    """`records` (read with the processor's fields) with their answers reduced; a row whose answer cannot be
    reduced raises DataError naming `source` and its 0-based index."""
    reduce = check_processor(name).reduce_answer
    out = []
    for index, record in enumerate(records):
        try:
            out.append(PromptRecord(prompt=record["prompt"], answer=reduce(record["answer"])))
        except ValueError as err:
            raise DataError(f"{source} row {index}: {name} answer: {err}") from None
    return out
