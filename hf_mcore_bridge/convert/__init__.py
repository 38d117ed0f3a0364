"""Conversion between HF and megatron-core checkpoints, in both directions, from one CPU process.

The vocabulary that `mappings/` tables are written in (`mapping_types`, `parallel_style`, `moe_tables`), the pure
tensor transforms (`tensor_ops`, blockwise FP8 in `fp8_blocks`), the HF config <-> `TransformerConfig` translation
(`config_bridge`), parallel layouts (`layout`), the shape and dtype checks made before anything is written
(`input_checks`), and the streaming converters themselves (`to_mcore`, `to_hf`, with the legacy and
Megatron-Bridge layouts, FP8 checkpoints in `fp8_checkpoint`, multi-token-prediction layers in `mtp`). `inspect`
reports what any of these formats holds. Needs megatron-core only where a checkpoint's own classes are read.
"""
