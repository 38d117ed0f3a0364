"""The megatron-core training backend: its config section, the policy on one rank, its refit adapter, checkpoints."""
