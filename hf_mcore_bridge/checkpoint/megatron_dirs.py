"""The Megatron-LM checkpoint directory around a distributed checkpoint.

`<root>/latest_checkpointed_iteration.txt` holds an iteration number or `release`; the checkpoint itself lives
in `<root>/iter_0000100/` or `<root>/release/` with `metadata.json`, `common.pt` (args, version, iteration,
content metadata) and the DCP files. The project also keeps the HF assets (config, generation config, tokenizer)
in `<root>/hf_assets/`, so export needs no source directory.

Where the common state lives depends on the megatron-core release that saved it (read from Megatron-LM's source,
tags core_v0.16.1 to core_v0.19.0, `megatron/core/dist_checkpointing/serialization.py`, `strategies/common.py`,
`core.py`):

- 0.16, 0.17, 0.18: `common.pt` beside the DCP files; `metadata.json` names `common_backend: torch` (version 1).
- 0.19: no `common.pt`: the dict is a ShardedObject `common_state` (global shape (1,), offset (0,)), so a DCP
  bytes item `common_state/shard_0_1` holding `torch.save([common_dict])`; `metadata.json` has only the sharded
  backend and its version. 0.19 still reads a `common.pt` where one exists.

`common.pt` and the `common_state` item are read with `torch.load(weights_only=True)` and an explicit allow-list of
the globals Megatron-LM stores: the argparse Namespace, a few standard-library types and megatron-core's enums.
`read_common(torch_free=True)` reads a common state of plain values without importing torch (`plain_load`, dtypes
as `dtypes.DType`), falling back to `torch.load` for anything else.
"""

from __future__ import annotations

import argparse
import io
import json
import pathlib
import shutil
import types
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import IO, Any

from hf_mcore_bridge.checkpoint.dcp_reader import DCPCheckpoint
from hf_mcore_bridge.checkpoint.dcp_writer import ObjectItem, saved
from hf_mcore_bridge.checkpoint.pickles import refused_globals
from hf_mcore_bridge.checkpoint.plain_load import load_plain
from hf_mcore_bridge.errors import CheckpointError

TRACKER_NAME = "latest_checkpointed_iteration.txt"
LATEST_TRAIN_STATE = "latest_train_state.pt"
"""Megatron-Bridge's tracker of the newest step, where Megatron-LM has `TRACKER_NAME`."""
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

MCORE_VERSIONS = (16, 17, 18, 19)
"""megatron-core minor releases (0.16 .. 0.19) whose checkpoint layout can be written."""
COMMON_IN_DCP_SINCE = 19
"""The first megatron-core minor release that keeps the common state inside the DCP files."""
COMMON_STATE_KEY = "common_state/shard_0_1"
"""The DCP item of megatron-core >= 0.19's common state (ShardedObject `common_state`, shape (1,), offset (0,))."""


def installed_mcore_version() -> int:
    """The installed megatron-core's minor release, clamped to `MCORE_VERSIONS` (read from the package metadata,
    without importing megatron-core)."""
    try:
        version = importlib_metadata.version("megatron-core")
    except importlib_metadata.PackageNotFoundError:
        return MCORE_VERSIONS[0]
    parts = version.split(".")
    minor = int(parts[1]) if len(parts) > 1 and parts[0] == "0" and parts[1].isdigit() else MCORE_VERSIONS[-1]
    return min(max(minor, MCORE_VERSIONS[0]), MCORE_VERSIONS[-1])


def metadata_json(mcore_version: int) -> dict[str, Any]:
    """What `metadata.json` holds for a checkpoint saved by megatron-core 0.`mcore_version`."""
    if mcore_version >= COMMON_IN_DCP_SINCE:
        return {"sharded_backend": "torch_dist", "sharded_backend_version": 1}
    return dict(TORCH_DIST_METADATA)


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


def common_state(args: argparse.Namespace, iteration: int, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The common (non-sharded) state dict Megatron-LM saves beside a model."""
    return {
        "args": args,
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": iteration,
        "content_metadata": dict(CONTENT_METADATA),
        "num_floating_point_operations_so_far": 0,
        **(extra or {}),
    }


def common_objects(common: dict[str, Any], mcore_version: int) -> list[ObjectItem]:
    """The DCP items that carry the common state (none before megatron-core 0.19, where `common.pt` does)."""
    if mcore_version < COMMON_IN_DCP_SINCE:
        return []
    return [ObjectItem(COMMON_STATE_KEY, [common])]


def write_common(
    checkpoint_dir: Path, common: dict[str, Any], mcore_version: int = MCORE_VERSIONS[0], *, by_torch: bool = False
) -> None:
    """Write `metadata.json` and, before megatron-core 0.19, `common.pt` (0.19 takes the common state from the DCP
    item `common_objects` gave); `by_torch`: `common.pt` by `torch.save` itself (`dcp_writer.saved`)."""
    if mcore_version < COMMON_IN_DCP_SINCE:
        (checkpoint_dir / COMMON_NAME).write_bytes(saved(common, by_torch=by_torch))
    (checkpoint_dir / METADATA_NAME).write_text(json.dumps(metadata_json(mcore_version)))


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


def _load_allowed(source: Path | IO[bytes], where: str, *, mmap: bool = False) -> Any:
    """`torch.load(weights_only=True)` with the allow-list above; megatron-core's enums are only imported (a few
    seconds) when the payload actually refers to one. A pickle naming anything else is a `CheckpointError` naming
    it (and `where` the payload is)."""
    import torch

    needed = torch.serialization.get_unsafe_globals_in_checkpoint(source)
    if not isinstance(source, Path):
        source.seek(0)
    allowed = _safe_globals() if any(name.startswith("megatron.") for name in needed) else _BASIC_GLOBALS
    with torch.serialization.safe_globals(allowed):
        if not isinstance(source, Path):
            source.seek(0)
        try:
            return torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)
        except Exception as err:
            refused = refused_globals(source, err)
            if refused is None:
                raise
            raise CheckpointError(f"{where} {refused}") from None


def _first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def safe_torch_load(path: Path, *, mmap: bool = False) -> Any:
    """`torch.load(weights_only=True)` with the allow-list above; a one-line error when it fails."""
    try:
        return _load_allowed(Path(path), str(path), mmap=mmap)
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist") from None
    except CheckpointError:
        raise
    except Exception as err:
        raise CheckpointError(f"{path} is unreadable: {_first_line(err)}") from None


def read_common(checkpoint_dir: Path, *, torch_free: bool = False) -> dict[str, Any]:
    """The common state dict of a distributed checkpoint: `common.pt` where there is one (megatron-core <= 0.18,
    and what 0.19 also prefers), else the DCP item `common_state/shard_0_1` (megatron-core >= 0.19).

    `torch_free`: without importing torch where the state holds only plain values (dtypes then read as
    `dtypes.DType`, e.g. `args.params_dtype`); anything else is loaded with torch as without it."""
    if (checkpoint_dir / COMMON_NAME).exists():
        where = str(checkpoint_dir / COMMON_NAME)
        common = _plain(checkpoint_dir / COMMON_NAME) if torch_free else None
        if common is None:
            common = safe_torch_load(checkpoint_dir / COMMON_NAME)
    else:
        common, where = _common_in_dcp(checkpoint_dir, torch_free)
    if not isinstance(common, dict):
        raise CheckpointError(f"{where} does not hold a dict")
    return common


def check_installed_reads(checkpoint_dir: Path) -> None:
    """Refuse, with the reason, a `torch_dist` checkpoint whose common state the installed megatron-core cannot
    read: the 0.19 layout (no `common.pt`) under megatron-core <= 0.18, which looks for `common.pt` only."""
    if (checkpoint_dir / COMMON_NAME).exists() or installed_mcore_version() >= COMMON_IN_DCP_SINCE:
        return
    installed = importlib_metadata.version("megatron-core")
    raise CheckpointError(
        f"{checkpoint_dir} keeps its common state in the DCP files (megatron-core >= 0.19 layout), which the"
        f" installed megatron-core {installed} cannot load; write it with --mcore-version 0.{installed_mcore_version()}"
    )


def _plain(source: Path | bytes) -> Any:
    """The archive's object read without torch, or None where that cannot be done (the caller uses torch)."""
    try:
        return load_plain(source)
    except Exception:  # NeedsTorch, or a damaged archive: torch.load then reports it as it always does
        return None


def _common_in_dcp(checkpoint_dir: Path, torch_free: bool = False) -> tuple[Any, str]:
    config = _read_metadata_json(checkpoint_dir)
    if config is not None and "common_backend" in config:
        raise CheckpointError(
            f"{checkpoint_dir} lacks {COMMON_NAME}, which its {METADATA_NAME} (megatron-core <= 0.18 layout) calls for"
        )
    where = f"{checkpoint_dir / '.metadata'} item {COMMON_STATE_KEY}"
    if not (checkpoint_dir / ".metadata").exists():
        raise CheckpointError(f"{checkpoint_dir} has neither {COMMON_NAME} nor DCP files holding the common state")
    dcp = DCPCheckpoint(checkpoint_dir)
    if COMMON_STATE_KEY not in dcp.object_keys():
        raise CheckpointError(f"{checkpoint_dir} has neither {COMMON_NAME} nor a DCP item {COMMON_STATE_KEY}")
    payload = dcp.read_bytes(COMMON_STATE_KEY)
    try:
        loaded = _plain(payload) if torch_free else None
        if loaded is None:
            loaded = _load_allowed(io.BytesIO(payload), where)
    except CheckpointError:
        raise
    except Exception as err:
        raise CheckpointError(f"{where} is unreadable: {_first_line(err)}") from None
    if not (isinstance(loaded, list) and len(loaded) == 1):
        raise CheckpointError(f"{where} does not hold megatron-core's one-element list")
    return loaded[0], where


def _read_metadata_json(checkpoint_dir: Path) -> dict[str, Any] | None:
    path = checkpoint_dir / METADATA_NAME
    if not path.exists():
        return None
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path} is unreadable: {_first_line(err)}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} does not hold a JSON object")
    return config


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
        step = bridge_latest_step(path)  # Megatron-Bridge's own tracker
        if step is not None and (path / iteration_dirname(step)).is_dir():
            return path, path / iteration_dirname(step)
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


def bridge_latest_step(root: Path) -> int | None:
    """The step Megatron-Bridge's `latest_train_state.pt` records (None without one)."""
    path = root / LATEST_TRAIN_STATE
    if not path.is_file():
        return None
    try:
        import torch

        state = torch.load(path, map_location="cpu", weights_only=True)
        return int(state["step"])
    except Exception as err:
        raise CheckpointError(f"{path} is unreadable: {str(err).strip().splitlines()[0]}") from None
