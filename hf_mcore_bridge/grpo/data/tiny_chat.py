"""A tiny chat model and GSM8K-format prompt files, built in code, for the CPU recipe (`examples/grpo_cpu_chat.yaml`)
and the tests: no download.

    python -m hf_mcore_bridge.grpo.data.tiny_chat OUT_DIR     # OUT_DIR/model, OUT_DIR/train.jsonl, OUT_DIR/val.jsonl

The tokenizer is word-level over `CHAT_WORDS` (digits, a few words, the ChatML tokens) and carries a ChatML chat
template in its `tokenizer_config.json`; `[EOS]` (id 0) is the EOS of the model's configs. The model is a randomly
initialised 2-layer Llama (`tiny_models.build_tiny_model`). The prompts ask to say a digit (`Say 7 7`), with
GSM8K-style solutions ending in `#### 7`: a random policy over 24 tokens says it now and then.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from hf_mcore_bridge.models.tiny_models import build_tiny_model

__all__ = ["CHAT_WORDS", "IM_END", "IM_START", "TEMPLATE", "build_chat_policy", "build_chat_tokenizer", "write_recipe"]

EOS, IM_START, IM_END = "[EOS]", "<|im_start|>", "<|im_end|>"
CHAT_WORDS = (
    EOS,
    *(str(d) for d in range(10)),
    *("Repeat", "the", "digit", ".", "Answer", ":", "Say", "[UNK]"),
    *(IM_START, IM_END, "system", "user", "assistant"),
)
"""Token id = position."""
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML, as Qwen's templates write it (without tools or thinking)."""


def build_chat_tokenizer(directory: Path) -> Path:
    """`tokenizer.json` over `CHAT_WORDS` and a `tokenizer_config.json` carrying `TEMPLATE`; returns `directory`."""
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
    return build_chat_tokenizer(directory)


def _rows(count: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        digit = str(int(rng.random() * 10))
        question = " ".join(["Say"] + [digit] * (1 + int(rng.random() * 4)))
        rows.append({"question": question, "answer": f"Say {digit} .\n#### {digit}"})
    return rows


def write_recipe(out: Path) -> Path:
    """`out/model` (the tiny chat policy), `out/train.jsonl` (256 rows) and `out/val.jsonl` (16 other rows)."""
    build_chat_policy(out / "model")
    for name, count, seed in (("train.jsonl", 256, 0), ("val.jsonl", 16, 1)):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in _rows(count, seed)))
    return out


def main(argv: list[str] | None = None) -> None:
    """The command line: one argument, a directory that is new or empty; bad arguments are one line, exit 2."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m hf_mcore_bridge.grpo.data.tiny_chat",
        description="Write the tiny chat model, its data and a GRPO recipe that trains it into OUT_DIR.",
    )
    parser.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="a new or empty directory")
    target = parser.parse_args(argv).out_dir
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        parser.exit(2, f"error: {target} is not an empty directory; give a new one\n")
    print(write_recipe(target))


if __name__ == "__main__":
    main()
