"""Files on disk, read and written without knowing any model: HF directories (safetensors), megatron-core's
distributed checkpoints (DCP reader and streaming writer), Megatron-LM's directory layout and `args` defaults, and
the safety of every output (atomic temporary siblings, the destination check and lock, one-line write errors).

Nothing here imports megatron-core or the mapping tables; `convert` builds on these pieces.
"""
