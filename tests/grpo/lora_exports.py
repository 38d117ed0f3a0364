"""The exports of a LoRA run checked against PEFT (shared by both backends' checkpoint tests): `bridge export --peft`
wrote the adapters the run gathered from its live model, PEFT loads them onto the base model with the logits of the
merged export, and the merged export equals PEFT's `merge_and_unload` tensor by tensor (transformers 5's fused
routed experts cut into the checkpoint's per-expert tensors here, `per_expert`). Assumes the tiny policy of
`tiny_policy` (its word vocabulary), fp32 HF directories, and Qwen3-MoE's expert names (gate/up/down_proj)."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors.torch import load_file

from .tiny_policy import WORDS

_FUSED = re.compile(r"(.+\.mlp\.experts)\.(gate_up_proj|down_proj)")


def per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A transformers-5 state dict with each fused expert tensor (`...mlp.experts.gate_up_proj` [experts, 2 ffn,
    hidden], gate rows then up rows; `down_proj` [experts, hidden, ffn]) replaced by the checkpoint's per-expert
    tensors (`...mlp.experts.3.gate_proj.weight`, `up_proj`, `down_proj`); other tensors as they are."""
    result = {}
    for name, tensor in state.items():
        found = _FUSED.fullmatch(name)
        if found is None:
            result[name] = tensor
            continue
        for e, one in enumerate(tensor):
            if found[2] == "down_proj":
                result[f"{found[1]}.{e}.down_proj.weight"] = one
            else:
                half = one.shape[0] // 2
                result[f"{found[1]}.{e}.gate_proj.weight"] = one[:half]
                result[f"{found[1]}.{e}.up_proj.weight"] = one[half:]
    return result


def export_both(checkpoint: Path, out_dir: Path) -> tuple[Path, Path]:
    """`bridge export` of a LoRA run's checkpoint as a PEFT directory (`--peft`) and merged, into `out_dir/adapter`
    and `out_dir/merged`, each exiting 0; returns the two directories."""
    from typer.testing import CliRunner

    from hf_mcore_bridge.cli.main import app

    adapter, merged = out_dir / "adapter", out_dir / "merged"
    for out, extra in ((adapter, ["--peft"]), (merged, [])):
        result = CliRunner().invoke(app, ["export", str(checkpoint), str(out), *extra])
        assert result.exit_code == 0, result.output
    return adapter, merged


def check_lora_exports(adapter: Path, merged: Path, live: Path, policy: Path) -> None:
    """`adapter`: the `--peft` export, `merged`: the merged export, `live`: the adapter directory the run wrote from
    its live model, `policy`: the base HF directory."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    exported = load_file(adapter / "adapter_model.safetensors")
    gathered = load_file(live / "adapter_model.safetensors")
    assert exported.keys() == gathered.keys() and all(torch.equal(exported[k], gathered[k]) for k in gathered)
    assert "library_name: peft" in (adapter / "README.md").read_text()

    base = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    with_adapter = PeftModel.from_pretrained(base, adapter).eval()
    merged_model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    ids = torch.randint(0, len(WORDS), (3, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        peft_logits = with_adapter(input_ids=ids).logits
        merged_logits = merged_model(input_ids=ids).logits
        base_logits = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32).eval()(input_ids=ids).logits
    torch.testing.assert_close(merged_logits, peft_logits, rtol=1e-5, atol=1e-5)
    assert (merged_logits - base_logits).abs().max() > 1e-3  # the adapters changed the model

    reference = per_expert(with_adapter.merge_and_unload().state_dict())
    written = load_file(merged / "model.safetensors")
    assert written.keys() == reference.keys(), sorted(written.keys() ^ reference.keys())
    assert all(torch.equal(written[k], reference[k]) for k in written), [
        k for k in written if not torch.equal(written[k], reference[k])
    ]
