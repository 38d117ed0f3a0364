"""A PNG of a run's reward and KL over steps (matplotlib, headless)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

PLOT_FILE = "training_curves.png"


def plot_metrics(records: Sequence[dict[str, float]], path: Path) -> Path:
    """Reward (mean, and validation where logged) and KL to the reference, per step, written to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    figure, (reward_axis, kl_axis) = plt.subplots(1, 2, figsize=(10, 3.6), constrained_layout=True)
    reward_axis.plot(steps, [r.get("reward_mean", math.nan) for r in records], marker="o", label="train")
    validation = [(r["step"], r["val_reward_mean"]) for r in records if "val_reward_mean" in r]
    if validation:
        reward_axis.plot(*zip(*validation, strict=True), marker="s", label="validation")
    reward_axis.set(title="reward", xlabel="step", ylabel="mean reward")
    reward_axis.legend()
    kl_axis.plot(steps, [r.get("kl_ref", math.nan) for r in records], marker="o", color="tab:red")
    kl_axis.set(title="KL to the reference policy", xlabel="step", ylabel="k3 estimate")
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
