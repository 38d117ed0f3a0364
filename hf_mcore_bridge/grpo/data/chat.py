"""Prompt rendering: a data set's question as the token ids the engine generates from (`PromptRenderer`).

A question becomes `data.prompt_template.format(question=...)` (or stays as it is), then, where the chat template
is on, a conversation (`data.system_prompt` as a system turn, the text as the user turn) rendered by transformers'
`tokenizer.apply_chat_template(..., add_generation_prompt=True)`. The template is the model's own: transformers
reads it from the tokenizer's directory (`chat_template` in `tokenizer_config.json`, or `chat_template.jinja`).
`data.apply_chat_template` null means "on where the tokenizer has a template".

The renderer hands the engine token ids, not text, and the trainer scores the ids the engine returns, so both see
the same tokens. With the template, the ids are `apply_chat_template`'s own (its text is tokenised without adding
special tokens: the template writes them); without it, the text is encoded by the run's tokenizer with its special
tokens, as the engine would encode a text prompt.

The template's end-of-turn token (`<|im_end|>`, `<|eot_id|>`, ...) is found by rendering a finished assistant turn
and taking the special token that follows its text; `template_stop_ids` adds it to the stop tokens.

A template is Jinja: one that does not parse, or that raises while rendering (templates refuse conversations they
do not take with `raise_exception`), is a `BridgeError` naming the tokenizer's directory, the template's complaint
and its line. The renderer renders one prompt when it is built (`PromptRenderer.from_config`), and the trainer
builds it before the policy is converted (`check_rendering`), so such a template is refused before anything is
written.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf_mcore_bridge.errors import BridgeError

__all__ = [
    "PromptRenderer",
    "check_prompt_template",
    "check_rendering",
    "end_of_turn_id",
    "load_hf_tokenizer",
    "template_stop_ids",
    "with_template_stop_ids",
]

_TURN_END_PROBE = "HFMCB_TURN_END_PROBE"
"""Text of the assistant turn rendered to find the end-of-turn token (not a word any tokenizer merges away)."""


def check_prompt_template(template: str) -> None:
    """Raise ValueError unless `template` is a format string whose only field is `{question}`."""
    import string

    try:
        fields = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as err:
        raise ValueError(f"data.prompt_template {template!r} is not a format string: {err}") from None
    if fields != {"question"}:
        raise ValueError(
            f"data.prompt_template must contain {{question}} and no other field, has {sorted(fields)}"
            " (write literal braces as {{ and }})"
        )


def load_hf_tokenizer(tokenizer_file: Path) -> Any:
    """transformers' tokenizer for the run's `tokenizer.json`: `AutoTokenizer` on its directory (which reads the
    chat template) where a `tokenizer_config.json` is there, else the bare file (no template)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    directory = tokenizer_file.parent
    if (directory / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(str(directory))
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file), name_or_path=str(directory))
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        tokenizer.chat_template = jinja.read_text(encoding="utf-8")
    return tokenizer


@dataclass
class PromptRenderer:
    """Questions to prompt ids, as configured under `data` (see the module docstring)."""

    tokenizer: Any
    """transformers' tokenizer (`load_hf_tokenizer`)."""
    use_chat_template: bool
    system_prompt: str | None = None
    prompt_template: str | None = None

    @classmethod
    def from_config(cls, data: Any, tokenizer: Any) -> PromptRenderer:
        """The renderer for a `DataConfig`; raises BridgeError where it asks for a template the tokenizer lacks,
        or for a system prompt without a template."""
        has_template = bool(getattr(tokenizer, "chat_template", None))
        use = has_template if data.apply_chat_template is None else data.apply_chat_template
        if use and not has_template:
            raise BridgeError(
                "data.apply_chat_template=true but the tokenizer has no chat template (no chat_template in"
                " tokenizer_config.json, no chat_template.jinja); set it false to feed prompts as raw text"
            )
        if data.system_prompt is not None and not use:
            raise BridgeError(
                "data.system_prompt needs the chat template (a system turn); without one, put the instructions"
                " into data.prompt_template"
            )
        renderer = cls(tokenizer, use, data.system_prompt, data.prompt_template)
        if use:
            renderer.text("?")  # a template that does not parse, or refuses such a conversation, says so now
        return renderer

    def messages(self, question: str) -> list[dict[str, str]]:
        """The conversation a question becomes (system turn first when there is a system prompt)."""
        content = self.prompt_template.format(question=question) if self.prompt_template else question
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt is not None else []
        return [*system, {"role": "user", "content": content}]

    def text(self, question: str) -> str:
        """The prompt as text, exactly as its ids decode."""
        if not self.use_chat_template:
            return self.messages(question)[-1]["content"]
        return _apply_template(self.tokenizer, self.messages(question), tokenize=False, add_generation_prompt=True)

    def token_ids(self, question: str) -> list[int]:
        """The ids the engine generates from."""
        if not self.use_chat_template:
            return list(self.tokenizer(self.text(question))["input_ids"])
        ids = _apply_template(
            self.tokenizer, self.messages(question), tokenize=True, add_generation_prompt=True, return_dict=False
        )
        return [int(i) for i in ids]


def _apply_template(tokenizer: Any, conversation: list[dict[str, str]], **options: Any) -> Any:
    """`tokenizer.apply_chat_template(conversation, **options)`, with the template's Jinja errors as one line."""
    from jinja2 import TemplateError, TemplateSyntaxError  # what transformers renders chat templates with

    try:
        return tokenizer.apply_chat_template(conversation, **options)
    except TemplateError as err:
        where = f" (line {err.lineno})" if isinstance(err, TemplateSyntaxError) else ""
        verb = "does not parse" if isinstance(err, TemplateSyntaxError) else "failed while rendering"
        source = getattr(tokenizer, "name_or_path", "") or "the tokenizer"
        message = " ".join(str(err.message or type(err).__name__).split())
        raise BridgeError(f"the chat template of {source} {verb}: {message}{where}") from None


def check_rendering(data: Any, tokenizer_file: Path) -> None:
    """Build the run's renderer for `data` (a `DataConfig`) once, before anything is written: raises `BridgeError`
    for a template asked for but missing, a system prompt without a template, or a template that does not parse."""
    PromptRenderer.from_config(data, load_hf_tokenizer(tokenizer_file))


def end_of_turn_id(tokenizer: Any) -> int | None:
    """The special token the chat template writes right after an assistant turn's text; None if there is none."""
    conversation = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _TURN_END_PROBE}]
    text = _apply_template(tokenizer, conversation, tokenize=False)
    _, found, after = text.partition(_TURN_END_PROBE)
    if not found or not after:
        return None
    ids = tokenizer(after, add_special_tokens=False)["input_ids"]
    special = set(tokenizer.all_special_ids) | {int(i) for i in getattr(tokenizer, "added_tokens_decoder", {})}
    return int(ids[0]) if ids and int(ids[0]) in special else None


def template_stop_ids(stop_ids: tuple[int, ...], renderer: PromptRenderer) -> tuple[int, ...]:
    """`stop_ids` plus the chat template's end-of-turn token, when the template is on and has one."""
    if not renderer.use_chat_template:
        return stop_ids
    eot = end_of_turn_id(renderer.tokenizer)
    return stop_ids if eot is None or eot in stop_ids else (*stop_ids, eot)


def with_template_stop_ids(config: Any, tokenizer_file: Path, add_end_of_turn: bool = True) -> Any:
    """`config` with the chat template's end-of-turn token added to `generation.stop_token_ids` (when
    `add_end_of_turn`, the template is on and has one). Builds the run's renderer on the way, so a template asked
    for but missing is refused here, before any rank starts: raises BridgeError as `PromptRenderer.from_config`."""
    import dataclasses

    renderer = PromptRenderer.from_config(config.data, load_hf_tokenizer(tokenizer_file))
    if not add_end_of_turn:
        return config
    stops = template_stop_ids(tuple(config.generation.stop_token_ids or ()), renderer)
    if stops == tuple(config.generation.stop_token_ids or ()):
        return config
    return dataclasses.replace(config, generation=dataclasses.replace(config.generation, stop_token_ids=stops))
