"""Answer extraction, numeric comparison, the built-in rewards and user reward loading."""

from fractions import Fraction
from pathlib import Path

import pytest

from hf_mcore_bridge.grpo.data.rewards import (
    RewardLoadError,
    compute_rewards,
    exact_match_reward,
    extract_answer,
    load_reward_fn,
    math_reward,
    math_verify_reward,
    parse_number,
    resolve_reward_fn,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"so the result is \boxed{42}.", "42"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{ {a}{b{c}} } trailing }", "{a}{b{c}}"),
        ("Natalia sold 48 clips.\n#### 72", "72"),
        ("#### 1,234\nmore text", "1,234"),
        ("Answer: 7", "7"),
        ("final answer : -3", "-3"),
        ("Answer: 3\nAnswer: 5", "5"),
        (r"\boxed{3} then Answer: 4", "4"),
        (r"Answer: 4 then \boxed{3}", "3"),
        (r"Answer: \boxed{12}", "12"),
        (r"\boxed{1} and \boxed{2}", "2"),
    ],
)
def test_extract_answer(text: str, expected: str) -> None:
    assert extract_answer(text) == expected


@pytest.mark.parametrize("text", ["no marker here", r"\boxed{12", "Answer:", "####   \n"])
def test_extract_answer_none(text: str) -> None:
    assert extract_answer(text) is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("42", Fraction(42)),
        ("-7", Fraction(-7)),
        ("0.75", Fraction(3, 4)),
        ("3/4", Fraction(3, 4)),
        (" 6 / 8 ", Fraction(3, 4)),
        (r"\frac{3}{4}", Fraction(3, 4)),
        (r"\dfrac{1}{3}", Fraction(1, 3)),
        (r"-\frac{1}{2}", Fraction(-1, 2)),
        ("1,234", Fraction(1234)),
        ("1,234,567.5", Fraction(2469135, 2)),
        ("$5", Fraction(5)),
        ("$1,000.", Fraction(1000)),
        ("50%", Fraction(50)),
        (r"12\%", Fraction(12)),
        ("$7$", Fraction(7)),
        ("1e3", Fraction(1000)),
    ],
)
def test_parse_number(text: str, expected: Fraction) -> None:
    assert parse_number(text) == expected


@pytest.mark.parametrize("text", ["abc", "1/0", "12,34", "1,2345", "x+1", "", "3 apples"])
def test_parse_number_rejects(text: str) -> None:
    assert parse_number(text) is None


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        (r"The answer is \boxed{0.75}", "3/4", 1.0),
        (r"\boxed{\frac{3}{4}}", "0.75", 1.0),
        ("so 1000 in all.\n#### 1,000", "1000", 1.0),
        ("Answer: $5", "5", 1.0),
        ("Answer: 50%", "50", 1.0),
        ("Answer: 72.0", "72", 1.0),
        (" 42 and then more tokens", "42", 1.0),
        (" 42.", "42", 1.0),
        (" 41", "42", 0.0),
        ("", "42", 0.0),
        ("   ", "42", 0.0),
        (r"\boxed{72}", "She earns 12 * 6 = 72 dollars.\n#### 72", 1.0),
        (r"\boxed{71}", "She earns 12 * 6 = 72 dollars.\n#### 72", 0.0),
        ("Answer: Paris.", "paris", 1.0),
        ("Answer: London", "paris", 0.0),
        ("Answer: 0.333", "1/3", 0.0),
    ],
)
def test_math_reward(completion: str, answer: str, expected: float) -> None:
    assert math_reward(completion, answer) == expected


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        (" 7", "7", 1.0),
        ("Answer: 7", " 7 ", 1.0),
        ("Answer: 7.0", "7", 0.0),
        (" Paris", "paris", 0.0),
        ("", "7", 0.0),
    ],
)
def test_exact_match_reward(completion: str, answer: str, expected: float) -> None:
    assert exact_match_reward(completion, answer) == expected


USER_MODULE = """
VALUE = 3


def good(completion_text, answer):
    return 0.5 if answer in completion_text else -1.0


def one_argument(completion_text):
    return 0.0


class Scorer:
    @staticmethod
    def score(completion_text, answer):
        return 2.0
"""


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "grpo_test_user_rewards.py").write_text(USER_MODULE)
    (tmp_path / "grpo_test_broken_rewards.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "grpo_test_user_rewards"


def test_load_user_reward_fn(user_module: str) -> None:
    fn = load_reward_fn(f"{user_module}:good")
    assert fn("the answer is 9", "9") == 0.5
    assert fn("nothing", "9") == -1.0
    assert load_reward_fn(f"{user_module}:Scorer.score")("", "") == 2.0
    assert resolve_reward_fn(f"{user_module}:good") is fn


@pytest.mark.parametrize(
    ("spec", "fragments"),
    [
        ("no_such_module_for_grpo_tests:f", ["no_such_module_for_grpo_tests", "could not be imported"]),
        ("grpo_test_broken_rewards:f", ["grpo_test_broken_rewards", "could not be imported", "boom at import"]),
        ("grpo_test_user_rewards:missing", ["grpo_test_user_rewards", "no attribute 'missing'"]),
        ("grpo_test_user_rewards:Scorer.nope", ["no attribute 'Scorer.nope'", "'nope' is missing"]),
        ("grpo_test_user_rewards:VALUE", ["'VALUE'", "int", "not callable"]),
        ("grpo_test_user_rewards:one_argument", ["one_argument", "fn(completion_text, answer)"]),
        ("grpo_test_user_rewards", ["not of the form 'module:function'"]),
        ("grpo_test_user_rewards:", ["not of the form 'module:function'"]),
    ],
)
def test_load_reward_fn_errors(user_module: str, spec: str, fragments: list[str]) -> None:
    with pytest.raises(RewardLoadError) as info:
        load_reward_fn(spec)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_resolve_builtin_and_unknown() -> None:
    assert resolve_reward_fn("math") is math_verify_reward
    assert resolve_reward_fn("number") is math_reward
    assert resolve_reward_fn("exact") is exact_match_reward
    assert resolve_reward_fn("exact_match") is exact_match_reward
    with pytest.raises(RewardLoadError, match="did you mean 'math'"):
        resolve_reward_fn("maths")


def test_compute_rewards() -> None:
    assert compute_rewards(math_reward, [" 4", " 5"], ["4", "4"]) == [1.0, 0.0]
    assert compute_rewards(lambda c, a: 1, ["x"], ["y"]) == [1.0]
    with pytest.raises(TypeError, match="sample 1"):
        compute_rewards(lambda c, a: "yes" if c == "b" else 0.0, ["a", "b"], ["", ""])
    with pytest.raises(TypeError, match="nan"):
        compute_rewards(lambda c, a: float("nan"), ["a"], [""])
    with pytest.raises(ValueError, match="2 completions but 1 answers"):
        compute_rewards(math_reward, ["a", "b"], ["a"])
