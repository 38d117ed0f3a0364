"""Per-step metrics: appended to `metrics.jsonl` (one JSON object a step), optionally TensorBoard and the
experiment trackers of `grpo.run.loggers` (W&B, MLflow), and progress: a progress bar whose text is the step's line
(reward, KL, clip fraction, tokens/s, refit time) on a terminal, the line itself printed otherwise (logs, CI).
Validation samples (prompt, completion, answer, reward) go to `val_samples.jsonl`, the trackers' tables and,
with progress on, the output.

Only global rank 0 logs. A metric is a float; the step number is stored under `step`. TensorBoard is imported
only when asked for (`torch.utils.tensorboard` needs the `tensorboard` package). The metric names are listed in
docs/METRICS.md.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["MetricsLogger", "progress_line", "read_metrics"]

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "val_samples.jsonl"
"""Validation samples, one JSON object each with its `step`."""


class MetricsLogger:
    """Appends one JSON line per step to `<log_dir>/metrics.jsonl` (and TensorBoard scalars when enabled)."""

    def __init__(
        self,
        log_dir: Path,
        tensorboard: bool = False,
        print_progress: bool = True,
        total_steps: int | None = None,
        trackers: Sequence[Any] = (),
    ) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self.path = log_dir / METRICS_FILE
        self.samples_path = log_dir / SAMPLES_FILE
        self.trackers = list(trackers)
        """`grpo.run.loggers` trackers: each gets every step's metrics and the validation samples."""
        self.print_progress = print_progress
        self._writer: Any = None
        self._bar: Any = None
        if print_progress and total_steps and sys.stdout.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(
                TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn()
            )
            self._bar.start()
            self._task = self._bar.add_task("GRPO", total=total_steps)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(log_dir / "tensorboard"))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(record, allow_nan=True) + "\n")
        if self._writer is not None:
            for key, value in metrics.items():
                self._writer.add_scalar(key, value, step)
            self._writer.flush()
        values = {key: value for key, value in record.items() if key != "step"}
        for tracker in self.trackers:
            tracker.log_metrics(step, values)
        if self._bar is not None:
            self._bar.update(self._task, completed=step, description=progress_line(step, metrics))
        elif self.print_progress:
            print(progress_line(step, metrics), flush=True)

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        """Validation samples: `val_samples.jsonl`, the trackers' tables, and the output with progress on."""
        if not rows:
            return
        with self.samples_path.open("a", encoding="utf-8") as handle:
            for row in rows:
                handle.write(json.dumps({"step": step, **row}) + "\n")
        for tracker in self.trackers:
            tracker.log_samples(step, rows)
        if self.print_progress:
            for row in rows:
                print(f"[val step {step}] reward {row['reward']:.2f} | answer {row['answer']!r}", flush=True)
                print(f"  prompt: {row['prompt']!r}\n  completion: {row['completion']!r}", flush=True)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()
        if self._writer is not None:
            self._writer.close()
        if self._bar is not None:
            self._bar.stop()


PROGRESS_FIELDS = (
    ("reward_mean", "reward {}", ".3f"),
    ("kl_ref", "kl {}", ".2e"),
    ("clip_fraction", "clip {}", ".3f"),
    ("tokens_per_s", "{} tok/s", ".0f"),
    ("refit_s", "refit {}s", ".3f"),
    ("step_s", "step {}s", ".2f"),
)
"""The progress line's fields: metric, how it reads, its number format."""


def progress_line(step: int, metrics: dict[str, float]) -> str:
    """`step 3 | reward 0.41 | kl 1.2e-03 | clip 0.000 | 812 tok/s | refit 0.02s | step 1.10s`.

    A metric the step does not have is left out: it is off in this run (the KL term with `loss_fn.kl_coef: 0`
    computes no `kl_ref`), so a `nan` on the line is always a value that went wrong."""
    parts = [f"step {step}"]
    parts += [text.format(format(metrics[key], spec)) for key, text, spec in PROGRESS_FIELDS if key in metrics]
    return " | ".join(parts)


def read_metrics(log_dir: Path) -> list[dict[str, float]]:
    """The records of `<log_dir>/metrics.jsonl`, in order."""
    path = log_dir / METRICS_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
