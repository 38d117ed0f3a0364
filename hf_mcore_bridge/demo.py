"""The embedded default job: a tiny Llama-architecture checkpoint converted to TP x PP, verified, exported back."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from hf_mcore_bridge.errors import BridgeError
from hf_mcore_bridge.layout import Layout


def run_demo(workdir: Path, *, tp: int = 2, pp: int = 2) -> Iterator[str]:
    """Build, convert, verify and export back; yields progress lines. Raises if anything disagrees."""
    from safetensors.torch import load_file

    from hf_mcore_bridge.tiny_models import build_tiny_model
    from hf_mcore_bridge.to_hf import convert_mcore_to_hf
    from hf_mcore_bridge.to_mcore import convert_hf_to_mcore
    from hf_mcore_bridge.verify import VerifyJob, verify

    hf_dir, mcore_dir, back_dir = workdir / "hf", workdir / "mcore", workdir / "hf-back"
    build_tiny_model(hf_dir, "LlamaForCausalLM")
    yield f"built a tiny LlamaForCausalLM in {hf_dir}"
    result = convert_hf_to_mcore(hf_dir, mcore_dir, layout=Layout(tp=tp, pp=pp), overwrite=True, show_progress=False)
    yield f"converted to {mcore_dir} for tp={tp} pp={pp}: {result.tensors} chunks in {result.seconds:.2f}s"
    (check,) = verify([VerifyJob(hf_dir, mcore_dir)], Layout(tp=tp, pp=pp))
    yield check.summary()
    if not check.passed:
        raise BridgeError("megatron-core logits differ from HF transformers beyond tolerance")
    convert_mcore_to_hf(mcore_dir, back_dir, overwrite=True, show_progress=False)
    original, exported = load_file(hf_dir / "model.safetensors"), load_file(back_dir / "model.safetensors")
    same = original.keys() == exported.keys() and all(torch.equal(original[k], exported[k]) for k in original)
    if not same:
        raise BridgeError("the exported HF checkpoint differs from the original")
    yield f"exported back to {back_dir}: {len(original)} tensors, bit-identical to the original"
