"""A GRPO run: its config, its plan (computed once, handed to the ranks), the loop, launch, generation, logging and
export."""
