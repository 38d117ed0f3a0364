"""The embedded default job: a tiny Llama-architecture checkpoint converted to TP x PP, verified, exported back.

The demo's directory is one output of this tool like any other (`atomic.atomic_directory`): built whole in a
temporary sibling and renamed into place, refused when it is not empty unless `overwrite` (a directory an earlier
demo wrote) or `overwrite_foreign` (anything) says to replace it. A failure to write (a full disk) is one line
naming the file and the cause (`write_errors`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from hf_mcore_bridge.checkpoint.atomic import atomic_directory
from hf_mcore_bridge.checkpoint.destination import check_destination
from hf_mcore_bridge.checkpoint.write_errors import reported_write_errors
from hf_mcore_bridge.convert.layout import Layout, validate_layout
from hf_mcore_bridge.errors import BridgeError
from hf_mcore_bridge.models.spec import ModelSpec

ARCHITECTURE = "LlamaForCausalLM"
"""The demo's model: `tiny_models.tiny_config` of this architecture."""


def run_demo(
    workdir: Path, *, tp: int = 2, pp: int = 2, overwrite: bool = False, overwrite_foreign: bool = False
) -> Iterator[str]:
    """Build, convert, verify and export back; yields progress lines. Raises if anything disagrees; a layout the
    tiny model cannot take or a destination that may not be written is refused before anything is built."""
    from hf_mcore_bridge.models.tiny_models import tiny_config

    validate_layout(Layout(tp=tp, pp=pp), ModelSpec.from_hf(tiny_config(ARCHITECTURE)))
    check_destination(workdir, overwrite=overwrite, overwrite_foreign=overwrite_foreign)
    from safetensors.torch import load_file

    from hf_mcore_bridge.convert.to_hf import convert_mcore_to_hf
    from hf_mcore_bridge.convert.to_mcore import convert_hf_to_mcore
    from hf_mcore_bridge.megatron.verify import VerifyJob, verify
    from hf_mcore_bridge.models.tiny_models import build_tiny_model

    with (
        reported_write_errors(None, workdir),
        atomic_directory(
            workdir, overwrite=overwrite, overwrite_foreign=overwrite_foreign, record={"command": "demo"}
        ) as staging,
    ):
        # Lines name where things will be once the directory is in place, not the temporary sibling.
        def shown(path: Path) -> Path:
            return workdir / path.relative_to(staging)

        hf_dir, mcore_dir, back_dir = staging / "hf", staging / "mcore", staging / "hf-back"
        with reported_write_errors(staging, workdir):  # the conversions report their own write failures
            build_tiny_model(hf_dir, ARCHITECTURE)
        yield f"built a tiny {ARCHITECTURE} in {shown(hf_dir)}"
        result = convert_hf_to_mcore(hf_dir, mcore_dir, layout=Layout(tp=tp, pp=pp), show_progress=False)
        yield f"converted to {shown(mcore_dir)} for tp={tp} pp={pp}: {result.tensors} chunks in {result.seconds:.2f}s"
        (check,) = verify([VerifyJob(hf_dir, mcore_dir)], Layout(tp=tp, pp=pp))
        yield check.summary().replace(str(mcore_dir), str(shown(mcore_dir)))
        if not check.passed:
            raise BridgeError("megatron-core logits differ from HF transformers beyond tolerance")
        convert_mcore_to_hf(mcore_dir, back_dir, show_progress=False)
        original, exported = load_file(hf_dir / "model.safetensors"), load_file(back_dir / "model.safetensors")
        same = original.keys() == exported.keys() and all(torch.equal(original[k], exported[k]) for k in original)
        if not same:
            raise BridgeError("the exported HF checkpoint differs from the original")
        yield f"exported back to {shown(back_dir)}: {len(original)} tensors, bit-identical to the original"
    yield f"wrote {workdir}"
