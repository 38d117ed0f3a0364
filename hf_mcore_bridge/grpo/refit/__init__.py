"""The refit: the trainer's weights streamed into the rollout engine after every step, and the checks that guard it."""
