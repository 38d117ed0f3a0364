"""Experiment trackers beside `metrics.jsonl` and TensorBoard: Weights & Biases and MLflow (`logger.wandb_enabled`,
`logger.mlflow_enabled`, in NeMo-RL's config shape).

Each tracker takes the same per-step metrics as `metrics.jsonl` (same names, the step as the x axis), the resolved
config once as the run's parameters, and tables of validation samples. Both packages are imported only when their
tracker is made (the `loggers` extra installs them).

- W&B: `wandb.init(project, name, entity, dir=<log_dir>, config=...)`; `WANDB_MODE=offline` runs without a network
  (the run is synced later with `wandb sync`). Samples go in as a `wandb.Table` under `val_samples`.
- MLflow: `tracking_uri` None stores runs under `<log_dir>/mlruns`. MLflow 3 refuses its file store unless
  `MLFLOW_ALLOW_FILE_STORE` is set, and its database store needs the full `mlflow` package, so for a `file:` URI
  the tracker sets that variable (the store was asked for by name). Parameters are flattened with dotted keys and
  cut to MLflow's 6000 characters; samples are logged as the artifact `val_samples/step_<n>.json`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

__all__ = ["MLflowTracker", "Tracker", "WandbTracker", "build_trackers", "flatten"]

SAMPLE_COLUMNS = ("prompt", "completion", "answer", "reward")
"""The columns of a validation sample table."""


class Tracker(Protocol):
    """What `MetricsLogger` calls on each tracker."""

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None: ...

    def close(self) -> None: ...


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as one level with dotted keys (`policy.megatron_cfg.micro_batch_size`)."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat |= flatten(value, f"{name}.")
        else:
            flat[name] = value
    return flat


class WandbTracker:
    """A Weights & Biases run."""

    def __init__(self, project: str, name: str | None, entity: str | None, log_dir: Path, params: Mapping) -> None:
        import wandb

        self._wandb = wandb
        self.run = wandb.init(project=project, name=name, entity=entity, dir=str(log_dir), config=dict(params))

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        table = self._wandb.Table(columns=list(SAMPLE_COLUMNS), data=[[r[c] for c in SAMPLE_COLUMNS] for r in rows])
        self.run.log({"val_samples": table}, step=step)

    def close(self) -> None:
        self.run.finish()


class MLflowTracker:
    """An MLflow run."""

    def __init__(
        self, experiment: str, run_name: str | None, tracking_uri: str | None, log_dir: Path, params: Mapping
    ) -> None:
        import mlflow

        uri = tracking_uri or (log_dir / "mlruns").resolve().as_uri()
        if uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self._mlflow = mlflow
        self.client = mlflow.MlflowClient(uri)
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        for key, value in flatten(params).items():
            self.client.log_param(self.run_id, key[:250], str(value)[:6000])

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        stamp = self._mlflow.utils.time.get_current_time_millis()
        batch = [Metric(key, float(value), stamp, step) for key, value in metrics.items()]
        self.client.log_batch(self.run_id, metrics=batch)

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        self.client.log_text(self.run_id, json.dumps(list(rows), indent=1), f"val_samples/step_{step}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def build_trackers(logger: Any, log_dir: Path, params: Mapping[str, Any]) -> list[Tracker]:
    """The trackers a `LoggerConfig` enables, each started with the run's `params` (the resolved config)."""
    trackers: list[Tracker] = []
    if logger.wandb_enabled:
        w = logger.wandb
        trackers.append(WandbTracker(w.project, w.name, w.entity, log_dir, params))
    if logger.mlflow_enabled:
        m = logger.mlflow
        trackers.append(MLflowTracker(m.experiment_name, m.run_name, m.tracking_uri, log_dir, params))
    return trackers
