"""`bridge train grpo --dry-run`: the first prompts of a run as the engine will see them, without starting it.

It goes through the run's own steps up to the first generation: the config is validated, the tokenizer and stop
tokens resolved as the trainer resolves them (the model's EOS ids, plus the chat template's end-of-turn token), the
data read through its processor, the first training prompts drawn in the run's order and rendered by
`grpo.data.chat`. No process is started, no model converted, nothing written. Errors in the data or the tokenizer come
out as `GRPOConfigError` (one line on the command line).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hf_mcore_bridge.errors import BridgeError
from hf_mcore_bridge.grpo.errors import GRPOConfigError
from hf_mcore_bridge.grpo.run.config import GRPOConfig

__all__ = ["Preview", "PromptPreview", "preview_run"]


@dataclass(frozen=True)
class PromptPreview:
    """One rendered prompt."""

    text: str
    token_ids: list[int]
    answer: str


@dataclass(frozen=True)
class Preview:
    """What a dry run shows."""

    prompts: list[PromptPreview]
    stop_token_ids: tuple[int, ...]
    stop_tokens: list[str]
    """The stop ids as tokens."""
    chat_template: bool
    num_train: int
    num_val: int


def preview_run(config: GRPOConfig, count: int = 3) -> Preview:
    """The first `count` training prompts of `config`'s run, rendered, and its stop tokens."""
    from hf_mcore_bridge.grpo.data.chat import PromptRenderer, load_hf_tokenizer, template_stop_ids
    from hf_mcore_bridge.grpo.data.prompts import PromptIterator, load_train_val
    from hf_mcore_bridge.grpo.data.records import DataError
    from hf_mcore_bridge.grpo.data.stop_tokens import model_assets_dir, stop_token_ids
    from hf_mcore_bridge.grpo.run.trainer import _tokenizer_file

    config.validate()
    model = Path(config.policy.model_path)
    if not model.exists():
        raise GRPOConfigError(f"policy.model_path {model} does not exist")
    assets = model_assets_dir(model)
    try:
        tokenizer = load_hf_tokenizer(_tokenizer_file(config, [assets] if assets else []))
        renderer = PromptRenderer.from_config(config.data, tokenizer)
        stops = stop_token_ids(config)
        if config.generation.stop_token_ids is None:
            stops = template_stop_ids(stops, renderer)
        train, val = load_train_val(config.data, config.grpo.val_num_prompts, config.grpo.seed)
    except (DataError, ImportError, OSError) as err:
        raise GRPOConfigError(str(err)) from None
    except BridgeError as err:
        raise GRPOConfigError(str(err)) from None
    first = PromptIterator(train, seed=config.grpo.seed, shuffle=config.data.shuffle).next_batch(count)
    prompts = [PromptPreview(renderer.text(r["prompt"]), renderer.token_ids(r["prompt"]), r["answer"]) for r in first]
    return Preview(
        prompts=prompts,
        stop_token_ids=stops,
        stop_tokens=tokenizer.convert_ids_to_tokens(list(stops)),
        chat_template=renderer.use_chat_template,
        num_train=len(train),
        num_val=len(val),
    )
