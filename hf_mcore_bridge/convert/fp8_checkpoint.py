"""HF checkpoints of blockwise FP8 weights, as DeepSeek-V3 and Kimi-K2 are published: e4m3 weights with a float32
`weight_scale_inv` per 128 x 128 block, announced by the config's `quantization_config`.

Reading (`open_hf_checkpoint`): such a checkpoint is read through `Fp8Checkpoint`, which shows every FP8 weight as
its bfloat16 dequantization (`fp8_blocks.dequantize_rows`) and hides the scales. Row ranges are dequantized as
they are read, `SPAN_ROWS` rows at a time into the bfloat16 result, so conversion streams and its memory stays
bounded as for any checkpoint (no float32 copy of a whole weight). Only what DeepSeek
publishes is taken: `quant_method: fp8`, `fmt: e4m3`, `weight_block_size: [128, 128]`, dynamic activation scales;
other quantization configs are refused by name, and so is a weight without its scale or a scale without its
weight, a scale that is not finite (all scales are read when the checkpoint is opened, before anything is
written) and a weight that dequantizes to a non-finite value (an e4m3 NaN code, or a product beyond bfloat16;
found as it is read, so the conversion stops and its output never appears). An e4m3 weight in a checkpoint whose
config has no `quantization_config` is refused by naming the missing config.

Keeping the scales (`SCALES_FILE`): the converted checkpoint holds bfloat16 values, and those do not determine
float32 scales. DeepSeek-V3's `weight_scale_inv` is a block's amax / 448, and rounding `q * scale` to bfloat16
(8 significant bits) loses the scale's low 16 bits: recomputed from the bfloat16 block, amax / 448 differs from the
source's scale in practically every block (`test_bfloat16_values_do_not_determine_float32_scales`; up to 2^-8
relative). Float32 values would give it back for certain only where the scale was made exactly as float32
amax / 448 and the block's largest |q| is 448 (for an arbitrary float32 scale s, fl(fl(448 s) / 448) = s fails
about one time in nine: `test_float32_values_determine_only_amax_made_scales`), and DeepSeek-V3.1's power-of-two
scales need not be the smallest that fits (a block whose largest |q| is 224 at s is also 448 at s / 2). So import
copies the source's scale tensors, unchanged, into the converted checkpoint's HF assets
(`hf_assets/fp8_scales.safetensors`: 4 bytes per 16384 weights) beside `config.json`, which keeps the source's
`quantization_config`. The weights themselves need nothing stored: given
its scale, a block's codes are the e4m3 values nearest `value / scale` (`fp8_blocks.quantize_blockwise(keep=)`).

Writing (`Fp8Export`): export with `--fp8-blockwise` quantizes the linear layers' weights (the table's column- and
row-parallel tensors; embeddings, output layer, norms and router stay in the export dtype) to e4m3 with scales of
one format (`--fp8-scale-format`): `float32` (amax / 448 per block, DeepSeek-V3's) or `ue8m0` (powers of two,
DeepSeek-V3.1's); the default, `source`, is the FP8 source's format (a config without `scale_fmt: ue8m0` has
float32 scales), or `ue8m0` for a checkpoint that came from no FP8 checkpoint. A block keeps its source scale
where its values are still exactly `q * scale` (untouched since import) and the scale is of the written format, so
an FP8 checkpoint converts to mcore and back to bit-identical weights, scales and `quantization_config`; other
blocks (changed by training, or a scale of the other format) get the format's scale computed from their values
and the nearest e4m3 codes. Checkpoints without the kept scales (written by older versions, or by the trainer)
get computed scales throughout: power-of-two scales give back every block that came from power-of-two scales
(though not always the source's encoding), float32 ones are within 2^-8 of the source's.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hf_mcore_bridge.checkpoint import dtypes
from hf_mcore_bridge.checkpoint.fp8_geometry import BLOCK, scale_shape
from hf_mcore_bridge.checkpoint.hf_dir import HFCheckpoint, TensorInfo
from hf_mcore_bridge.errors import CheckpointError
from hf_mcore_bridge.models.config_errors import ConfigError
from hf_mcore_bridge.models.mapping_types import Entry
from hf_mcore_bridge.models.parallel_style import Parallel

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
SCALES_FILE = "fp8_scales.safetensors"
"""The source's `weight_scale_inv` tensors (by their HF names), kept in a converted checkpoint's HF assets."""
SCALE_FORMATS = ("float32", "ue8m0")
"""Scale formats `--fp8-blockwise` writes: any float32 (DeepSeek-V3's amax / 448), or powers of two (DeepSeek-V3.1's
`scale_fmt: ue8m0`)."""


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
    if quantization.get("scale_fmt", "ue8m0") not in SCALE_FORMATS:
        raise ConfigError(f"config field quantization_config.scale_fmt={quantization['scale_fmt']!r} is not supported")
    return True


def source_scale_format(config: Mapping[str, Any]) -> str | None:
    """The scale format of a checkpoint with this config: `ue8m0` where it says `scale_fmt: ue8m0`, `float32` for
    other FP8 configs (DeepSeek-V3's has no `scale_fmt`), None without FP8 weights."""
    if not is_fp8_config(config):
        return None
    return "ue8m0" if config["quantization_config"].get("scale_fmt") == "ue8m0" else "float32"


def export_scale_format(requested: str, source_config: Mapping[str, Any]) -> str:
    """The scale format `--fp8-scale-format requested` writes: `source` is the source's, `ue8m0` without one."""
    if requested == "source":
        return source_scale_format(source_config) or "ue8m0"
    if requested not in SCALE_FORMATS:
        raise ValueError(f"unknown FP8 scale format {requested!r} (source, {', '.join(SCALE_FORMATS)})")
    return requested


def quantization_config(scale_format: str, source_config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The `quantization_config` of an export with scales of `scale_format`: the source's own where its scales are
    of that format (as published, field for field), else DeepSeek's fields (with `scale_fmt: ue8m0` for powers of
    two; DeepSeek-V3's config for float32 scales has no `scale_fmt`)."""
    if source_config is not None and source_scale_format(source_config) == scale_format:
        return dict(source_config["quantization_config"])
    config: dict[str, Any] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [BLOCK, BLOCK],
    }
    return config | {"scale_fmt": "ue8m0"} if scale_format == "ue8m0" else config


class Fp8Checkpoint(HFCheckpoint):
    """An HF directory of blockwise FP8 weights, read as bfloat16 (scales hidden, dequantized on read)."""

    def __init__(self, path: Path | str, *, allow_pickle: bool = False, view: Any = None):
        super().__init__(path, allow_pickle=allow_pickle, view=view)
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
        for scale in self.scales.values():
            _check_finite_scale(scale, super().info(scale).file.name, super().read(scale))

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

        from hf_mcore_bridge.checkpoint.fp8_blocks import dequantize_rows

        if name not in self.scales:
            return super().read(name, rows)
        start, stop = rows if rows is not None else (0, super().info(name).shape[0])
        out = torch.empty((stop - start, *super().info(name).shape[1:]), dtype=DEQUANTIZED_DTYPE.torch)
        for first, last in _spans(start, stop):
            q = super().read(name, (first, last))
            block_scales = super().read(self.scales[name], (first // BLOCK, -(-last // BLOCK)))
            rows_out = dequantize_rows(q, block_scales, first, DEQUANTIZED_DTYPE.torch)
            if not torch.isfinite(rows_out).all():
                raise CheckpointError(self._non_finite(name, q, block_scales, first, rows_out))
            out[first - start : last - start] = rows_out
        return out

    def _non_finite(
        self, name: str, q: torch.Tensor, block_scales: torch.Tensor, first: int, values: torch.Tensor
    ) -> str:
        """One line for the first element of rows `first ..` of `name` that dequantizes to a non-finite value."""
        import torch

        row, col = (int(i) for i in torch.nonzero(~torch.isfinite(values))[0])
        code = int(q[row, col].view(torch.uint8))
        scale = float(block_scales[(first + row) // BLOCK - first // BLOCK, col // BLOCK])
        return (
            f"{name} in {super().info(name).file.name} dequantizes to {float(values[row, col])} at "
            f"[{first + row}, {col}] (e4m3 code 0x{code:02x} times {self.scales[name]} {scale:g})"
        )

    def save_scales(self, path: Path) -> None:
        """Write every `weight_scale_inv`, unchanged, into one safetensors file at `path` (one tensor in memory at
        a time)."""
        from hf_mcore_bridge.checkpoint.safetensors_stream import SafetensorsStreamWriter

        plan = [(scale, self.info(scale).shape, self.info(scale).dtype) for scale in sorted(self.scales.values())]
        writer = SafetensorsStreamWriter(path, plan, metadata={"format": "pt"})
        try:
            for scale, _, _ in plan:
                writer.write(scale, self.read(scale))
        except BaseException:
            writer.abandon()
            raise
        writer.close()

    def note(self) -> str:
        """What reading this checkpoint does, in one line."""
        return (
            f"{len(self.scales)} FP8 weights ({BLOCK} x {BLOCK} blocks with weight_scale_inv) dequantized to "
            f"{DEQUANTIZED_DTYPE.name}"
        )


def _check_finite_scale(name: str, file: str, scale: torch.Tensor) -> None:
    import torch

    bad = ~torch.isfinite(scale.float())
    if bad.any():
        block = tuple(int(i) for i in torch.nonzero(bad)[0])
        raise CheckpointError(
            f"{name} in {file} holds {float(scale[block])} for block {list(block)}: FP8 weights scaled by it would "
            "dequantize to non-finite values"
        )


def open_hf_checkpoint(path: Path | str, *, allow_pickle: bool = False) -> HFCheckpoint:
    """An HF directory, read through `Fp8Checkpoint` where its config announces blockwise FP8 weights (through
    `mxfp4_checkpoint.Mxfp4Checkpoint` where it announces MXFP4 ones); e4m3 weights without that announcement are
    refused by naming the missing `quantization_config`. A vision-language checkpoint is seen as its language
    model (`wrapped.text_view`)."""
    from hf_mcore_bridge.convert.mxfp4_checkpoint import Mxfp4Checkpoint, is_mxfp4_config
    from hf_mcore_bridge.convert.wrapped import text_view

    plain = HFCheckpoint(path, allow_pickle=allow_pickle, view=text_view)
    if is_mxfp4_config(plain.config):
        return Mxfp4Checkpoint(path, allow_pickle=allow_pickle)
    if is_fp8_config(plain.config):
        return Fp8Checkpoint(path, allow_pickle=allow_pickle, view=text_view)
    fp8 = sorted(name for name in plain.names() if plain.info(name).dtype == dtypes.FLOAT8_E4M3)
    if fp8:
        raise CheckpointError(
            f"{fp8[0]} in {plain.info(fp8[0]).file.name} is float8_e4m3fn, but {Path(path) / 'config.json'} has no "
            f"quantization_config (FP8 checkpoints announce their blocks: quant_method fp8, fmt e4m3, "
            f"weight_block_size [{BLOCK}, {BLOCK}])"
        )
    return plain


class Fp8Export:
    """Which exported HF tensors become FP8 blocks, and their planned shapes and values: scales of `scale_format`
    (`SCALE_FORMATS`), the source's kept where they still fit (`kept`: a `SCALES_FILE`, or None)."""

    def __init__(
        self,
        entries: Iterable[Entry],
        scale_format: str = "ue8m0",
        kept: Path | None = None,
        source_config: Mapping[str, Any] | None = None,
    ):
        if scale_format not in SCALE_FORMATS:
            raise ValueError(f"unknown FP8 scale format {scale_format!r} ({', '.join(SCALE_FORMATS)})")
        self.scale_format, self.source_config = scale_format, source_config
        self.names = {
            name
            for entry in entries
            if entry.parallel in QUANTIZED_STYLES
            for name, shape in entry.hf_expected().items()
            if len(shape) == 2 and name.endswith(".weight")
        }
        """The HF weights written in FP8."""
        self.pow2 = scale_format == "ue8m0"
        self.kept = kept
        self._kept_shapes: dict[str, tuple[int, ...]] = {}
        if kept is not None:
            from safetensors import safe_open

            with safe_open(str(kept), framework="pt") as handle:
                kept_names = handle.keys()
                self._kept_shapes = {n: tuple(handle.get_slice(n).get_shape()) for n in kept_names}

    @classmethod
    def of_checkpoint(
        cls, entries: Iterable[Entry], requested: str, source_config: Mapping[str, Any], assets: Path | None
    ) -> Fp8Export:
        """The export of a converted checkpoint with HF assets in `assets` (its source's config, and its scales in
        `SCALES_FILE` where they were kept), in `--fp8-scale-format requested`."""
        kept = None if assets is None else assets / SCALES_FILE
        scale_format = export_scale_format(requested, source_config)
        return cls(entries, scale_format, kept if kept is not None and kept.is_file() else None, source_config)

    def quantization_config(self) -> dict[str, Any]:
        """The `quantization_config` the export's config announces its blocks with."""
        return quantization_config(self.scale_format, self.source_config)

    def specs(self, name: str, shape: tuple[int, ...], dtype: dtypes.DType) -> list[Spec]:
        """(name, shape, dtype) of the tensors that one exported tensor is written as; a kept scale that does not
        fit the tensor is refused here, before anything is written."""
        if name not in self.names:
            return [(name, shape, dtype)]
        scale = name + SCALE_SUFFIX
        kept = self._kept_shapes.get(scale)
        if kept is not None and kept != scale_shape(shape):
            raise CheckpointError(
                f"{scale} in {self.kept} has shape {kept}, but {name} {shape} in {BLOCK} x {BLOCK} blocks needs "
                f"{scale_shape(shape)}"
            )
        return [(name, shape, dtypes.FLOAT8_E4M3), (scale, scale_shape(shape), dtypes.FLOAT32)]

    def tensors(self, name: str, value: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The tensors one exported tensor is written as (quantized `SPAN_ROWS` rows at a time where FP8: blocks
        are independent)."""
        import torch

        from hf_mcore_bridge.checkpoint.fp8_blocks import FP8_DTYPE, quantize_blockwise

        if name not in self.names:
            return [(name, value)]
        keep = self._kept_scale(name + SCALE_SUFFIX)
        q = torch.empty(value.shape, dtype=FP8_DTYPE)
        scale_inv = torch.empty(scale_shape(tuple(value.shape)), dtype=torch.float32)
        for first, last in _spans(0, value.shape[0]):
            block_rows = slice(first // BLOCK, -(-last // BLOCK))
            q[first:last], scale_inv[block_rows] = quantize_blockwise(
                value[first:last], pow2=self.pow2, keep=None if keep is None else keep[block_rows]
            )
        return [(name, q), (name + SCALE_SUFFIX, scale_inv)]

    def _kept_scale(self, scale: str) -> torch.Tensor | None:
        """The source's scale tensor `scale`, if kept (a handle per call: writer threads call this at once)."""
        if scale not in self._kept_shapes:
            return None
        from safetensors import safe_open

        with safe_open(str(self.kept), framework="pt") as handle:
            return handle.get_tensor(scale)


def _spans(start: int, stop: int) -> list[tuple[int, int]]:
    """Rows `start .. stop` cut at multiples of `SPAN_ROWS` (whole 128-row blocks but at the ends)."""
    edges = [start, *range((start // SPAN_ROWS + 1) * SPAN_ROWS, stop, SPAN_ROWS), stop]
    return [(a, b) for a, b in itertools.pairwise(edges) if b > a]
