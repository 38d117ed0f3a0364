"""The training backends behind the GRPO loop (`base.TrainingBackend`): `megatron` and `dtensor`, each with its
config section, policy and checkpoints; `schedule`, the learning-rate schedule both read."""
