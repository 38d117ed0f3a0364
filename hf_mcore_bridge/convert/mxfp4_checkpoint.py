"""HF checkpoints whose fused experts are MXFP4, as GPT-OSS's are published (`quantization_config.quant_method`
`mxfp4`): read as bfloat16, exactly (`checkpoint.mxfp4`).

Each pair `X_blocks` `[E, R, K / 32, 16]` / `X_scales` `[E, R, K / 32]` is served as the tensor `X` transformers
dequantizes it into, `[E, K, R]` bfloat16 (`convert_moe_packed_tensors`: the blocks hold each expert's weight as
`[out, in]`, transformers' `gate_up_proj` / `down_proj` are `[in, out]`), one expert at a time: conversion reads the
fused experts through `Architecture.fused_experts`, expert by expert, so no more than one expert's slice is ever
dequantized at once. The scales are kept beside the HF assets (`SCALES_FILE`), for an `--mxfp4` export to give the
same bytes back.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from hf_mcore_bridge.checkpoint import dtypes, mxfp4
from hf_mcore_bridge.checkpoint.hf_dir import HFCheckpoint, TensorInfo
from hf_mcore_bridge.errors import CheckpointError

if TYPE_CHECKING:
    import torch

BLOCKS, SCALES = "_blocks", "_scales"
SCALES_FILE = "mxfp4_scales.safetensors"
"""The source's MXFP4 scales, kept beside the converted checkpoint's HF assets under their checkpoint names."""


def is_mxfp4_config(config: dict[str, Any]) -> bool:
    """Whether an HF config announces MXFP4 weights."""
    quantization = config.get("quantization_config") or {}
    return isinstance(quantization, dict) and quantization.get("quant_method") == "mxfp4"


def mxfp4_quantization_config(source: dict[str, Any], model: Any) -> dict[str, Any]:
    """The `quantization_config` of an MXFP4 export: the source's where it was MXFP4, else GPT-OSS's published
    one (every module but the experts left unquantized)."""
    if is_mxfp4_config(source):
        return dict(source["quantization_config"])
    return {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }


class Mxfp4Checkpoint(HFCheckpoint):
    """An HF directory with MXFP4 tensors, each pair of blocks and scales read as one bfloat16 tensor."""

    def __init__(self, path: Path | str, *, allow_pickle: bool = False):
        super().__init__(path, allow_pickle=allow_pickle)
        self.packed: dict[str, tuple[str, str]] = {}
        """Dequantized name -> (its blocks, its scales)."""
        for blocks in sorted(n for n in self._tensors if n.endswith(BLOCKS)):
            name = blocks.removesuffix(BLOCKS)
            scales = name + SCALES
            info = self._tensors[blocks]
            if scales not in self._tensors:
                raise CheckpointError(f"{blocks} in {info.file.name} has no {scales}")
            shape, scale_shape = info.shape, self._tensors[scales].shape
            if len(shape) != 4 or shape[-1] != mxfp4.BLOCK // 2 or shape[:-1] != scale_shape:
                raise CheckpointError(
                    f"{blocks} {shape} and {scales} {scale_shape} are not MXFP4 blocks [E, rows, groups, 16] and "
                    "scales [E, rows, groups]"
                )
            if info.dtype != dtypes.UINT8 or self._tensors[scales].dtype != dtypes.UINT8:
                raise CheckpointError(f"{blocks} and {scales} must be uint8")
            experts, rows, groups = scale_shape
            self._tensors[name] = TensorInfo(info.file, (experts, groups * mxfp4.BLOCK, rows), dtypes.BFLOAT16)
            self.packed[name] = (blocks, scales)

    def names(self) -> set[str]:
        return super().names() - {n for pair in self.packed.values() for n in pair}

    def location(self, name: str) -> tuple[Path, int] | None:
        return None if name in self.packed else super().location(name)

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        if name not in self.packed:
            return super().read(name, rows)
        first, last = rows if rows is not None else (0, self._tensors[name].shape[0])
        import torch

        return torch.stack([self._expert_slice(name, e) for e in range(first, last)])

    def _expert_slice(self, fused: str, expert: int | None) -> torch.Tensor:
        if fused not in self.packed:
            return super()._expert_slice(fused, expert)
        if expert is None:
            raise CheckpointError(f"{fused} is read one expert at a time")
        blocks, scales = self.packed[fused]
        values = mxfp4.dequantize(super()._expert_slice(blocks, expert), super()._expert_slice(scales, expert))
        return values.T.contiguous()  # [out, in] -> transformers' [in, out]

    def save_scales(self, path: Path) -> None:
        """Keep the source's scales (`SCALES_FILE`), under their checkpoint names."""
        from safetensors.torch import save_file

        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({s: super(Mxfp4Checkpoint, self).read(s) for _, s in self.packed.values()}, str(path))

    def note(self) -> str:
        return f"{len(self.packed)} MXFP4 tensor(s) dequantized to bfloat16 (exact); their scales kept"
