"""`bridge export`: a GRPO run's policy as an HF model directory with a model card, optionally uploaded to the Hub.

A megatron-core checkpoint is converted with the ordinary export path (`convert_mcore_to_hf`); a DTensor run's
checkpoint already holds its policy as an HF directory (`grpo.dtensor_checkpoint`), which is copied. The card names
the base model and the training backend,
carries the training config and the reward curve (a PNG and a table). The upload goes through `huggingface_hub`
with whatever credentials the user has configured (`HF_TOKEN` or `huggingface-cli login`); the token is never
read, printed or stored here. Everything is assembled in a temporary sibling and renamed into place.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf_mcore_bridge.atomic import atomic_directory
from hf_mcore_bridge.errors import BridgeError
from hf_mcore_bridge.grpo.dtensor_checkpoint import hf_policy_of
from hf_mcore_bridge.grpo.metrics import METRICS_FILE, read_metrics
from hf_mcore_bridge.grpo.plot import PLOT_FILE, plot_metrics
from hf_mcore_bridge.megatron_dirs import TRACKER_NAME, resolve_checkpoint
from hf_mcore_bridge.to_hf import convert_mcore_to_hf

CONFIG_FILE = "grpo_config.yaml"
_BACKEND_NAMES = {"megatron-core": "megatron-core", "fsdp2": "PyTorch FSDP2 (DTensor)"}


@dataclass(frozen=True)
class ExportResult:
    destination: Path
    step: int | None
    repo_url: str | None


def find_checkpoints(run_dir: Path) -> Path:
    """The checkpoint root of a run: the directory itself, or its `checkpoints/`."""
    for candidate in (run_dir, run_dir / "checkpoints"):
        if (candidate / TRACKER_NAME).exists():
            return candidate
    raise BridgeError(f"{run_dir} holds no checkpoints (no {TRACKER_NAME} in it or in checkpoints/)")


def _find(run_dir: Path, name: str) -> Path | None:
    """`name` under the run directory or, when given the checkpoint directory itself, under its parent."""
    for root in (run_dir, run_dir.parent):
        found = sorted(root.rglob(name))
        if found:
            return found[0]
    return None


def find_metrics(run_dir: Path) -> Path | None:
    """The log directory holding the run's `metrics.jsonl`, if any."""
    found = _find(run_dir, METRICS_FILE)
    return found.parent if found else None


def model_card(
    base_model: str | None,
    config_text: str | None,
    records: list[dict[str, float]],
    step: int | None,
    backend: str = "megatron-core",
):
    """The README.md of an exported policy; `backend` names what trained it (`megatron-core` or `fsdp2`)."""
    front = ["---", "library_name: transformers", "tags:", "- grpo", f"- {backend}", "- reinforcement-learning"]
    if base_model:
        front.append(f"base_model: {base_model}")
    lines = [*front, "---", "", "# GRPO policy", ""]
    lines.append(
        f"Trained with GRPO on {_BACKEND_NAMES.get(backend, backend)} with hf-mcore-bridge; exported from step"
        f" {step if step else 'latest'}."
    )
    if base_model:
        lines += ["", f"Base model: `{base_model}`."]
    if records:
        lines += ["", "## Reward", "", f"![reward and KL]({PLOT_FILE})", "", "| step | reward | KL |", "|---|---|---|"]
        for record in records:
            lines.append(
                f"| {record['step']} | {record.get('reward_mean', float('nan')):.4f} | "
                f"{record.get('kl_ref', float('nan')):.4g} |"
            )
    if config_text:
        lines += ["", "## Training configuration", "", "```yaml", config_text.rstrip(), "```"]
    return "\n".join(lines) + "\n"


def export_run(
    run_dir: Path | str,
    destination: Path | str,
    *,
    step: int | None = None,
    base_model: str | None = None,
    config_path: Path | None = None,
    push_to_hub: str | None = None,
    private: bool = False,
    overwrite: bool = False,
) -> ExportResult:
    """Export a run's checkpoint (the latest, or `step`) to `destination`; upload it when `push_to_hub` names a repo."""
    run_dir, destination = Path(run_dir), Path(destination)
    checkpoints = find_checkpoints(run_dir)
    log_dir = find_metrics(run_dir)
    records = read_metrics(log_dir) if log_dir else []
    if step is not None:
        records = [r for r in records if r["step"] <= step]
    config_text = Path(config_path).read_text() if config_path else _saved_config(run_dir)
    _, checkpoint_dir = resolve_checkpoint(checkpoints, step)
    hf_copy = hf_policy_of(checkpoint_dir)
    with atomic_directory(destination, overwrite=overwrite) as staging:
        if hf_copy is not None:
            for file in hf_copy.iterdir():
                shutil.copy2(file, staging / file.name)
        else:
            convert_mcore_to_hf(checkpoints, staging, iteration=step, overwrite=True, show_progress=False)
        if records:
            plot_metrics(records, staging / PLOT_FILE)
            (staging / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in records))
        if config_text:
            (staging / CONFIG_FILE).write_text(config_text)
        backend = "megatron-core" if hf_copy is None else "fsdp2"
        (staging / "README.md").write_text(model_card(base_model, config_text, records, step, backend))
    url = upload(destination, push_to_hub, private=private) if push_to_hub else None
    return ExportResult(destination, step, url)


def _saved_config(run_dir: Path) -> str | None:
    found = _find(run_dir, CONFIG_FILE)
    return found.read_text() if found else None


def upload(folder: Path, repo_id: str, *, private: bool) -> str:
    """Create (if needed) and upload to a Hub model repo with the user's configured credentials."""
    from huggingface_hub import HfApi

    api: Any = HfApi()
    try:
        api.create_repo(repo_id=repo_id, repo_type="model", private=private, exist_ok=True)
        commit = api.upload_folder(
            repo_id=repo_id, repo_type="model", folder_path=str(folder), commit_message="Upload GRPO policy"
        )
    except Exception as err:  # network, auth, permissions: one line, no token in it
        raise BridgeError(f"upload to {repo_id} failed: {type(err).__name__}: {str(err).splitlines()[0]}") from None
    return str(getattr(commit, "commit_url", None) or f"https://huggingface.co/{repo_id}")
