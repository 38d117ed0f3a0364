"""A tiny word-level tokenizer and Llama policy built in code (no downloads) for the GRPO tests."""

from __future__ import annotations

from pathlib import Path

from hf_mcore_bridge.models.tiny_models import build_tiny_model

EOS = "[EOS]"
WORDS = (EOS, *(str(d) for d in range(10)), "Repeat", "the", "digit", ".", "Answer", ":", "Say", "[UNK]")
"""Token id = position: `[EOS]` is 0, digit d is d + 1."""


def build_tokenizer(directory: Path) -> Path:
    """Save a word-level `tokenizer.json` over `WORDS` into `directory`."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tokenizer = Tokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.add_special_tokens([EOS])
    path = directory / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def build_tiny_policy(
    directory: Path, seed: int = 0, architecture: str = "LlamaForCausalLM", **overrides: object
) -> Path:
    """A 2-layer model (hidden 64, 8 heads, 4 KV groups; a Llama unless told) over `WORDS`, with its tokenizer."""
    overrides = {"num_hidden_layers": 2, "vocab_size": len(WORDS), **overrides}
    build_tiny_model(directory, architecture, seed=seed, **overrides)
    build_tokenizer(directory)
    return directory
