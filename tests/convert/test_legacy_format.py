"""The legacy per-rank `torch` format: written exactly at a layout (megatron-core loads each rank's file with
strict=True and gives HF's logits), read back bit-exactly, in both layer-spec namings; the hybrid Gated DeltaNet
models included (their rank files against megatron-core's shards written in the test: `test_qwen3_5`)."""

from __future__ import annotations

import pytest
import torch
from hf_weights import assert_same_weights
from megatron_ranks import legacy_load_rank, legacy_load_ranks
from test_qwen3_5 import plain_column_split
from test_roundtrip import LAYOUTS

from hf_mcore_bridge.convert import legacy_format
from hf_mcore_bridge.convert.layout import Layout
from hf_mcore_bridge.convert.to_hf import convert_mcore_to_hf
from hf_mcore_bridge.convert.to_mcore import convert_hf_to_mcore
from hf_mcore_bridge.megatron.verify import _hf_logits
from hf_mcore_bridge.megatron.world import run_world


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_legacy_round_trip_is_bit_exact(layout_name, dtype, tiny_models, tiny_models_bf16, tmp_path):
    models = tiny_models if dtype == "fp32" else tiny_models_bf16
    for spec in ("te", "local"):
        for name, hf_dir in models.items():
            mcore, back = tmp_path / f"{name}-{spec}", tmp_path / f"{name}-{spec}-hf"
            convert_hf_to_mcore(
                hf_dir, mcore, layout=LAYOUTS[layout_name], spec=spec, checkpoint_format="torch", show_progress=False
            )
            convert_mcore_to_hf(mcore, back, show_progress=False)
            assert_same_weights(hf_dir, back)


@pytest.mark.parametrize("name", ["qwen3_5_moe", "qwen3_next"])
def test_hybrid_moe_legacy_round_trip_is_bit_exact(name, tiny_moe_models, tmp_path):
    """Gated DeltaNet beside routed experts (Qwen3-Next: its fused projections, a dense layer) at TP2 x PP2 x EP2,
    the local spec the legacy format writes MoE models for."""
    layout = Layout(tp=2, pp=2, ep=2)
    hf_dir = tiny_moe_models[name]
    convert_hf_to_mcore(
        hf_dir, tmp_path / "m", layout=layout, spec="local", checkpoint_format="torch", show_progress=False
    )
    release = tmp_path / "m" / "release"
    assert len(list(release.glob("mp_rank_*_*_*/model_optim_rng.pt"))) == 8
    convert_mcore_to_hf(tmp_path / "m", tmp_path / "back", show_progress=False)
    assert_same_weights(hf_dir, tmp_path / "back")


def test_legacy_layout_on_disk(tiny_models, tmp_path):
    convert_hf_to_mcore(
        tiny_models["llama"],
        tmp_path / "m",
        layout=Layout(tp=2, pp=4, vpp=2),
        checkpoint_format="torch",
        spec="local",
        show_progress=False,
    )
    release = tmp_path / "m" / "release"
    assert sorted(p.name for p in release.iterdir()) == [f"mp_rank_{t:02d}_{p:03d}" for t in range(2) for p in range(4)]
    state = torch.load(release / "mp_rank_01_003" / "model_optim_rng.pt", weights_only=False)
    assert sorted(k for k in state if k.startswith("model")) == ["model0", "model1"]
    assert state["checkpoint_version"] == 3.0 and state["args"].tensor_model_parallel_size == 2
    last = state["model1"]  # the last virtual stage of the last pipeline rank: layer 7, numbered 0 locally
    assert "decoder.layers.0.input_layernorm.weight" in last and "decoder.layers.1.input_layernorm.weight" not in last
    assert last["decoder.layers.0.mlp.linear_fc1.weight"].shape == (96, 64)  # [gate_r; up_r] of ffn 96 at tp 2
    assert last["output_layer.weight"].shape == (128, 64)  # 211 padded to 256, half per TP rank


STRICT_WORLDS = {"llama_tied": ("llama_tied", "qwen3_5"), "qwen2": ("qwen2",)}
"""The models each TP2 x PP2 world loads (the hybrid Qwen3.5 in the world of the default tier: start-up is the cost)."""
BROKEN = "qwen3_5-plain-columns"
"""Qwen3.5's legacy files with Gated DeltaNet's parts split as one plain column split: loaded strictly (the shapes
are right) but not transformers' logits, which the check says."""


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(STRICT_WORLDS))
def test_megatron_core_loads_legacy_files_strictly(variant, tiny_models, tmp_path, monkeypatch):
    layout = Layout(tp=2, pp=2)
    names = STRICT_WORLDS[variant]
    hf_dirs = {name: tiny_models[name] for name in names}
    kwargs = {"layout": layout, "checkpoint_format": "torch", "spec": "local", "show_progress": False}
    for name, hf_dir in hf_dirs.items():
        convert_hf_to_mcore(hf_dir, tmp_path / name, **kwargs)
    if "qwen3_5" in names:
        with monkeypatch.context() as patch:
            patch.setattr(legacy_format, "rank_shard", plain_column_split)
            convert_hf_to_mcore(tiny_models["qwen3_5"], tmp_path / BROKEN, **kwargs)
    tokens = torch.randint(0, 211, (2, 10), generator=torch.Generator().manual_seed(5))
    loaded = [*names, BROKEN] if "qwen3_5" in names else list(names)
    jobs = [(str(tmp_path / name), str(tmp_path / f"{name}.pt")) for name in loaded]
    run_world(legacy_load_ranks, layout, jobs, layout, tokens)
    for name in loaded:
        megatron_logits = torch.load(tmp_path / f"{name}.pt", weights_only=True)
        difference = (megatron_logits - _hf_logits(hf_dirs.get(name, tiny_models["qwen3_5"]), tokens, "fp32")).abs()
        if name == BROKEN:
            assert difference.max() > 1e-2, name
        else:
            assert difference.max() <= 1e-4, name


@pytest.mark.slow
def test_megatron_core_loads_interleaved_legacy_files_strictly(tiny_models, tmp_path):
    layout = Layout(pp=2, vpp=2)
    convert_hf_to_mcore(
        tiny_models["qwen3"],
        tmp_path / "m",
        layout=layout,
        checkpoint_format="torch",
        spec="local",
        show_progress=False,
    )
    run_world(legacy_load_rank, layout, str(tmp_path / "m"), layout, torch.zeros(1, 1), str(tmp_path / "unused"))
