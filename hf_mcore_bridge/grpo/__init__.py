"""GRPO: the algorithm as pure functions, rewards, data and the trainer loop."""
