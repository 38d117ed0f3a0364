"""The DTensor training backend (the HF model under FSDP2 and DTensor TP): its config section, sharding, policy,
learning-rate schedule and checkpoints."""
