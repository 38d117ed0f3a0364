"""A tiny word-level tokenizer with a ChatML chat template, and a Llama policy over it, built in code."""

from __future__ import annotations

import json
from pathlib import Path

from hf_mcore_bridge.tiny_models import build_tiny_model

from .tiny_policy import EOS, WORDS

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
CHAT_WORDS = (*WORDS, IM_START, IM_END, "system", "user", "assistant")
"""Token id = position: the policy's `WORDS` first, then the template's tokens."""
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_chat_tokenizer(directory: Path) -> Path:
    """`tokenizer.json` over `CHAT_WORDS` plus a `tokenizer_config.json` carrying the template; `[EOS]` is EOS."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(WordLevel({w: i for i, w in enumerate(CHAT_WORDS)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.add_special_tokens([EOS, IM_START, IM_END])
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "chat_template": TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def build_chat_policy(directory: Path, seed: int = 0) -> Path:
    """A 2-layer Llama over `CHAT_WORDS` with the chat tokenizer; its configs name `[EOS]` (id 0) as EOS."""
    build_tiny_model(directory, "LlamaForCausalLM", seed=seed, num_hidden_layers=2, vocab_size=len(CHAT_WORDS))
    for name in ("config.json", "generation_config.json"):  # transformers writes Llama's defaults (eos 2, bos 1)
        path = directory / name
        if path.exists():
            path.write_text(json.dumps(json.loads(path.read_text()) | {"eos_token_id": 0, "bos_token_id": None}))
    build_chat_tokenizer(directory)
    return directory


def ids(*words: str) -> list[int]:
    """Hand-made token ids of `words` (the reference the renderer is checked against)."""
    return [CHAT_WORDS.index(w) for w in words]
