"""Up-front checks of the command line's options: paths, numbers, sizes and layouts, before any heavy import.

Each check raises `BridgeError` with one line naming the option and the problem, so a bad invocation fails in
well under a second, before torch, transformers or megatron-core load and before anything is written. The checks
are deliberately cheap (stat calls and a `config.json` read as plain JSON); the library repeats the thorough ones
(tensor shapes, the full model config) when it runs.

Paths are looked up with `checkpoint.paths`, so a symlink loop or a name longer than the file system takes is
named as such rather than passing for a missing path (or escaping as an OSError).

Assumes: only the standard library plus `hf_mcore_bridge.errors`, `.checkpoint.paths` / `.destination` and
`.convert.layout` (all torch-free) and, for `--max-shard-size`, huggingface_hub's size parser are imported here;
anything heavier would defeat the point.
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Any

from hf_mcore_bridge.checkpoint.destination import check_name_length
from hf_mcore_bridge.checkpoint.paths import lookup
from hf_mcore_bridge.convert.layout import Layout, validate_layout
from hf_mcore_bridge.errors import BridgeError
from hf_mcore_bridge.models.spec import ModelSpec

SIZE_HINT = "a byte count or a number with KB, MB, GB or TB (e.g. 500MB, 5GB)"


def existing_dir(path: Path, what: str) -> Path:
    """`path` must be an existing directory; `what` names it in the message ("source", "--tokenizer")."""
    found = lookup(path, what)
    if found is None:
        raise BridgeError(f"{what}: no such directory: {path}")
    if not stat.S_ISDIR(found.st_mode):
        raise BridgeError(f"{what}: {path} is not a directory")
    return path


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
"""Files an HF tokenizer is loaded from (fast, SentencePiece, its config, BPE vocabulary): a directory holding none
of them holds no tokenizer."""


def tokenizer_dir(path: Path) -> Path:
    """`--tokenizer`: an existing directory holding a tokenizer (not one whose files would be silently missing)."""
    existing_dir(path, "--tokenizer")
    if not any(_is_file(path / name, "--tokenizer") for name in TOKENIZER_FILES):
        raise BridgeError(f"--tokenizer: {path} holds no tokenizer files (none of {', '.join(TOKENIZER_FILES)})")
    return path


def text_with_tokenizer(text: str, hf_dir: Path) -> None:
    """`verify --text`: some text, and a tokenizer in the HF directory to read it with."""
    if not text.strip():
        raise BridgeError("--text is empty")
    if not any((hf_dir / name).is_file() for name in TOKENIZER_FILES):
        raise BridgeError(f"--text needs a tokenizer in {hf_dir} (none of {', '.join(TOKENIZER_FILES)})")


def existing_file(path: Path, what: str) -> Path:
    """`path` must be an existing regular file."""
    found = lookup(path, what)
    if found is None:
        raise BridgeError(f"{what}: no such file: {path}")
    if not stat.S_ISREG(found.st_mode):
        raise BridgeError(f"{what}: {path} is not a file")
    return path


def _is_file(path: Path, what: str) -> bool:
    found = lookup(path, what)
    return found is not None and stat.S_ISREG(found.st_mode)


def hf_model_dir(path: Path, what: str) -> dict[str, Any]:
    """A local HF model directory: it must exist and hold a readable `config.json` object, which is returned."""
    existing_dir(path, what)
    return read_json_object(path / "config.json", what)


def read_json_object(path: Path, what: str) -> dict[str, Any]:
    """A JSON file holding an object (an HF `config.json`)."""
    if not _is_file(path, what):
        raise BridgeError(f"{what}: {path} does not exist (not an HF model directory?)")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise BridgeError(f"{what}: {path} is not readable JSON: {err}") from None
    if not isinstance(data, dict):
        raise BridgeError(f"{what}: {path} does not hold a JSON object")
    return data


def hf_config_option(path: Path) -> dict[str, Any]:
    """`--hf-config`: a config.json file or a directory holding one."""
    found = lookup(path, "--hf-config")
    if found is None:
        raise BridgeError(f"--hf-config: no such file or directory: {path}")
    if stat.S_ISDIR(found.st_mode):
        path = path / "config.json"
    return read_json_object(path, "--hf-config")


def options_for_direction(direction: str, other_direction_options: dict[str, bool]) -> None:
    """Refuse an option of the other conversion direction (given: True) instead of silently ignoring it."""
    given = [name for name, was_given in other_direction_options.items() if was_given]
    if given:
        other = "--to hf" if direction == "--to mcore" else "--to mcore"
        verb = "applies" if len(given) == 1 else "apply"
        raise BridgeError(f"{', '.join(given)} {verb} to {other} only, not to {direction}")


def at_least(option: str, value: int | None, minimum: int) -> None:
    """An integer option (None: not given) must be >= `minimum`."""
    if value is not None and value < minimum:
        raise BridgeError(f"{option}={value} must be at least {minimum}")


def seq_len_fits(seq_len: int, hf_config: dict[str, Any], config_path: Path) -> None:
    """`verify --seq-len` must not exceed the model's `max_position_embeddings` (where the config states one)."""
    limit = hf_config.get("max_position_embeddings")
    if isinstance(limit, int) and not isinstance(limit, bool) and seq_len > limit:
        raise BridgeError(
            f"--seq-len {seq_len} is longer than the model's max_position_embeddings={limit} ({config_path})"
        )


def tolerance(value: float | None) -> None:
    """A logit tolerance must be a finite number >= 0."""
    if value is not None and not (math.isfinite(value) and value >= 0):
        raise BridgeError(f"--tolerance={value} must be a finite number >= 0")


def shard_size(text: str) -> int:
    """`--max-shard-size` in bytes: a plain byte count or huggingface_hub's `5GB` / `500MB` form; must be > 0.

    Parsed with the function huggingface_hub's shard splitter itself uses, so exactly what the export accepts is
    accepted here (it lives in a private module and loads no torch).
    """
    from huggingface_hub.serialization._base import parse_size_to_int

    text = text.strip()
    try:
        size = int(text) if text.isdigit() else parse_size_to_int(text)
    except ValueError:
        raise BridgeError(f"--max-shard-size {text!r} is not a size: use {SIZE_HINT}") from None
    if size <= 0:
        raise BridgeError(f"--max-shard-size {text!r} must be larger than 0 bytes")
    return size


def writable_destination(destination: Path) -> None:
    """The destination must be a directory (or absent) whose nearest existing ancestor we may create files in, and
    its name must leave room for the hidden sibling the output is built in (`check_name_length`).

    `os.access` reports a read-only mount for every user, root included; plain permission bits are ignored for root,
    which is what the kernel does too.
    """
    found = lookup(destination, "destination")
    if found is not None and not stat.S_ISDIR(found.st_mode):
        raise BridgeError(f"destination {destination} exists and is not a directory")
    parent = destination.absolute().parent
    while (parent_found := lookup(parent, "destination")) is None:
        parent = parent.parent
    if not stat.S_ISDIR(parent_found.st_mode):
        raise BridgeError(f"destination {destination}: {parent} is not a directory")
    check_name_length(destination.absolute(), destination)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise BridgeError(f"destination {destination}: cannot write in {parent} (read-only or no permission)")


def layout_fits(layout: Layout, hf_config: dict[str, Any]) -> None:
    """The layout must be buildable for the model the HF config describes (heads, groups, FFN, layers, experts):
    read into its description (`ModelSpec`, cheap: no torch), not yet refused for what megatron-core lacks."""
    validate_layout(layout, ModelSpec.from_hf(hf_config))


def grpo_paths(model_path: str, tokenizer: str | None) -> None:
    """A GRPO run's inputs: the policy directory exists; a given tokenizer is a tokenizer.json or a directory
    holding one (checked here because the run converts the policy before it opens the tokenizer)."""
    existing_dir(Path(model_path), "policy.model_path")
    if tokenizer is not None:
        path = Path(tokenizer)
        found = lookup(path, "policy.tokenizer")
        file = path / "tokenizer.json" if found is not None and stat.S_ISDIR(found.st_mode) else path
        if not _is_file(file, "policy.tokenizer"):
            raise BridgeError(f"policy.tokenizer: no such file: {file}")
