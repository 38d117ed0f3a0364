"""The data and reward sections of a run's config (`data`, `reward`) and their validation.

Plain data; the checks read only the standard library and this package's torch-free modules (the prompt template,
the row formats, the reward functions, the built-in tasks), so that a mistake is reported before torch loads.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from hf_mcore_bridge.grpo.data.chat import check_prompt_template
from hf_mcore_bridge.grpo.data.processors import check_processor
from hf_mcore_bridge.grpo.data.rewards import resolve_reward_fn
from hf_mcore_bridge.grpo.data.tasks import generate_records
from hf_mcore_bridge.grpo.errors import GRPOConfigError, require

__all__ = ["DataConfig", "RewardConfig", "validate_data", "validate_reward"]


@dataclass(frozen=True)
class DataConfig:
    """Where prompts come from: a built-in task, a JSONL file, or an HF dataset by name (where reachable)."""

    task: str | None = None
    """A built-in task of `grpo.data.tasks` (e.g. `repeat_digit`); exclusive with `train_jsonl`."""
    num_records: int = 1000
    """Records generated for a built-in task."""
    train_jsonl: str | None = None
    """A JSONL file of `{prompt, answer}` rows."""
    val_jsonl: str | None = None
    """Validation rows; None with a task: a disjoint seed of the same task."""
    hf_dataset: str | None = None
    """An HF dataset name or path for `datasets.load_dataset` (needs the `datasets` package and the Hub or a
    local copy); exclusive with `task` and `train_jsonl`."""
    hf_subset: str | None = None
    """The dataset's configuration name (`datasets.load_dataset(name=...)`; `main` for openai/gsm8k)."""
    hf_split: str = "train"
    """The dataset split to train on."""
    hf_val_split: str | None = None
    """The split to validate on (None: the first rows of the training split)."""
    prompt_field: str = "prompt"
    """The prompt's field name in the JSONL rows."""
    answer_field: str = "answer"
    """The answer's field name in the JSONL rows."""
    processor: str | None = None
    """A named row format (`gsm8k`, `math`, `deepscaler`, `openmathinstruct2`; see `grpo.data.processors`) that
    sets the fields and reduces the answer; None: `prompt_field` / `answer_field` as given."""
    shuffle: bool = True
    """Shuffle each epoch (seeded by `grpo.seed`)."""
    apply_chat_template: bool | None = None
    """Render prompts with the tokenizer's chat template (`tokenizer.apply_chat_template`); None: where the
    tokenizer has one (see `grpo.data.chat`)."""
    system_prompt: str | None = None
    """A system turn put before each question (needs the chat template)."""
    prompt_template: str | None = None
    """A format string around each question, e.g. `"{question} Put the final answer in \\boxed{{}}."`; None:
    the question as it is."""


_IN_PROCESS_REWARDS = ("number", "exact", "exact_match")
"""Built-in rewards cheap enough to score in the rank's own process by default."""


@dataclass(frozen=True)
class RewardConfig:
    """How a completion is scored."""

    @property
    def workers(self) -> int:
        """`num_workers`, resolved."""
        if self.num_workers is not None:
            return self.num_workers
        return 0 if self.name in _IN_PROCESS_REWARDS else 4

    name: str = "math"
    """A built-in reward (`math`: math-verify's symbolic check; `number`; `exact`) or a `module:function` taking
    `(completion_text, answer)` (see `grpo.data.rewards`)."""
    num_workers: int | None = None
    """Processes that score completions, per engine replica (started by its first rank; 0: in that rank's own
    process), see `grpo.data.scoring`. None: 0 for the microsecond-cheap `number` and `exact` rewards, 4 for the
    others (`math` and functions of your own)."""
    timeout_s: float = 5.0
    """Seconds one sample's reward may take; past it the sample scores 0 (`reward_timeouts` counts them)."""
    overlap: bool = True
    """Score each completion while the rest are generating: the embedded engine hands every sample to the reward
    workers as it finishes, so after generation only the last ones' scores are waited for (`reward_wait_s`). The
    rewards, their order and the metrics are those of scoring after generation (false), which vLLM's engine
    always amounts to (it returns a batch at once). No gain with `num_workers: 0`: there the engine's own process
    scores each sample as it arrives."""


def validate_data(data: DataConfig) -> None:
    """One source of prompts; the prompt template, the row format and the built-in task exist."""
    sources = [data.task, data.train_jsonl, data.hf_dataset]
    require(
        sum(source is not None for source in sources) == 1,
        "set exactly one of data.task, data.train_jsonl and data.hf_dataset",
    )
    try:
        if data.task is not None:
            generate_records(data.task, 0)
        if data.prompt_template is not None:
            check_prompt_template(data.prompt_template)
        if data.processor is not None:
            check_processor(data.processor)
    except ValueError as err:
        raise GRPOConfigError(str(err)) from None
    require(data.task is None or data.processor is None, "data.processor applies to data files, not to data.task")


def validate_reward(reward: RewardConfig) -> None:
    """The reward function resolves (a `module:function` is imported), its workers and time limit are valid, and
    the `math` reward's package is installed."""
    try:
        resolve_reward_fn(reward.name)
    except ValueError as err:  # `RewardLoadError` among them
        raise GRPOConfigError(str(err)) from None
    require(reward.num_workers is None or reward.num_workers >= 0, "reward.num_workers must be >= 0")
    require(reward.timeout_s >= 0, "reward.timeout_s must be >= 0 (0: no limit)")
    require(
        reward.name != "math" or importlib.util.find_spec("math_verify") is not None,
        "reward.name=math needs the 'math-verify' package (pip install 'math-verify[antlr4_13_2]'); or use"
        " reward.name=number (exact fractions, no symbolic check)",
    )
