"""W&B (offline, no network) and MLflow (a local file store) trackers: metrics, parameters and validation samples
logged through `MetricsLogger` and read back with each library's own reader."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from hf_mcore_bridge.grpo.run.config import LoggerConfig, MLflowConfig, WandbConfig
from hf_mcore_bridge.grpo.run.loggers import build_trackers, flatten
from hf_mcore_bridge.grpo.run.metrics import MetricsLogger

STEPS = {1: {"reward_mean": 0.25, "val_pass_at_1": 0.5}, 2: {"reward_mean": 0.75, "val_pass_at_1": 0.625}}
PARAMS = {"grpo": {"seed": 3, "val_num_generations": 4}, "policy": {"model_path": "/m"}}
SAMPLES = [{"prompt": "1+1=", "completion": " \\boxed{2}", "answer": "2", "reward": 1.0}]


def _log(tmp_path: Path, logger_config: LoggerConfig) -> MetricsLogger:
    logger = MetricsLogger(tmp_path, print_progress=False, trackers=build_trackers(logger_config, tmp_path, PARAMS))
    for step, metrics in STEPS.items():
        logger.log(step, metrics)
    logger.log_samples(2, SAMPLES)
    logger.close()
    return logger


def test_mlflow_file_store(tmp_path: Path) -> None:
    mlflow = pytest.importorskip("mlflow")
    uri = (tmp_path / "store").as_uri()
    config = LoggerConfig(mlflow_enabled=True, mlflow=MLflowConfig("exp", "run-a", uri))
    logger = _log(tmp_path, config)
    client = mlflow.MlflowClient(uri)
    run_id = logger.trackers[0].run_id
    history = {(m.step, m.value) for m in client.get_metric_history(run_id, "val_pass_at_1")}
    assert history == {(step, m["val_pass_at_1"]) for step, m in STEPS.items()}
    run = client.get_run(run_id)
    assert run.info.run_name == "run-a" and run.info.status == "FINISHED"
    assert run.data.params["grpo.val_num_generations"] == "4"
    assert "step" not in run.data.metrics
    local = Path(client.download_artifacts(run_id, "val_samples/step_2.json", str(tmp_path / "dl")))
    assert json.loads(local.read_text()) == SAMPLES
    assert [json.loads(line) for line in (tmp_path / "val_samples.jsonl").read_text().splitlines()] == [
        {"step": 2, **SAMPLES[0]}
    ]


def _wandb_records(path: Path) -> list:
    """The protobuf records of a W&B run file: a 7-byte `:W&B` header, then a LevelDB-style log of 32 KiB blocks
    whose chunks carry a 7-byte header (crc32, little-endian length, kind: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, pending, out = path.read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (length == 0 and kind == 0):  # block trailer or padding
            pos += left
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def test_wandb_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = LoggerConfig(wandb_enabled=True, wandb=WandbConfig(project="p", name="run-b"))
    _log(tmp_path, config)
    # the run file is written by W&B's service process, which may still be writing when `finish` returns (seen
    # under load: a step's history record missing); shutting the service down waits for it
    wandb.teardown()
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    records = _wandb_records(run_file)
    history = [
        {".".join(item.nested_key) or item.key: json.loads(item.value_json) for item in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    for step, metrics in STEPS.items():
        (logged,) = [h for h in history if h["_step"] == step]
        assert {k: logged[k] for k in metrics} == metrics
    assert history[-1]["val_samples.nrows"] == 1
    (table_file,) = run_file.parent.glob("files/media/table/val_samples_2_*.table.json")
    table = json.loads(table_file.read_text())
    assert table["columns"] == list(SAMPLES[0]) and table["data"] == [list(SAMPLES[0].values())]
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.display_name == "run-b" and run.project == "p"
    config_items = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config_items["grpo"] == PARAMS["grpo"]


def test_flatten() -> None:
    assert flatten(PARAMS) == {"grpo.seed": 3, "grpo.val_num_generations": 4, "policy.model_path": "/m"}
