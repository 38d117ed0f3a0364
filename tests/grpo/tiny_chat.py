"""The tiny chat tokenizer and policy of `hf_mcore_bridge.grpo.data.tiny_chat`, and hand-made token ids over them."""

from __future__ import annotations

from hf_mcore_bridge.grpo.data.tiny_chat import CHAT_WORDS, IM_END, IM_START, build_chat_policy, build_chat_tokenizer

__all__ = ["IM_END", "IM_START", "build_chat_policy", "build_chat_tokenizer", "ids"]


def ids(*words: str) -> list[int]:
    """Hand-made token ids of `words` (the reference the renderer is checked against)."""
    return [CHAT_WORDS.index(w) for w in words]
