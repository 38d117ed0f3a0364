"""Random HF checkpoints of real model shapes, written shard by shard without building a transformers model.

Used by the GPU verification and the benchmarks: a Llama-3.1-8B-shaped (16 GB), Qwen3-MoE-, GLM-4.5-Air- or
DeepSeek-V3-shaped checkpoint is generated in seconds (on a GPU when there is one) and streamed to disk with bounded
memory, optionally with DeepSeek's FP8 blocks (`--fp8`; `--fp8-scale-format float32` for DeepSeek-V3's amax / 448
scales, default `ue8m0`: DeepSeek-V3.1's powers of two). Tensor names and shapes come from the project's own
mapping tables (every HF tensor the converter expects, its shape in model dimensions resolved from the config);
tensors the table keeps in float32 (a router's expert bias) are float32.

In the project's environment (`bash scripts/setup.sh`; on a GPU machine with its own torch
`TORCH_SPEC= EXTRAS= bash scripts/setup.sh`, offline with `WHEELS=DIR`; then `. .venv/bin/activate`):

    python scripts/random_checkpoint.py llama3-8b OUT_DIR
    python scripts/random_checkpoint.py deepseek-v3 OUT_DIR --fp8
    python scripts/random_checkpoint.py deepseek-v3 OUT_DIR --fp8 --fp8-scale-format float32
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from hf_mcore_bridge.checkpoint import dtypes
from hf_mcore_bridge.checkpoint.safetensors_stream import SafetensorsStreamWriter
from hf_mcore_bridge.convert import config_bridge
from hf_mcore_bridge.convert.fp8_checkpoint import SCALE_FORMATS, Fp8Export, quantization_config
from hf_mcore_bridge.convert.input_checks import concrete, hf_sizes
from hf_mcore_bridge.convert.model_plan import placed_entries
from hf_mcore_bridge.models.mapping_types import keeps_float32
from hf_mcore_bridge.models.spec import ModelSpec

SHAPES: dict[str, dict[str, Any]] = {
    "llama3-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    "llama3.2-1b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    },
    "qwen3-8b": {  # Qwen/Qwen3-8B's config.json
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "use_sliding_window": False,
    },
    "glm4.5-air": {  # GLM-4.5-Air's layer shape (layer 0 dense, then 128 experts of width 1408, top-8), 4 layers
        "architectures": ["Glm4MoeForCausalLM"],
        "model_type": "glm4_moe",
        "hidden_size": 4096,
        "intermediate_size": 10944,
        "moe_intermediate_size": 1408,
        "num_hidden_layers": 4,
        "num_attention_heads": 96,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "partial_rotary_factor": 0.5,
        "attention_bias": True,
        "use_qk_norm": False,
        "n_routed_experts": 128,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.0,
        "norm_topk_prob": True,
        "num_nextn_predict_layers": 0,
        "vocab_size": 151552,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
    },
    "qwen3-moe": {  # Qwen3-30B-A3B's layer shape, 8 layers
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 8,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "attention_bias": False,
    },
    "deepseek-v3": {  # DeepSeek-V3's layer shape (MLA, 8 groups of experts, a dense first layer), 4 layers, 32 experts
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 4,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 32,
        "num_experts_per_tok": 8,
        "n_group": 8,
        "topk_group": 4,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "num_nextn_predict_layers": 0,
        "vocab_size": 129280,
        "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000,
        "rope_scaling": {
            "type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "tie_word_embeddings": False,
        "attention_bias": False,
    },
}
SHAPES["qwen3-30b-a3b"] = {**SHAPES["qwen3-moe"], "num_hidden_layers": 48}  # Qwen/Qwen3-30B-A3B's config.json

TINY_SHAPE: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 211,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
"""A tiny Llama-like shape for the benchmarks' `--tiny` smoke runs: GQA, an odd vocabulary that Megatron pads."""


def hf_tensor_shapes(config: dict[str, Any]) -> list[tuple[str, tuple[int, ...], bool]]:
    """Every HF tensor (in table order) of a model with this config: its shape (the table's, in model dimensions,
    resolved from the config) and whether it is kept in float32 whatever the checkpoint's dtype."""
    model: ModelSpec = config_bridge.megatron_spec(config)
    sizes = hf_sizes(model, config)
    return [
        (name, concrete(shape, sizes), keeps_float32(placed.template))
        for placed in placed_entries(model)
        for name, shape in placed.entry.hf_expected().items()
    ]


def write_random_checkpoint(
    directory: Path,
    config: dict[str, Any],
    *,
    dtype: torch.dtype = torch.bfloat16,
    shard_bytes: int = 2 << 30,
    seed: int = 0,
    fp8: bool = False,
    fp8_scale_format: str = "ue8m0",
) -> int:
    """Write a random checkpoint (normal, std 0.02; norms near 1) with `config`; returns the bytes written. `fp8`:
    the linear layers as 128 x 128 FP8 blocks with `weight_scale_inv` of `fp8_scale_format`, as DeepSeek publishes
    them."""
    directory.mkdir(parents=True, exist_ok=True)
    entries = [p.entry for p in placed_entries(config_bridge.megatron_spec(config))]
    blocks = Fp8Export(entries, fp8_scale_format) if fp8 else None
    plan = [
        spec
        for name, shape, fp32 in hf_tensor_shapes(config)
        for spec in (
            blocks.specs(name, shape, dtype)
            if blocks and not fp32
            else [(name, shape, torch.float32 if fp32 else dtype)]
        )
    ]
    shards: list[list[tuple[str, tuple[int, ...], torch.dtype]]] = [[]]
    size = 0
    for name, shape, tensor_dtype in plan:
        nbytes = torch.Size(shape).numel() * tensor_dtype.itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape, tensor_dtype))
        size += nbytes
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device=device).manual_seed(seed)
    weight_map, total = {}, 0
    pending: dict[str, torch.Tensor] = {}  # a weight's scale, written after it
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        writer = SafetensorsStreamWriter(directory / file, shard)
        for name, shape, tensor_dtype in shard:
            value = pending.pop(name, None)
            if value is None:
                value = torch.randn(shape, generator=generator, device=device, dtype=torch.float32) * 0.02
                if name.endswith("norm.weight") or "layernorm" in name:
                    value = value + 1.0
                parts = blocks.tensors(name, value) if blocks else [(name, value)]
                value = parts[0][1].to(tensor_dtype) if len(parts) == 1 else parts[0][1]
                pending.update(parts[1:])
            writer.write(name, value.cpu())
            weight_map[name] = file
            total += value.numel() * value.dtype.itemsize
        writer.close()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    written = {**config, "torch_dtype": dtypes.of(dtype).name}
    if fp8:
        written["quantization_config"] = quantization_config(fp8_scale_format)
    (directory / "config.json").write_text(json.dumps(written, indent=2))
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("directory", type=Path)
    parser.add_argument("--layers", type=int, help="Override the number of layers.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fp8", action="store_true", help="Linear layers as 128 x 128 FP8 blocks (DeepSeek's).")
    parser.add_argument("--fp8-scale-format", choices=SCALE_FORMATS, default="ue8m0", help="Scales of --fp8.")
    args = parser.parse_args()
    config = dict(SHAPES[args.shape])
    if args.layers:
        config["num_hidden_layers"] = args.layers
    total = write_random_checkpoint(
        args.directory, config, seed=args.seed, fp8=args.fp8, fp8_scale_format=args.fp8_scale_format
    )
    print(f"wrote {args.directory}: {total / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
