"""HF checkpoints of blockwise FP8 weights, as DeepSeek-V3 and Kimi-K2 are published: e4m3 weights with a float32
`weight_scale_inv` per 128 x 128 block, announced by the config's `quantization_config`.

Reading (`open_hf_checkpoint`): such a checkpoint is read through `Fp8Checkpoint`, which shows every FP8 weight as
its bfloat16 dequantization (`fp8_blocks.dequantize_rows`) and hides the scales. Row ranges are dequantized as
they are read, `SPAN_ROWS` rows at a time into the bfloat16 result, so conversion streams and its memory stays
bounded as for any checkpoint (no float32 copy of a whole weight). Only what DeepSeek
publishes is taken: `quant_method: fp8`, `fmt: e4m3`, `weight_block_size: [128, 128]`, dynamic activation scales;
other quantization configs are refused by name, and so is a weight without its scale or a scale without its
weight.

Writing (`Fp8Export`): export with `--fp8-blockwise` quantizes the linear layers' weights (the table's column- and
row-parallel tensors; embeddings, output layer, norms and router stay in the export dtype) to e4m3 with
power-of-two scales (`scale_fmt: ue8m0`, as DeepSeek-V3.1 publishes) and writes `quantization_config`. Weights that
came from such blocks (a checkpoint with power-of-two scales, dequantized on import) are exactly representable, so
their dequantized FP8 export equals the bfloat16 export bit for bit (the blocks' encodings may differ from the
source's: a block whose largest |q| is 224 at scale s is written as 448 at s / 2, the smallest scale that fits);
other weights get the nearest e4m3 values.
Float32 scales (DeepSeek-V3's) cannot be kept through bfloat16: importing them rounds `q * scale` to bfloat16.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hf_mcore_bridge.checkpoint import dtypes
from hf_mcore_bridge.checkpoint.hf_dir import HFCheckpoint, TensorInfo
from hf_mcore_bridge.convert.config_errors import ConfigError
from hf_mcore_bridge.convert.fp8_geometry import BLOCK, scale_shape
from hf_mcore_bridge.convert.mapping_types import Entry
from hf_mcore_bridge.convert.parallel_style import Parallel
from hf_mcore_bridge.errors import CheckpointError

if TYPE_CHECKING:
    import torch

SCALE_SUFFIX = "_scale_inv"
"""`<name>.weight` is scaled by `<name>.weight_scale_inv`."""
DEQUANTIZED_DTYPE = dtypes.BFLOAT16
SPAN_ROWS = 8 * BLOCK
"""Rows dequantized (or quantized) at a time: the float32 temporaries stay a few MB whatever the weight."""
Spec = tuple[str, tuple[int, ...], dtypes.DType]
"""(name, shape, dtype) of a tensor to write."""
QUANTIZED_STYLES = (Parallel.COLUMN, Parallel.GATED_COLUMN, Parallel.ROW)
"""The linear layers (tensor-parallel in megatron-core) are what published FP8 checkpoints hold in FP8."""
EXPORT_QUANTIZATION_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [BLOCK, BLOCK],
    "scale_fmt": "ue8m0",
}
"""The `quantization_config` written with `--fp8-blockwise`."""


def is_fp8_config(config: Mapping[str, Any]) -> bool:
    """Whether the config announces blockwise FP8 weights; any other quantization is refused by name."""
    quantization = config.get("quantization_config")
    if quantization is None:
        return False
    if not isinstance(quantization, Mapping):
        raise ConfigError(f"config field quantization_config={quantization!r} is not a mapping")
    expected = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    for field, value in expected.items():
        if quantization.get(field, value) != value:
            raise ConfigError(
                f"config field quantization_config.{field}={quantization.get(field)!r} is not supported "
                f"(only {value!r}: blockwise FP8 as DeepSeek publishes it)"
            )
    if list(quantization.get("weight_block_size") or []) != [BLOCK, BLOCK]:
        raise ConfigError(
            f"config field quantization_config.weight_block_size={quantization.get('weight_block_size')!r} is not "
            f"supported (only [{BLOCK}, {BLOCK}])"
        )
    if quantization.get("scale_fmt", "ue8m0") not in ("ue8m0", "float32"):
        raise ConfigError(f"config field quantization_config.scale_fmt={quantization['scale_fmt']!r} is not supported")
    return True


class Fp8Checkpoint(HFCheckpoint):
    """An HF directory of blockwise FP8 weights, read as bfloat16 (scales hidden, dequantized on read)."""

    def __init__(self, path: Path | str, *, allow_pickle: bool = False):
        super().__init__(path, allow_pickle=allow_pickle)
        every = super().names()
        self.scales: dict[str, str] = {}
        """FP8 weight -> its scale tensor."""
        for name in sorted(every):
            info = super().info(name)
            scale = name + SCALE_SUFFIX
            if name.endswith(SCALE_SUFFIX):
                weight = name.removesuffix(SCALE_SUFFIX)
                if weight not in every or super().info(weight).dtype != dtypes.FLOAT8_E4M3:
                    raise CheckpointError(f"{name} in {info.file.name} scales no FP8 weight {weight}")
                continue
            if info.dtype != dtypes.FLOAT8_E4M3:
                continue
            if scale not in every:
                raise CheckpointError(f"{name} in {info.file.name} is FP8 but the checkpoint has no {scale}")
            if len(info.shape) != 2 or super().info(scale).shape != scale_shape(info.shape):
                raise CheckpointError(
                    f"{scale} has shape {super().info(scale).shape}, but {name} {info.shape} in {BLOCK} x {BLOCK} "
                    f"blocks needs {scale_shape(info.shape) if len(info.shape) == 2 else 'a 2-D weight'}"
                )
            self.scales[name] = scale

    def names(self) -> set[str]:
        return super().names() - set(self.scales.values())

    def info(self, name: str) -> TensorInfo:
        info = super().info(name)
        return replace(info, dtype=DEQUANTIZED_DTYPE) if name in self.scales else info

    def location(self, name: str) -> tuple[Path, int] | None:
        """As `HFCheckpoint.location`; None for an FP8 weight, whose stored bytes are not its bfloat16 values."""
        return None if name in self.scales else super().location(name)

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """As `HFCheckpoint.read`; an FP8 weight is dequantized `SPAN_ROWS` rows at a time into its output."""
        import torch

        from hf_mcore_bridge.convert.fp8_blocks import dequantize_rows

        if name not in self.scales:
            return super().read(name, rows)
        start, stop = rows if rows is not None else (0, super().info(name).shape[0])
        out = torch.empty((stop - start, *super().info(name).shape[1:]), dtype=DEQUANTIZED_DTYPE.torch)
        for first, last in _spans(start, stop):
            q = super().read(name, (first, last))
            block_scales = super().read(self.scales[name], (first // BLOCK, -(-last // BLOCK)))
            out[first - start : last - start] = dequantize_rows(q, block_scales, first, DEQUANTIZED_DTYPE.torch)
        return out

    def note(self) -> str:
        """What reading this checkpoint does, in one line."""
        return (
            f"{len(self.scales)} FP8 weights ({BLOCK} x {BLOCK} blocks with weight_scale_inv) dequantized to "
            f"{DEQUANTIZED_DTYPE.name}"
        )


def open_hf_checkpoint(path: Path | str, *, allow_pickle: bool = False) -> HFCheckpoint:
    """An HF directory, read through `Fp8Checkpoint` where its config announces blockwise FP8 weights."""
    plain = HFCheckpoint(path, allow_pickle=allow_pickle)
    return Fp8Checkpoint(path, allow_pickle=allow_pickle) if is_fp8_config(plain.config) else plain


class Fp8Export:
    """Which exported HF tensors become FP8 blocks, and their planned shapes and values."""

    def __init__(self, entries: Iterable[Entry]):
        self.names = {
            name
            for entry in entries
            if entry.parallel in QUANTIZED_STYLES
            for name, shape in entry.hf_expected().items()
            if len(shape) == 2 and name.endswith(".weight")
        }
        """The HF weights written in FP8."""

    def specs(self, name: str, shape: tuple[int, ...], dtype: dtypes.DType) -> list[Spec]:
        """(name, shape, dtype) of the tensors that one exported tensor is written as."""
        if name not in self.names:
            return [(name, shape, dtype)]
        return [(name, shape, dtypes.FLOAT8_E4M3), (name + SCALE_SUFFIX, scale_shape(shape), dtypes.FLOAT32)]

    def tensors(self, name: str, value: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The tensors one exported tensor is written as (quantized with power-of-two scales where FP8, `SPAN_ROWS`
        rows at a time: blocks are independent)."""
        import torch

        from hf_mcore_bridge.convert.fp8_blocks import FP8_DTYPE, quantize_blockwise

        if name not in self.names:
            return [(name, value)]
        q = torch.empty(value.shape, dtype=FP8_DTYPE)
        scale_inv = torch.empty(scale_shape(tuple(value.shape)), dtype=torch.float32)
        for first, last in _spans(0, value.shape[0]):
            q[first:last], scale_inv[first // BLOCK : -(-last // BLOCK)] = quantize_blockwise(
                value[first:last], pow2=True
            )
        return [(name, q), (name + SCALE_SUFFIX, scale_inv)]


def _spans(start: int, stop: int) -> list[tuple[int, int]]:
    """Rows `start .. stop` cut at multiples of `SPAN_ROWS` (whole 128-row blocks but at the ends)."""
    edges = [start, *range((start // SPAN_ROWS + 1) * SPAN_ROWS, stop, SPAN_ROWS), stop]
    return [(a, b) for a, b in itertools.pairwise(edges) if b > a]
