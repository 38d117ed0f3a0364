"""The stop tokens of a GRPO run: `generation.stop_token_ids` when set, else the model's own EOS ids.

The EOS ids are looked up as transformers' `generate` finds them: `eos_token_id` of the model directory's
`generation_config.json` (an int or a list), else of its `config.json`, else the tokenizer's EOS token (`eos_token`
in the `tokenizer_config.json` beside the `tokenizer.json` in use, a string or an `AddedToken` dict, mapped to its
id by that `tokenizer.json`). The model directory is `policy.model_path` when it is an HF directory, or the HF
assets a converted Megatron checkpoint keeps (`hf_assets/`).

Finding none is an error rather than an empty default: without a stop token every completion runs to
`max_new_tokens`, and the policy is rewarded and trained on whatever it writes after its answer. An explicit
`stop_token_ids: []` still asks for exactly that.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hf_mcore_bridge.errors import BridgeError

if TYPE_CHECKING:
    from hf_mcore_bridge.grpo.run.config import GRPOConfig

__all__ = ["eos_token_ids", "model_assets_dir", "stop_token_ids", "with_stop_token_ids"]


def model_assets_dir(model_path: Path) -> Path | None:
    """The directory holding the model's HF config files: an HF directory itself, or a Megatron checkpoint's
    stored assets; None when there is none (or the path does not exist)."""
    if (model_path / "config.json").is_file():
        return model_path
    from hf_mcore_bridge.checkpoint.megatron_dirs import hf_assets_dir, resolve_checkpoint

    try:
        root, checkpoint_dir = resolve_checkpoint(model_path)
    except BridgeError:
        return None
    return hf_assets_dir(root, checkpoint_dir)


def _json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise BridgeError(f"{path} could not be read as JSON: {err}") from None
    return data if isinstance(data, dict) else {}


def _ids(value: Any, where: Path) -> tuple[int, ...]:
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise BridgeError(f"{where}: eos_token_id must be a token id or a list of them, got {value!r}")
    return tuple(dict.fromkeys(values))


def _tokenizer_eos(tokenizer_file: Path) -> tuple[int, ...]:
    token = _json(tokenizer_file.parent / "tokenizer_config.json").get("eos_token")
    if isinstance(token, dict):
        token = token.get("content")
    if not isinstance(token, str) or not tokenizer_file.is_file():
        return ()
    from tokenizers import Tokenizer

    token_id = Tokenizer.from_file(str(tokenizer_file)).token_to_id(token)
    return () if token_id is None else (token_id,)


def eos_token_ids(assets: Path | None, tokenizer: str | None) -> tuple[int, ...]:
    """The model's EOS ids from its `generation_config.json`, `config.json` or tokenizer, in that order; () if
    none declares one. `tokenizer` is `policy.tokenizer` (a `tokenizer.json` or a directory holding one)."""
    for name in ("generation_config.json", "config.json"):
        if assets is not None:
            value = _json(assets / name).get("eos_token_id")
            if value is not None and value != []:
                return _ids(value, assets / name)
    if tokenizer is not None:
        given = Path(tokenizer)
        return _tokenizer_eos(given / "tokenizer.json" if given.is_dir() else given)
    return _tokenizer_eos(assets / "tokenizer.json") if assets is not None else ()


def stop_token_ids(config: GRPOConfig) -> tuple[int, ...]:
    """`generation.stop_token_ids` if set, else the model's EOS ids; raises `GRPOConfigError` if there are none."""
    from hf_mcore_bridge.grpo.errors import GRPOConfigError

    if config.generation.stop_token_ids is not None:
        return config.generation.stop_token_ids
    path = Path(config.policy.model_path)
    if not path.exists():
        raise GRPOConfigError(f"policy.model_path {path} does not exist")
    try:
        found = eos_token_ids(model_assets_dir(path), config.policy.tokenizer)
    except BridgeError as err:
        raise GRPOConfigError(f"generation.stop_token_ids: {err}") from None
    if not found:
        raise GRPOConfigError(
            f"generation.stop_token_ids is not set and {path} declares no EOS token (no eos_token_id in"
            " generation_config.json or config.json, no eos_token in tokenizer_config.json); set"
            " generation.stop_token_ids (e.g. [2]), or [] to generate every completion to max_new_tokens"
        )
    return found


def with_stop_token_ids(config: GRPOConfig) -> GRPOConfig:
    """`config` with `generation.stop_token_ids` filled in (see `stop_token_ids`)."""
    generation = dataclasses.replace(config.generation, stop_token_ids=stop_token_ids(config))
    return dataclasses.replace(config, generation=generation)
