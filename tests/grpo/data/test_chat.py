"""Prompt rendering with a chat template (a tiny ChatML tokenizer built in code), against token ids written here."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from hf_mcore_bridge.errors import BridgeError
from hf_mcore_bridge.grpo.data.chat import (
    PromptRenderer,
    check_prompt_template,
    end_of_turn_id,
    load_hf_tokenizer,
    template_stop_ids,
)

from ..tiny_chat import IM_END, IM_START, build_chat_tokenizer, ids
from ..tiny_policy import build_tokenizer


def _data(**overrides: object) -> SimpleNamespace:
    fields = {"apply_chat_template": None, "system_prompt": None, "prompt_template": None}
    return SimpleNamespace(**(fields | overrides))


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory: pytest.TempPathFactory):
    return load_hf_tokenizer(build_chat_tokenizer(tmp_path_factory.mktemp("chat")) / "tokenizer.json")


def test_chat_template_with_system_prompt_and_template(chat_tokenizer) -> None:
    renderer = PromptRenderer.from_config(
        _data(system_prompt="Say 7", prompt_template="Repeat the digit {question} ."), chat_tokenizer
    )
    assert renderer.use_chat_template
    assert renderer.token_ids("3") == ids(
        IM_START, "system", "Say", "7", IM_END, IM_START, "user", "Repeat", "the", "digit", "3", ".", IM_END,
        IM_START, "assistant",
    )  # fmt: skip
    assert renderer.text("3") == (
        f"{IM_START}system\nSay 7{IM_END}\n{IM_START}user\nRepeat the digit 3 .{IM_END}\n{IM_START}assistant\n"
    )


def test_template_off_or_absent_gives_raw_text(chat_tokenizer, tmp_path: Path) -> None:
    off = PromptRenderer.from_config(
        _data(apply_chat_template=False, prompt_template="{question} Answer :"), chat_tokenizer
    )
    assert off.token_ids("Say 7") == ids("Say", "7", "Answer", ":") and off.text("Say 7") == "Say 7 Answer :"
    plain = load_hf_tokenizer(build_tokenizer(tmp_path))  # a bare tokenizer.json: no template
    assert not PromptRenderer.from_config(_data(), plain).use_chat_template


def test_end_of_turn_joins_the_stop_tokens(chat_tokenizer) -> None:
    renderer = PromptRenderer.from_config(_data(), chat_tokenizer)
    assert end_of_turn_id(chat_tokenizer) == ids(IM_END)[0]
    assert template_stop_ids((0,), renderer) == (0, *ids(IM_END))
    assert template_stop_ids((0, *ids(IM_END)), renderer) == (0, *ids(IM_END))
    off = PromptRenderer.from_config(_data(apply_chat_template=False), chat_tokenizer)
    assert template_stop_ids((0,), off) == (0,)


def test_refusals(chat_tokenizer, tmp_path: Path) -> None:
    plain = load_hf_tokenizer(build_tokenizer(tmp_path))
    with pytest.raises(BridgeError, match="no chat template"):
        PromptRenderer.from_config(_data(apply_chat_template=True), plain)
    with pytest.raises(BridgeError, match="system_prompt needs the chat template"):
        PromptRenderer.from_config(_data(apply_chat_template=False, system_prompt="x"), chat_tokenizer)
    for bad in ["no field", "{question} {other}", "{0}", "{question"]:
        with pytest.raises(ValueError, match="prompt_template"):
            check_prompt_template(bad)
    check_prompt_template("Q: {question} {{literal}}")


def test_run_without_the_asked_template_is_refused_before_any_rank(tmp_path: Path) -> None:
    from hf_mcore_bridge.grpo.run.config import config_from_dict
    from hf_mcore_bridge.grpo.run.trainer import train_grpo

    from ..tiny_policy import build_tiny_policy

    (tmp_path / "d.jsonl").write_text('{"prompt": "Say 7", "answer": "7"}\n')
    config = config_from_dict(
        {
            "policy": {
                "model_path": str(build_tiny_policy(tmp_path / "policy")),
                "megatron_cfg": {"enabled": False},
                "dtensor_cfg": {"enabled": True},
            },
            "generation": {"stop_token_ids": [0]},
            "data": {"train_jsonl": str(tmp_path / "d.jsonl"), "apply_chat_template": True},
            "reward": {"name": "number"},
            "logger": {"log_dir": str(tmp_path / "logs"), "print_progress": False},
        }
    )
    with pytest.raises(BridgeError, match=r"data\.apply_chat_template=true but the tokenizer has no chat template"):
        train_grpo(config)
    assert not (tmp_path / "logs" / "metrics.jsonl").exists()
