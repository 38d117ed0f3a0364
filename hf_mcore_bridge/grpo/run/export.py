"""`bridge export`: a GRPO run's policy as an HF model directory with a model card, optionally uploaded to the Hub.

A megatron-core checkpoint is converted with the ordinary export path (`convert_mcore_to_hf`); a DTensor run's
checkpoint already holds its policy as an HF directory (`grpo.backends.dtensor.checkpoint`), which is copied. The card
names the base model and the training backend, carries the training config and the reward curve (a PNG and a table). The
upload goes through `huggingface_hub` with whatever credentials the user has configured (`HF_TOKEN` or `huggingface-cli
login`); the token is never read, printed or stored here.

Order of work, so that nothing is written for a run that cannot finish: the repo id is checked with
huggingface_hub's own validator, the destination with `destination.check_destination` (never the run itself,
never a directory this tool did not write), then the Hub is reached (`create_repo`, which also proves the
credentials may write there), then the local copy is assembled in a temporary sibling and renamed into place, and
only then uploaded. A retry after a failed upload finds the local copy of the same run and step (its marker says
so) and uploads it as it is. The card names the step that was exported; a `generation_config.json` is always
written (the run's own, else one built from the model config's and tokenizer's special token ids). The reward
curve and the config come from the run directory, or, given its checkpoint directory, from beside it when exactly
one is there (`_find`): never from another run's logs. What the export reads there is a source like the run
itself: the destination may not overlap it.

A LoRA run's megatron checkpoint (`megatron.lora_checkpoint`) exports as the base model with its adapters merged
(W + (B A) * alpha / rank, the product in fp32 and added in the checkpoint's dtype, as PEFT's `merge_and_unload`),
or with `peft=True` as a PEFT adapter directory (`adapter_config.json`, `adapter_model.safetensors`) that
`peft.PeftModel.from_pretrained` loads onto the base model. `peft=True` on a checkpoint without adapters is refused.
A LoRA run's DTensor checkpoint holds its adapters as a PEFT directory and no base weights: `peft=True` rewrites that
directory; the merged export reads the base from where the adapters name it (the run's `policy.model_path`) and merges
them with the same arithmetic, refusing by name when that base is gone.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf_mcore_bridge.checkpoint.destination import (
    MARKER_NAME,
    check_destination,
    check_overlap,
    notice,
    read_marker,
    real_path,
)
from hf_mcore_bridge.checkpoint.megatron_dirs import TRACKER_NAME, resolve_checkpoint
from hf_mcore_bridge.checkpoint.write_errors import written_atomically
from hf_mcore_bridge.convert.to_hf import convert_mcore_to_hf
from hf_mcore_bridge.errors import BridgeError
from hf_mcore_bridge.grpo.backends.dtensor.checkpoint_dirs import adapter_base, adapter_lora, adapter_of, hf_policy_of
from hf_mcore_bridge.grpo.run.metrics import METRICS_FILE, read_metrics
from hf_mcore_bridge.grpo.run.plot import PLOT_FILE, plot_metrics
from hf_mcore_bridge.megatron.lora_config import LoraConfig

CONFIG_FILE = "grpo_config.yaml"
GENERATION_CONFIG_FILE = "generation_config.json"
_EXPORT_COMMAND = "export"
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


def _not_exported(paths: Iterable[Path]) -> list[Path]:
    """Without copies inside an earlier export (which may sit beside the checkpoints and holds a filtered copy)."""
    return sorted(p for p in paths if (read_marker(p.parent) or {}).get("command") != _EXPORT_COMMAND)


def _find(run_dir: Path, name: str) -> Path | None:
    """The run's `name` (its metrics or saved config): under the run directory; or, when given the checkpoint
    directory itself (`RUN/checkpoints`, or `checkpoints/` beside `logs/`), in its parent or one of the parent's
    subdirectories, when exactly one is there. Never a recursive search of the parent: that holds other runs, whose
    reward curve and config the card would show as this run's."""
    found = _not_exported(run_dir.rglob(name))
    if found or not (run_dir / TRACKER_NAME).exists():
        return found[0] if found else None
    parent = run_dir.parent
    beside = _not_exported(p for p in (parent / name, *parent.glob(f"*/{name}")) if p.is_file())
    if len(beside) > 1:
        notice(f"{len(beside)} {name} files beside {run_dir} ({', '.join(map(str, beside))}); none is used")
    return beside[0] if len(beside) == 1 else None


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
    peft: bool = False,
):
    """The README.md of an exported policy; `backend` names what trained it (`megatron-core` or `fsdp2`); `peft`: the
    export is a PEFT adapter directory."""
    library = "peft" if peft else "transformers"
    front = ["---", f"library_name: {library}", "tags:", "- grpo", f"- {backend}", "- reinforcement-learning"]
    if peft:
        front.append("- lora")
    if base_model:
        front.append(f"base_model: {base_model}")
    lines = [*front, "---", "", "# GRPO policy" + (" (LoRA adapter)" if peft else ""), ""]
    exported = f"step {step}" if step is not None else "a release checkpoint (no training step recorded)"
    lines.append(
        f"Trained with GRPO on {_BACKEND_NAMES.get(backend, backend)} with hf-mcore-bridge; exported from {exported}."
    )
    if base_model:
        lines += ["", f"Base model: `{base_model}`."]
    if records:
        lines += ["", "## Reward", "", f"![reward and KL]({PLOT_FILE})", "", "| step | reward | KL |", "|---|---|---|"]
        for record in records:  # a KL the run did not compute (`loss_fn.kl_coef: 0`) is off, not a nan
            kl = f"{record['kl_ref']:.4g}" if "kl_ref" in record else "off"
            lines.append(f"| {record['step']} | {record.get('reward_mean', float('nan')):.4f} | {kl} |")
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
    overwrite_foreign: bool = False,
    peft: bool = False,
) -> ExportResult:
    """Export a run's checkpoint (the latest, or `step`) to `destination`; upload it when `push_to_hub` names a repo.

    `overwrite` replaces an earlier output of this tool, `overwrite_foreign` anything (see `destination`). `peft`: a
    LoRA run's adapters as a PEFT directory instead of the merged model (BridgeError for a run without adapters).
    """
    run_dir, destination = Path(run_dir), Path(destination)
    if push_to_hub is not None:
        check_repo_id(push_to_hub)
    check_overlap(destination, [run_dir, config_path])
    checkpoints = find_checkpoints(run_dir)
    log_dir = find_metrics(run_dir)
    saved_config = config_path or _find(run_dir, CONFIG_FILE)
    sources = [run_dir, log_dir, saved_config]  # what the export reads, which may lie beside the run directory
    check_overlap(destination, sources)
    _, checkpoint_dir = resolve_checkpoint(checkpoints, step)
    exported_step = step_of(checkpoint_dir)
    if peft and checkpoint_lora(checkpoint_dir) is None:
        raise BridgeError(
            f"--peft: {checkpoint_dir} holds no LoRA adapters (the run trained its full weights); export it without"
            " --peft"
        )
    # What makes two exports the same (a retry may reuse the first): the run, the step, the card's base model.
    record = {
        "command": _EXPORT_COMMAND,
        "sources": [str(real_path(run_dir))],
        "step": exported_step,
        "base_model": base_model,
    }
    if peft:
        record["peft"] = True
    reuse = push_to_hub is not None and not (overwrite or overwrite_foreign) and _holds_export(destination, record)
    if not reuse:
        check_destination(destination, sources, overwrite=overwrite, overwrite_foreign=overwrite_foreign)
    api = hub_repo(push_to_hub, private=private) if push_to_hub is not None else None
    if reuse:
        notice(f"{destination} already holds this export (same run, step {exported_step}); uploading it as it is")
    else:
        _write_export(
            checkpoint_dir,
            destination,
            record,
            sources=sources,
            overwrite=overwrite,
            overwrite_foreign=overwrite_foreign,
        )
    url = upload(api, destination, push_to_hub) if api is not None and push_to_hub is not None else None
    return ExportResult(destination, exported_step, url)


def checkpoint_lora(checkpoint_dir: Path) -> LoraConfig | None:
    """The `policy.lora` (rank, alpha, targets) of a checkpoint written by a LoRA run of either backend; None
    otherwise."""
    from hf_mcore_bridge.checkpoint.megatron_dirs import read_common
    from hf_mcore_bridge.megatron.lora_checkpoint import lora_of_common

    if hf_policy_of(checkpoint_dir) is not None:
        return None
    if adapter_of(checkpoint_dir) is not None:
        return adapter_lora(checkpoint_dir)
    return lora_of_common(read_common(checkpoint_dir))


def _dtensor_adapter_policy(
    checkpoint_dir: Path, staging: Path, lora: LoraConfig, peft: bool, base: str | None
) -> None:
    """A DTensor LoRA checkpoint's policy into `staging`: its PEFT directory (`peft`), or its adapters merged into the
    base its adapters name (the run's `policy.model_path`: an HF directory, copied, or a megatron checkpoint,
    converted), in the base's dtype. BridgeError: that base is gone."""
    from hf_mcore_bridge.megatron.lora_checkpoint import merge_adapters
    from hf_mcore_bridge.megatron.lora_peft import read_peft_adapter, write_peft_adapter

    adapter = adapter_of(checkpoint_dir)
    assert adapter is not None
    _, adapters = read_peft_adapter(adapter)
    source = adapter_base(checkpoint_dir)
    if peft:
        write_peft_adapter(adapters, lora, staging, base or source)
        return
    origin = Path(source) if source else None
    if origin is None or not origin.exists():
        raise BridgeError(
            f"{checkpoint_dir} holds LoRA adapters whose base weights are not stored with them; their base"
            f" {source} (the run's policy.model_path) is not there: restore it to export the merged model, or"
            " export the adapters alone with --peft"
        )
    converted = staging / "converted"
    if (origin / "config.json").is_file() and any(origin.glob("*.safetensors")):
        converted.mkdir()
        for file in origin.iterdir():
            if file.is_file() and file.name not in (MARKER_NAME, "README.md"):
                shutil.copy2(file, converted / file.name)
    else:
        convert_mcore_to_hf(origin, converted, show_progress=False)
    merge_adapters(converted, adapters, lora.scale)
    for file in converted.iterdir():
        if file.name != MARKER_NAME:
            file.rename(staging / file.name)
    shutil.rmtree(converted)


def _write_policy(checkpoint_dir: Path, staging: Path, lora: LoraConfig | None, peft: bool, base: str | None) -> None:
    """The policy itself into `staging`: a DTensor run's HF copy; a megatron checkpoint converted to HF (a LoRA
    run's with its adapters merged); or a LoRA run's adapters as a PEFT directory (`peft`)."""
    hf_copy = hf_policy_of(checkpoint_dir)
    if hf_copy is not None:
        for file in hf_copy.iterdir():
            if file.is_file():
                shutil.copy2(file, staging / file.name)
        return
    if lora is not None and adapter_of(checkpoint_dir) is not None:
        _dtensor_adapter_policy(checkpoint_dir, staging, lora, peft, base)
        return
    adapters = None
    if lora is not None:
        from hf_mcore_bridge.checkpoint.megatron_dirs import read_common
        from hf_mcore_bridge.convert.config_bridge import from_megatron_args
        from hf_mcore_bridge.megatron.lora_checkpoint import checkpoint_adapters
        from hf_mcore_bridge.megatron.lora_peft import write_peft_adapter

        model_cfg = from_megatron_args(read_common(checkpoint_dir)["args"])
        adapters = checkpoint_adapters(checkpoint_dir, model_cfg, lora)
        if peft:
            write_peft_adapter(adapters, lora, staging, base)
            return
    # Converted into a subdirectory of the staging directory, so that an interruption leaves nothing outside it;
    # then moved up.
    converted = staging / "converted"
    convert_mcore_to_hf(checkpoint_dir, converted, show_progress=False, lora_base=adapters is not None)
    if adapters is not None and lora is not None:
        from hf_mcore_bridge.megatron.lora_checkpoint import merge_adapters

        merge_adapters(converted, adapters, lora.scale)
    for file in converted.iterdir():
        if file.name != MARKER_NAME:
            file.rename(staging / file.name)
    shutil.rmtree(converted)


def _write_export(
    checkpoint_dir: Path,
    destination: Path,
    record: dict[str, Any],
    *,
    sources: list[Path | None],
    overwrite: bool,
    overwrite_foreign: bool,
) -> None:
    """Assemble the HF directory, metrics, plot, config and card of one export (`record` names step and base
    model; `sources` are the run directory, its log directory and its config, the last two None where absent)."""
    step, base_model = record["step"], record["base_model"]
    _, log_dir, config_file = sources
    records = read_metrics(log_dir) if log_dir else []
    if step is not None:
        records = [r for r in records if r["step"] <= step]
    config_text = Path(config_file).read_text() if config_file else None
    hf_copy = hf_policy_of(checkpoint_dir)
    peft = bool(record.get("peft"))
    with written_atomically(
        destination,
        sources=sources,
        overwrite=overwrite,
        overwrite_foreign=overwrite_foreign,
        record=record,
    ) as staging:
        _write_policy(checkpoint_dir, staging, checkpoint_lora(checkpoint_dir), peft, base_model)
        if not peft:
            write_generation_config(staging)
        if records:
            plot_metrics(records, staging / PLOT_FILE)
            (staging / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in records))
        if config_text:
            (staging / CONFIG_FILE).write_text(config_text)
        backend = "megatron-core" if hf_copy is None and adapter_of(checkpoint_dir) is None else "fsdp2"
        (staging / "README.md").write_text(model_card(base_model, config_text, records, step, backend, peft))


def step_of(checkpoint_dir: Path) -> int | None:
    """The training step of a checkpoint directory (`iter_0000042` -> 42); None for `release`."""
    name = checkpoint_dir.name
    return int(name.removeprefix("iter_")) if name.startswith("iter_") and name[5:].isdigit() else None


def _holds_export(destination: Path, record: dict[str, Any]) -> bool:
    """Whether `destination` is a finished export of the same run and step (a retry after a failed upload)."""
    marker = read_marker(real_path(destination)) if destination.is_dir() else None
    return marker is not None and all(marker.get(key) == value for key, value in record.items())


def write_generation_config(directory: Path) -> None:
    """`generation_config.json` for an HF directory that has none: the special token ids of its config, with the
    tokenizer's filling what the config leaves unset."""
    if (directory / GENERATION_CONFIG_FILE).exists():
        return
    from transformers import AutoConfig, GenerationConfig

    generation = GenerationConfig.from_model_config(AutoConfig.from_pretrained(directory))
    if (directory / "tokenizer_config.json").exists() or (directory / "tokenizer.json").exists():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(directory)
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if getattr(generation, name) is None and getattr(tokenizer, name, None) is not None:
                setattr(generation, name, getattr(tokenizer, name))
    generation.save_pretrained(directory)


def check_repo_id(repo_id: str) -> None:
    """Refuse a Hub repo id that huggingface_hub's own validator refuses (one line)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise BridgeError(f"--push-to-hub {repo_id!r} is not a valid Hub repo id: {str(err).splitlines()[0]}") from None


def _hub_error(action: str, repo_id: str, err: Exception) -> BridgeError:
    """One line for a failed Hub call (network, auth, permissions); the message never holds the token."""
    return BridgeError(f"{action} {repo_id} failed: {type(err).__name__}: {(str(err).splitlines() or [''])[0]}")


def hub_repo(repo_id: str, *, private: bool) -> Any:
    """Reach the Hub before anything is written: create the model repo (if needed) with the user's credentials."""
    from huggingface_hub import HfApi

    api: Any = HfApi()
    try:
        api.create_repo(repo_id=repo_id, repo_type="model", private=private, exist_ok=True)
    except Exception as err:
        raise _hub_error("reaching the Hub repo", repo_id, err) from None
    return api


def upload(api: Any, folder: Path, repo_id: str) -> str:
    """Upload `folder` (without this tool's marker) to the repo `hub_repo` reached."""
    try:
        commit = api.upload_folder(
            repo_id=repo_id,
            repo_type="model",
            folder_path=str(folder),
            commit_message="Upload GRPO policy",
            ignore_patterns=[MARKER_NAME],
        )
    except Exception as err:
        raise _hub_error("upload to", repo_id, err) from None
    return str(getattr(commit, "commit_url", None) or f"https://huggingface.co/{repo_id}")
