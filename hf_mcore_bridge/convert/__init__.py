"""Conversion between HF and megatron-core checkpoints, in both directions, from one CPU process.

Built on the model layer (`hf_mcore_bridge.models`: the tables, the registry) and on `checkpoint` (the files):
the HF config <-> `TransformerConfig` translation (`config_bridge`), parallel layouts (`layout`), where each
tensor lives in a distributed checkpoint (`placement`), the shape and dtype checks made before anything is written
(`input_checks`), and the streaming converters themselves (`to_mcore`, `to_hf`, with the legacy and
Megatron-Bridge layouts, FP8 checkpoints in `fp8_checkpoint`, multi-token-prediction layers in `mtp`). `inspect`
reports what any of these formats holds. Needs megatron-core only where a checkpoint's own classes are read.
"""
