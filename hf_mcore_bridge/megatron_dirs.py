"""The Megatron-LM checkpoint directory around a distributed checkpoint.

`<root>/latest_checkpointed_iteration.txt` holds an iteration number or `release`; the checkpoint itself lives
in `<root>/iter_0000100/` or `<root>/release/` with `metadata.json`, `common.pt` (args, version, iteration,
content metadata) and the DCP files. The project also keeps the HF assets (config, generation config, tokenizer)
in `<root>/hf_assets/`, so export needs no source directory.

`common.pt` is read with `torch.load(weights_only=True)` and an explicit allow-list of the globals Megatron-LM
stores: the argparse Namespace, a few standard-library types and megatron-core's enums.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import types
from pathlib import Path
from typing import Any

import torch

from hf_mcore_bridge.errors import CheckpointError

TRACKER_NAME = "latest_checkpointed_iteration.txt"
COMMON_NAME = "common.pt"
METADATA_NAME = "metadata.json"
HF_ASSETS_DIR = "hf_assets"
CHECKPOINT_VERSION = 3.0
TORCH_DIST_METADATA = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}
CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
"""What Megatron-LM records for a model-only checkpoint (no distributed optimizer state)."""


def iteration_dirname(iteration: int | None) -> str:
    """`release` for None, else `iter_0000042`."""
    return "release" if iteration is None else f"iter_{iteration:07d}"


def write_tracker(root: Path, iteration: int | None) -> None:
    """Write `latest_checkpointed_iteration.txt`."""
    (root / TRACKER_NAME).write_text("release" if iteration is None else str(iteration))


def publish_iteration(staging: Path, final: Path, root: Path, iteration: int) -> None:
    """Rename a finished staging directory to `final` (replacing an older one) and only then point the tracker
    at it, so that an interrupted save leaves the previous checkpoint current."""
    if final.exists():
        shutil.rmtree(final)
    staging.rename(final)
    write_tracker(root, iteration)


def write_common(checkpoint_dir: Path, args: argparse.Namespace, iteration: int, extra: dict[str, Any] | None = None):
    """Write `common.pt` and `metadata.json` as megatron-core 0.16 / Megatron-LM do."""
    common = {
        "args": args,
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": iteration,
        "content_metadata": dict(CONTENT_METADATA),
        "num_floating_point_operations_so_far": 0,
        **(extra or {}),
    }
    with (checkpoint_dir / COMMON_NAME).open("wb") as handle:  # closed on failure (see legacy_format.write_legacy)
        torch.save(common, handle)
    (checkpoint_dir / METADATA_NAME).write_text(json.dumps(TORCH_DIST_METADATA))


_BASIC_GLOBALS: list[Any] = [argparse.Namespace, types.SimpleNamespace, pathlib.PosixPath]


def _safe_globals() -> list[Any]:
    allowed: list[Any] = list(_BASIC_GLOBALS)
    try:
        from megatron.core.enums import ModelType
        from megatron.core.transformer.enums import AttnBackend, AttnMaskType, CudaGraphScope

        allowed += [ModelType, AttnBackend, AttnMaskType, CudaGraphScope]
    except ImportError:  # pragma: no cover - megatron-core is a dependency; older versions lack some enums
        pass
    return allowed


def safe_torch_load(path: Path, *, mmap: bool = False) -> Any:
    """`torch.load(weights_only=True)` with the allow-list above; a one-line error when it fails.

    megatron-core's enums are only imported (a few seconds) when the file actually refers to one.
    """
    try:
        needed = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        allowed = _safe_globals() if any(name.startswith("megatron.") for name in needed) else _BASIC_GLOBALS
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist") from None
    except Exception as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"{path} is unreadable: {first_line}") from None


def read_common(checkpoint_dir: Path) -> dict[str, Any]:
    """The common state dict of a distributed checkpoint (`common.pt`)."""
    common = safe_torch_load(checkpoint_dir / COMMON_NAME)
    if not isinstance(common, dict):
        raise CheckpointError(f"{checkpoint_dir / COMMON_NAME} does not hold a dict")
    return common


def resolve_checkpoint(path: Path, iteration: int | None = None) -> tuple[Path, Path]:
    """(root, checkpoint dir) for a Megatron checkpoint given as its root or as an `iter_*`/`release` dir.

    `iteration` picks one of several saved iterations; otherwise the tracker file decides.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory")
    if (
        (path / METADATA_NAME).exists()
        or (path / COMMON_NAME).exists()
        or path.name.startswith("iter_")
        or (path.name == "release" and not (path / TRACKER_NAME).exists())
    ):
        return path.parent, path
    if iteration is not None:
        candidate = path / iteration_dirname(iteration)
        if not candidate.is_dir():
            available = sorted(p.name for p in path.iterdir() if p.name.startswith(("iter_", "release")))
            raise CheckpointError(f"{path} has no iteration {iteration}; it has {', '.join(available) or 'none'}")
        return path, candidate
    tracker = path / TRACKER_NAME
    if not tracker.exists():
        raise CheckpointError(f"{path} is not a Megatron checkpoint (no {TRACKER_NAME}, no metadata.json)")
    text = tracker.read_text().strip()
    if text == "release":
        return path, path / "release"
    if not text.isdigit():
        raise CheckpointError(f"{tracker} holds {text!r}, neither an iteration number nor 'release'")
    checkpoint = path / iteration_dirname(int(text))
    if not checkpoint.is_dir():
        raise CheckpointError(f"{tracker} names iteration {text}, but {checkpoint.name} does not exist")
    return path, checkpoint


def hf_assets_dir(root: Path, checkpoint_dir: Path) -> Path | None:
    """Where the HF assets of a checkpoint are kept, if they are."""
    for candidate in (root / HF_ASSETS_DIR, checkpoint_dir / HF_ASSETS_DIR):
        if (candidate / "config.json").exists():
            return candidate
    return None
