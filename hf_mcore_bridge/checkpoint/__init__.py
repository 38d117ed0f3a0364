"""Files on disk, read and written without knowing any model: HF directories (safetensors), megatron-core's
distributed checkpoints (DCP reader and streaming writer), Megatron-LM's directory layout and `args` defaults,
the safety of every output (atomic temporary siblings, the destination check and lock, one-line write errors), and
the 128 x 128 block geometry and math of FP8 weights (`fp8_geometry`, `fp8_blocks`: read by conversion and the
engine alike).

Nothing here imports the mapping tables, nor megatron-core beyond the enum classes a checkpoint's pickles may hold
(`megatron_dirs`); `models` and `convert` build on these pieces.
"""
