"""The megatron-core runtime: building a `GPTModel` stage and loading a checkpoint into it, core attention through
torch's fused kernels, context parallelism without Transformer Engine, the sequence-parallel norm, the patches
megatron-core needs on CPU, the process world (spawned or given by `torchrun`), and `bridge verify`.
"""
