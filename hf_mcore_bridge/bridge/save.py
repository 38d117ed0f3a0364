"""`save_hf`: a live megatron-core model written as an HF directory (sharded safetensors, config, tokenizer).

Every rank runs the export stream (`export.export_hf_weights`, collective); global rank 0 writes. The shards are
planned before any tensor is made, from the names, shapes and dtypes every rank knows (`ExportPlan.specs`, split
by `huggingface_hub`'s sharding on sizes), so each file's header is written first and each tensor is written at
its place as it arrives: rank 0 holds one tensor at a time. The config is the source's, with the written dtype
and, for FP8 blocks, their `quantization_config` (a source's own is dropped otherwise); tokenizer, generation
config and the other HF assets are copied from the source directory.

The destination is checked first, as every writing command does (`destination.check_destination`: never a
source, never what this tool did not write unless `overwrite_foreign`), and the files are assembled in a temporary
sibling renamed into place when complete (`written_atomically`). A failure on rank 0 is reported on every rank
(after the stream is drained, so that no rank waits in a collective).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from hf_mcore_bridge.bridge.export import Spec, export_hf_weights, export_plan, fp8_export
from hf_mcore_bridge.checkpoint import dtypes
from hf_mcore_bridge.checkpoint.destination import check_destination, real_path
from hf_mcore_bridge.checkpoint.hf_dir import ASSET_FILES, INDEX_NAME, SINGLE_NAME
from hf_mcore_bridge.checkpoint.safetensors_stream import SafetensorsLayout
from hf_mcore_bridge.checkpoint.write_errors import written_atomically
from hf_mcore_bridge.errors import BridgeError
from hf_mcore_bridge.models.spec import ModelSpec

if TYPE_CHECKING:
    import torch

    from hf_mcore_bridge.convert.fp8_checkpoint import Fp8Export


def save_hf(
    models: Any,
    model_cfg: ModelSpec,
    out_dir: Path | str,
    *,
    hf_config: Mapping[str, Any],
    assets_dir: Path | None,
    dtype: torch.dtype | None = None,
    fp8: bool = False,
    fp8_scale_format: str = "ue8m0",
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
    overwrite_foreign: bool = False,
) -> Path:
    """Write `models` to `out_dir` as an HF directory (collective: call on every rank). Returns `out_dir`."""
    import torch.distributed as dist

    out_dir = Path(out_dir)
    rank0 = dist.get_rank() == 0
    sources = [assets_dir] if assets_dir is not None else []
    refusal = _agreed(_refusal(out_dir, sources, overwrite, overwrite_foreign) if rank0 else None)
    if refusal is not None:
        raise BridgeError(refusal)
    plan = export_plan(models, model_cfg)
    quantizer = fp8_export(plan, fp8_scale_format) if fp8 else None
    stream = export_hf_weights(models, model_cfg, dtype=dtype, fp8=fp8, fp8_scale_format=fp8_scale_format)
    failure: Exception | None = None
    try:
        if rank0:
            specs = plan.specs(dtype, quantizer)
            config = _config(hf_config, specs, dtype, quantizer)
            options = {"overwrite": overwrite, "overwrite_foreign": overwrite_foreign, "sources": sources}
            _write(out_dir, stream, specs, config, assets_dir, max_shard_size, options)
    except Exception as err:
        failure = err
    finally:
        for _ in stream:  # the other ranks take part in its collectives until it ends
            pass
    message = _agreed(None if failure is None else f"writing {out_dir} failed on rank 0: {failure}")
    if failure is not None:
        raise failure
    if message is not None:
        raise BridgeError(message)
    return out_dir


def _refusal(out_dir: Path, sources: list[Path], overwrite: bool, overwrite_foreign: bool) -> str | None:
    try:
        check_destination(out_dir, sources, overwrite=overwrite, overwrite_foreign=overwrite_foreign)
    except BridgeError as err:
        return str(err)
    return None


def _agreed(error: str | None) -> str | None:
    """Global rank 0's `error` (or None), on every rank (collective)."""
    import torch.distributed as dist

    holder = [error]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def _config(
    hf_config: Mapping[str, Any], specs: list[Spec], dtype: torch.dtype | None, quantizer: Fp8Export | None
) -> dict[str, Any]:
    """The source config with the written dtype, and the FP8 blocks' `quantization_config` (or none)."""
    config = {key: value for key, value in hf_config.items() if key != "quantization_config"}
    written = dtype if dtype is not None else specs[0][2]  # the word embeddings: never FP8 nor kept in float32
    config["dtype" if "dtype" in config else "torch_dtype"] = dtypes.of(written).name
    if quantizer is not None:
        config["quantization_config"] = quantizer.quantization_config()
    return config


def _write(
    out_dir: Path,
    stream: Iterable[tuple[str, torch.Tensor]],
    specs: list[Spec],
    config: dict[str, Any],
    assets_dir: Path | None,
    max_shard_size: int | str,
    options: dict[str, Any],
) -> None:
    """Shard, then write each tensor at its place as the stream yields it."""
    from huggingface_hub.serialization import split_state_dict_into_shards_factory

    sizes = {name: _nbytes(shape, dtype) for name, shape, dtype in specs}
    split = split_state_dict_into_shards_factory(
        sizes,
        get_storage_size=lambda nbytes: nbytes,
        max_shard_size=max_shard_size,
        filename_pattern="model{suffix}.safetensors",
    )
    by_name = {name: (shape, dtype) for name, shape, dtype in specs}
    record = {"command": "save_hf", "sources": [str(real_path(s)) for s in options["sources"]]}
    with written_atomically(out_dir, record=record, **options) as staging:
        files = split.filename_to_tensors.items()
        layouts = {file: SafetensorsLayout([(n, *by_name[n]) for n in names]) for file, names in files}
        handles: dict[str, BinaryIO] = {file: (staging / file).open("wb") for file in layouts}
        try:
            for file, layout in layouts.items():
                handles[file].write(layout.header)
            written = 0
            for name, tensor in stream:
                _put(handles, layouts, split.tensor_to_filename[name], name, tensor, by_name[name])
                written += 1
        finally:
            for handle in handles.values():
                handle.close()
        if written != len(specs):
            raise BridgeError(f"the export stream gave {written} tensors where {len(specs)} were planned")
        if split.is_sharded:
            index = {"metadata": dict(split.metadata), "weight_map": dict(split.tensor_to_filename)}
            (staging / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        elif SINGLE_NAME not in layouts:
            (staging / next(iter(layouts))).rename(staging / SINGLE_NAME)
        _copy_assets(assets_dir, staging)
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _put(
    handles: dict[str, BinaryIO],
    layouts: dict[str, SafetensorsLayout],
    file: str,
    name: str,
    tensor: torch.Tensor,
    spec: tuple[tuple[int, ...], torch.dtype],
) -> None:
    import torch

    if tuple(tensor.shape) != spec[0] or tensor.dtype != spec[1]:
        raise BridgeError(f"{name}: the stream gave {tuple(tensor.shape)} {tensor.dtype}, planned {spec[0]} {spec[1]}")
    offset, length = layouts[file].place(name)
    data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
    assert data.nbytes == length
    handles[file].seek(offset)
    handles[file].write(memoryview(data))


def _copy_assets(assets_dir: Path | None, staging: Path) -> None:
    """Tokenizer, generation config and the other HF assets of the source (its config is rewritten)."""
    if assets_dir is None:
        return
    for name in ASSET_FILES:
        source = assets_dir / name
        if name != "config.json" and source.is_file():
            shutil.copy2(source, staging / name)


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    count = dtypes.of(dtype).itemsize
    for size in shape:
        count *= size
    return count
