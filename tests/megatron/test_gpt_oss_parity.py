"""GPT-OSS through real megatron-core: logits equal to transformers' at TP2, PP2, EP2 and TP2 x EP2 (fp32, CPU).

The tiny model (`mappings.gpt_oss`' `tiny`) has a window of 6 on alternate layers, sinks, YaRN, biased router and
experts and a clamp that random weights reach; sequences of 20 tokens are longer than the window. In the EP2 world
the same megatron-core checkpoint is also compared with transformers models that lack the sinks or the window
(their config or weights changed): those must fail, so the check sees both. Biased experts run at expert tensor
parallelism 1 (megatron-core's limit). One gloo world per layout.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_mcore_bridge.convert.layout import Layout
from hf_mcore_bridge.convert.to_mcore import convert_hf_to_mcore
from hf_mcore_bridge.megatron.verify import VerifyJob, verify

pytestmark = pytest.mark.slow

LAYOUTS = {
    "tp2": Layout(tp=2, etp=1),
    "pp2": Layout(pp=2),
    "ep2": Layout(ep=2),
    "tp2ep2": Layout(tp=2, ep=2, etp=1),
}


def _without(hf_dir: Path, root: Path, what: str) -> Path:
    """A copy of the tiny model without its sinks (zero weight in the denominator: logits of -1e4) or window."""
    out = root / f"no-{what}"
    shutil.copytree(hf_dir, out)
    if what == "window":
        config = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**config, "sliding_window": 1000}))
    else:
        tensors = load_file(out / "model.safetensors")
        for name in [n for n in tensors if n.endswith("self_attn.sinks")]:
            tensors[name] = torch.full_like(tensors[name], -1e4)
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_gpt_oss_logit_parity(layout_name: str, tiny_moe_models: dict[str, Path], tmp_path: Path) -> None:
    layout, hf_dir = LAYOUTS[layout_name], tiny_moe_models["gpt_oss"]
    convert_hf_to_mcore(hf_dir, tmp_path / "m", layout=layout, show_progress=False)
    wrong = [_without(hf_dir, tmp_path, what) for what in ("sinks", "window")] if layout_name == "ep2" else []
    results = verify([VerifyJob(d, tmp_path / "m") for d in (hf_dir, *wrong)], layout, seq_len=20)
    assert results[0].max_abs_diff <= 1e-4, results[0].summary()
    assert results[0].top1_agreement == 1.0, results[0].summary()
    for result in results[1:]:
        assert result.max_abs_diff > 1e-3, result.summary()
