"""GRPO: the trainer, grouped by role (lowest first; each imports only the roles before it, `tests/test_layering.py`):

- `errors`: the configuration error and the small checks every section's validation uses;
- `algorithm`: the algorithm as pure functions (group advantages, the loss variants and the log-prob mismatch,
  micro-batches and packing, pass@k), tensor shapes in the docstrings, and its torch-free settings (`options`);
- `data`: prompts (files, HF datasets, built-in tasks, row formats), rewards and their scoring processes, chat
  templates, stop tokens, and the `data` and `reward` sections of the config;
- `refit`: the weight stream into the engine and the checks that guard it, backend-neutral (checksums, the
  trainer-side reference of each engine rank's part, the recorded replay, the initial-weights check, the log-prob
  gate, the faults they are tested on);
- `backends`: the training backends behind one protocol (`base.TrainingBackend`): `megatron` (megatron-core) and
  `dtensor` (the HF model under FSDP2 / DTensor TP), each with its config section and its validation, its policy
  and its checkpoints; neither imports the other;
- `run`: the run's config (plain data composed of the sections above), its plan (`plan.RunPlan`: computed once in
  the parent, handed to every rank), the loop (`trainer`), starting and stopping (`launch`, `ranks`), the rollout
  engine (`generation`), metrics and loggers, the dry run and the export.
"""
