"""The GRPO algorithm as pure functions: advantages, losses, micro-batches, pass@k, and their torch-free settings."""
