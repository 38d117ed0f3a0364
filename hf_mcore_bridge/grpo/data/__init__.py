"""Prompts, rewards and chat templates of a GRPO run, and the `data` and `reward` sections of its config."""
