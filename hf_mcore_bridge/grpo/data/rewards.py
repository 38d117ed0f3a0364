r"""Offline rule-based rewards for completions with a known answer, and loading of user reward functions.

A reward function is `(completion_text: str, answer: str) -> float`. Built-ins are looked up by name in the
explicit `BUILTIN_REWARDS` table; anything of the form `"module:function"` is imported instead:
- `math`: Hugging Face's `math-verify` (`math_verify_reward`): LaTeX and plain-expression answers parsed into
  sympy and compared symbolically (`0.5` = `\frac{1}{2}`, `x+1` = `1+x`, `50\%` = `0.5`, intervals, sets); the
  completion's last marked answer is the one compared. It runs with math-verify's own time limits switched off: the
  per-sample limit is the scorer's (`grpo.data.scoring`), which works in any process.
- `number`: the hand-written reader below, numbers compared as exact fractions (no sympy, no time limit needed).
- `exact` (alias `exact_match`): the extracted answer character for character.

How the `number` reward reads a completion:
- The final answer is the content of `\boxed{...}` (nested braces allowed), the rest of a line after `####`
  (GSM8K style) or after `Answer:`; of all such markers in the text, the one that starts last wins.
- A completion with no marker is read as a bare answer: its first whitespace-separated word, trailing
  punctuation removed. This serves prompts that end in "Answer:" themselves, such as the built-in tasks.
- A reference answer that contains a marker (GSM8K solutions end in "#### 72") is reduced the same way.
- Numbers are compared exactly as fractions: integers, decimals, `a/b`, `\frac{a}{b}`, thousands separators,
  a leading `$` and a trailing `%` (dropped, so "50%" equals "50", not "0.5"). Anything that is not a number on
  both sides falls back to a normalised string comparison (case, spacing, enclosing `$...$`, a final period).
- This is not a symbolic equivalence checker: `0.333` does not equal `1/3`, and `x+1` does not equal `1+x`
  (`math` is).
"""

import difflib
import importlib
import inspect
import logging
import math
import re
from collections.abc import Callable, Iterator, Sequence
from fractions import Fraction
from numbers import Real

__all__ = [
    "BUILTIN_REWARDS",
    "RewardFn",
    "RewardLoadError",
    "answers_match",
    "candidate_answer",
    "compute_rewards",
    "exact_match_reward",
    "extract_answer",
    "load_reward_fn",
    "math_reward",
    "math_verify_reward",
    "normalize_text",
    "parse_number",
    "resolve_reward_fn",
]

RewardFn = Callable[[str, str], float]

_BOXED = re.compile(r"\\boxed\s*\{")
_HASHES = re.compile(r"####[ \t]*([^\n]*)")
_ANSWER = re.compile(r"\banswer[ \t]*:[ \t]*([^\n]*)", re.IGNORECASE)
_TRAILING_PUNCTUATION = ".,;:!?"

_INTEGER = r"[+-]?\d+"
_DECIMAL = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_SLASH_FRACTION = re.compile(rf"({_INTEGER})\s*/\s*({_INTEGER})")
_LATEX_FRACTION = re.compile(rf"(-?)\\[dt]?frac\{{\s*({_INTEGER})\s*\}}\{{\s*({_INTEGER})\s*\}}")


class RewardLoadError(ValueError):
    """A reward function named in the configuration could not be found or used."""


def _boxed_contents(text: str) -> Iterator[tuple[int, str]]:
    """(start, content) of each `\\boxed{...}` whose braces balance; an unclosed one is skipped."""
    for match in _BOXED.finditer(text):
        depth, index = 1, match.end()
        while index < len(text) and depth:
            if text[index] == "{":
                depth += 1
            elif text[index] == "}":
                depth -= 1
            index += 1
        if depth == 0:
            yield match.start(), text[match.end() : index - 1]


def extract_answer(text: str) -> str | None:
    r"""The final answer marked in `text` by `\boxed{}`, `####` or `Answer:` (the last marker wins), or None."""
    candidates = list(_boxed_contents(text))
    candidates += [(m.start(), m.group(1)) for m in _HASHES.finditer(text)]
    candidates += [(m.start(), m.group(1)) for m in _ANSWER.finditer(text)]
    candidates = [(start, content.strip()) for start, content in candidates if content.strip()]
    if not candidates:
        return None
    return max(candidates, key=lambda candidate: candidate[0])[1]


def candidate_answer(completion: str) -> str | None:
    """The marked answer of a completion or, without a marker, its first word; None for a blank completion."""
    marked = extract_answer(completion)
    if marked is not None:
        return marked
    words = completion.split()
    if not words:
        return None
    return words[0].rstrip(_TRAILING_PUNCTUATION) or None


def _reference(answer: str) -> str:
    return extract_answer(answer) or answer.strip()


def parse_number(text: str) -> Fraction | None:
    r"""The exact value of a number written as an int, decimal, `a/b`, `\frac{a}{b}`, `1,234`, `$5` or `50%`."""
    s = text.strip().rstrip(".").strip()
    if len(s) >= 2 and s[0] == "$" and s[-1] == "$":
        s = s[1:-1].strip()
    s = s.removeprefix("\\$").removeprefix("$").strip()
    s = s.removesuffix("\\%").removesuffix("%").strip()
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    try:
        if latex := _LATEX_FRACTION.fullmatch(s):
            value = Fraction(int(latex.group(2)), int(latex.group(3)))
            return -value if latex.group(1) else value
        if slash := _SLASH_FRACTION.fullmatch(s):
            return Fraction(int(slash.group(1)), int(slash.group(2)))
        if _DECIMAL.fullmatch(s):
            return Fraction(s)
    except ZeroDivisionError:
        return None
    return None


def normalize_text(text: str) -> str:
    """Lower-cased, whitespace-collapsed, without enclosing `$...$` or a final period."""
    s = " ".join(text.split()).lower().rstrip(".").strip()
    if len(s) >= 2 and s[0] == "$" and s[-1] == "$":
        s = s[1:-1].strip()
    return s


def answers_match(predicted: str, reference: str) -> bool:
    """Numerically equal when both parse as numbers, else equal after `normalize_text`."""
    predicted_value, reference_value = parse_number(predicted), parse_number(reference)
    if predicted_value is not None and reference_value is not None:
        return predicted_value == reference_value
    return normalize_text(predicted) == normalize_text(reference)


def math_reward(completion_text: str, answer: str) -> float:
    """1.0 when the completion's final answer equals the reference numerically (or as normalised text), else 0.0."""
    predicted = candidate_answer(completion_text)
    if predicted is None:
        return 0.0
    return 1.0 if answers_match(predicted, _reference(answer)) else 0.0


def exact_match_reward(completion_text: str, answer: str) -> float:
    """1.0 when the completion's final answer is character-for-character the reference (both stripped)."""
    predicted = candidate_answer(completion_text)
    return 1.0 if predicted is not None and predicted == _reference(answer) else 0.0


def math_verify_reward(completion_text: str, answer: str) -> float:
    r"""1.0 when math-verify finds the completion's answer symbolically equal to the reference, else 0.0.

    The reference is reduced as for `number` (a GSM8K `#### 72` solution gives `72`) and read as the content of a
    `oxed{}`, so plain `72`, `rac{1}{2}` and `[1, 2)` all parse. A reference math-verify cannot parse falls
    back to the `number` comparison. No time limit here: call it through `grpo.data.scoring.RewardScorer`.
    """
    from math_verify import parse, verify  # sympy and the LaTeX grammar: imported only where this reward runs

    # math-verify warns once per process that its signal-based time limits are off; the scorer's limit replaces them
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    reference = _reference(answer)
    gold = parse(f"\\boxed{{{reference}}}", parsing_timeout=None)
    if not gold:
        return math_reward(completion_text, answer)
    # the last marked answer (as `extract_answer`) is the final one; math-verify alone would take the first \boxed{}
    marked = extract_answer(completion_text)
    predicted = parse(f"\\boxed{{{marked}}}", parsing_timeout=None) if marked is not None else []
    if not predicted:
        predicted = parse(completion_text, parsing_timeout=None)
    if not predicted:
        return 0.0
    return 1.0 if verify(gold, predicted, timeout_seconds=None) else 0.0


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "math": math_verify_reward,
    "number": math_reward,
    "exact": exact_match_reward,
    "exact_match": exact_match_reward,
}


def load_reward_fn(spec: str) -> RewardFn:
    """Import a user reward function given as `"package.module:function"` (or `"module:Class.method"`).

    Raises RewardLoadError naming what failed: a malformed spec, a module that cannot be imported (with the
    import's own error), a missing attribute, an object that is not callable, or one whose signature cannot take
    `(completion_text, answer)`.
    """
    module_name, sep, attr_path = spec.partition(":")
    if not sep or not module_name.strip() or not attr_path.strip():
        raise RewardLoadError(f"reward function {spec!r} is not of the form 'module:function'")
    try:
        target: object = importlib.import_module(module_name)
    except Exception as exc:
        raise RewardLoadError(
            f"reward function {spec!r}: module {module_name!r} could not be imported ({type(exc).__name__}: {exc})"
        ) from exc
    for part in attr_path.split("."):
        if not hasattr(target, part):
            raise RewardLoadError(
                f"reward function {spec!r}: module {module_name!r} has no attribute {attr_path!r} ({part!r} is missing)"
            )
        target = getattr(target, part)
    if not callable(target):
        raise RewardLoadError(
            f"reward function {spec!r}: {attr_path!r} is a {type(target).__name__}, which is not callable"
        )
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        # Some callables (C builtins) expose no signature; they are checked when first called instead.
        return target
    try:
        signature.bind("completion", "answer")
    except TypeError as exc:
        raise RewardLoadError(
            f"reward function {spec!r} has signature {signature}, which cannot be called as"
            f" fn(completion_text, answer): {exc}"
        ) from exc
    return target


def resolve_reward_fn(name: str) -> RewardFn:
    """A built-in reward by name (see `BUILTIN_REWARDS`), or a user function given as `"module:function"`."""
    if ":" in name:
        return load_reward_fn(name)
    if name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name]
    close = difflib.get_close_matches(name, BUILTIN_REWARDS, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise RewardLoadError(
        f"unknown reward {name!r}: built-ins are {sorted(BUILTIN_REWARDS)}, or give 'module:function'{hint}"
    )


def compute_rewards(fn: RewardFn, completions: Sequence[str], answers: Sequence[str]) -> list[float]:
    """Apply `fn` to each (completion, answer) pair; a non-numeric or non-finite result is an error naming it."""
    if len(completions) != len(answers):
        raise ValueError(f"{len(completions)} completions but {len(answers)} answers")
    rewards = []
    for index, (completion, answer) in enumerate(zip(completions, answers, strict=True)):
        value = fn(completion, answer)
        if not isinstance(value, Real) or not math.isfinite(value):
            raise TypeError(f"reward function returned {value!r} for sample {index}; expected a finite float")
        rewards.append(float(value))
    return rewards
