"""FP8 HF checkpoints built in the tests, as DeepSeek-V3 and V3.1 publish them: a tiny bf16 model's weights
quantized to e4m3 in 128 x 128 blocks with `weight_scale_inv` made as each test asks, the expected values written
out block by block here (not through the code under test)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LINEAR = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections DeepSeek-V3's checkpoints hold in FP8 (the router `mlp.gate` and embeddings stay bfloat16)."""
FLOAT32 = ("mlp.gate.weight", "e_score_correction_bias")
SHAPE = {"hidden_size": 160, "intermediate_size": 272, "moe_intermediate_size": 136, "num_hidden_layers": 2}
QUANTIZATION = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
V31_QUANTIZATION = {**QUANTIZATION, "scale_fmt": "ue8m0"}
"""DeepSeek-V3.1's: DeepSeek-V3's (`QUANTIZATION`) has no `scale_fmt`, its scales are any float32."""
SCALES = ("random ue8m0", "random float32", "v3", "v3.1")
"""How the source's scales are made: random (powers of two or float32; blocks clamped to +-448 where they do not
fit), or from each block's amax as DeepSeek-V3 (amax / 448) and DeepSeek-V3.1 (rounded up to a power of two)."""


def expand(scale: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Each block's scale on each of its elements (written out block by block)."""
    full = torch.empty(shape)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            full[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = scale[i, j]
    return full


def block_amax(weight: torch.Tensor) -> torch.Tensor:
    """Each 128 x 128 block's largest |value| (written out block by block)."""
    amax = torch.empty(-(-weight.shape[0] // 128), -(-weight.shape[1] // 128))
    for i in range(amax.shape[0]):
        for j in range(amax.shape[1]):
            amax[i, j] = weight[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].abs().max()
    return amax


def scales(weight: torch.Tensor, kind: str, generator: torch.Generator) -> torch.Tensor:
    """A float32 weight's `weight_scale_inv`, made as `kind` (`SCALES`) says."""
    blocks = (-(-weight.shape[0] // 128), -(-weight.shape[1] // 128))
    if kind == "random ue8m0":  # powers of two around amax / 448
        return torch.exp2(torch.randint(-9, -6, blocks, generator=generator).float())
    if kind == "random float32":
        return torch.rand(blocks, generator=generator) * 1e-3 + 5e-4
    scale = block_amax(weight) / 448
    return torch.exp2(torch.ceil(torch.log2(scale))) if kind == "v3.1" else scale


def fp8_source(directory: Path, bf16: Path, *, kind: str) -> dict[str, torch.Tensor]:
    """`bf16`'s weights as an FP8 checkpoint in `directory` with scales made as `kind` says (`SCALES`); returns the
    expected bfloat16 value of every tensor. DeepSeek's kinds quantize float32 weights (the bfloat16 ones plus
    noise below bfloat16's resolution), some of whose elements are -0 (written as the e4m3 code 0x80)."""
    shutil.copytree(bf16, directory)
    tensors, expected = load_file(directory / "model.safetensors"), {}
    generator = torch.Generator().manual_seed(5)
    for name in list(tensors):
        weight = tensors[name].float()
        if any(name.endswith(f"{part}.weight") for part in FLOAT32) or name.endswith("e_score_correction_bias"):
            tensors[name] = expected[name] = weight  # float32, as HF keeps them
        elif any(f".{part}.weight" in name for part in LINEAR):
            if kind in ("v3", "v3.1"):
                weight = weight + torch.randn(weight.shape, generator=generator) * weight.abs() * 2**-10
                weight[0, :3] = -0.0
            scale = scales(weight, kind, generator)
            full = expand(scale, weight.shape)
            q = (weight / full).clamp(-448, 448).to(torch.float8_e4m3fn)
            tensors[name], tensors[f"{name}_scale_inv"] = q, scale
            expected[name] = (q.float() * full).to(torch.bfloat16)
        else:
            expected[name] = tensors[name]
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = V31_QUANTIZATION if kind == "v3.1" else QUANTIZATION
    (directory / "config.json").write_text(json.dumps(config))
    return expected
