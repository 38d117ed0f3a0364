"""Qwen3.5's text model (`Qwen3_5ForCausalLM`): its checkpoint as megatron-core names and splits it, bit-exact round
trips in bf16 at TP1 and TP2 (TP2 x PP2 fp32: `test_every_architecture`), the legacy per-rank files holding each
rank's shards as megatron-core's modules hold them (against a mapping written in the test, `gdn_ranks`), what is
refused by name, and the description read from a Qwen3.5 config as published (`full_attention_interval`,
rope_parameters with `mrope_section`).

Logit parity of converted checkpoints through megatron-core at TP1, TP2 and PP2: `megatron/test_gated_delta_net`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gdn_ranks import _gated_qkv, _layer_tensors
from hf_weights import assert_same_weights, read_weights
from transformers import AutoConfig

from hf_mcore_bridge.checkpoint.dcp_reader import DCPCheckpoint
from hf_mcore_bridge.checkpoint.megatron_dirs import resolve_checkpoint
from hf_mcore_bridge.convert import config_bridge, legacy_format
from hf_mcore_bridge.convert.layout import Layout
from hf_mcore_bridge.convert.to_hf import convert_mcore_to_hf
from hf_mcore_bridge.convert.to_mcore import convert_hf_to_mcore
from hf_mcore_bridge.errors import BridgeError
from hf_mcore_bridge.models.parallel_style import Parallel
from hf_mcore_bridge.models.spec import ModelSpec
from hf_mcore_bridge.models.tensor_ops import rank_shard
from hf_mcore_bridge.models.tiny_models import build_tiny_model, tiny_config

NAME = "Qwen3_5ForCausalLM"

PUBLISHED_TEXT = {
    "architectures": [NAME],
    "model_type": "qwen3_5_text",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 24,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 16,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 4,
    "vocab_size": 248320,
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000000,
        "partial_rotary_factor": 0.25,
        "mrope_interleaved": True,
        "mrope_section": [11, 11, 10],
    },
}
"""A Qwen3.5-2B-shaped text config in the published form: no `layer_types`, RoPE with its multimodal sections."""


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("q35") / "hf", NAME, seed=3, dtype=torch.bfloat16)


def test_the_published_config_is_read_as_transformers_reads_it() -> None:
    spec = config_bridge.megatron_spec(PUBLISHED_TEXT)
    config = dict(PUBLISHED_TEXT)
    theirs = AutoConfig.for_model(config.pop("model_type"), **config)
    assert list(spec.layer_types) == list(theirs.layer_types)
    assert spec.layer_types[:4] == ("linear_attention",) * 3 + ("full_attention",)
    assert spec.rope.partial_rotary_factor == 0.25 and spec.rope.theta == 1e7
    assert ModelSpec.from_hf(theirs) == spec
    from megatron.core.transformer import TransformerConfig

    made = TransformerConfig(**config_bridge.transformer_config_kwargs(spec, Layout(tp=2), torch.bfloat16))
    assert made.experimental_attention_variant == "gated_delta_net" and made.attention_output_gate
    assert made.linear_attention_freq == [int((i + 1) % 4 != 0) for i in range(24)]
    assert made.linear_num_value_heads == 16 and made.layernorm_zero_centered_gamma


@pytest.mark.parametrize("layout", [Layout(), Layout(tp=2)], ids=["tp1", "tp2"])
def test_checkpoint_names_and_parts_are_megatron_cores(tiny_bf16, layout, tmp_path) -> None:
    """Gated DeltaNet's `in_proj` and `conv1d` stored in megatron-core's parts (`<key>.query`, ...; the layer's
    input norm beside `in_proj`), the gated `linear_qkv` in megatron-core's per-group order (checked against a
    layout written in the test), per-layer keys; and back to the same bf16 tensors."""
    convert_hf_to_mcore(tiny_bf16, tmp_path / "mc", layout=layout, show_progress=False)
    dcp = DCPCheckpoint(resolve_checkpoint(tmp_path / "mc")[1])
    keys = set(dcp.tensor_keys())
    hf = read_weights(tiny_bf16)
    config = AutoConfig.from_pretrained(tiny_bf16)
    linear = "decoder.layers.0.self_attention."
    parts = ("query", "key", "value", "z", "beta", "alpha")
    assert {f"{linear}in_proj.weight.{p}" for p in parts} <= keys and f"{linear}in_proj.weight" not in keys
    assert {f"{linear}conv1d.weight.{p}" for p in parts[:3]} <= keys
    assert f"{linear}in_proj.layer_norm_weight" in keys and f"{linear}linear_qkv.weight" not in keys
    key_dim = config.linear_num_key_heads * config.linear_key_head_dim
    qkv = hf["model.layers.0.linear_attn.in_proj_qkv.weight"]
    assert torch.equal(dcp.read(f"{linear}in_proj.weight.key"), qkv[key_dim : 2 * key_dim])
    assert torch.equal(dcp.read(f"{linear}in_proj.weight.alpha"), hf["model.layers.0.linear_attn.in_proj_a.weight"])
    full, hf_full = "decoder.layers.3.self_attention.", "model.layers.3.self_attn."
    expected = _gated_qkv(*(hf[f"{hf_full}{n}_proj.weight"] for n in "qkv"), config)
    assert torch.equal(dcp.read(f"{full}linear_qkv.weight"), expected)
    assert f"{full}in_proj.weight.query" not in keys
    convert_mcore_to_hf(tmp_path / "mc", tmp_path / "back", show_progress=False)
    assert_same_weights(tiny_bf16, tmp_path / "back")


LEGACY_LAYOUT = Layout(tp=2, pp=2)


def plain_column_split(full, parallel, tp, rank, parts=()):
    """A broken `rank_shard` for the legacy writer: a tensor of parts split as one plain column split."""
    return rank_shard(full, Parallel.COLUMN if parallel is Parallel.COLUMN_PARTS else parallel, tp, rank)


def _legacy_mismatches(root: Path, hf_dir: Path, layout: Layout) -> list[str]:
    """The decoder-layer tensors of the legacy rank files (local spec) that differ from what megatron-core's modules
    hold at that rank, built from the HF weights by the mapping written in `gdn_ranks` (each part of `in_proj` and
    `conv1d` split over TP on its own); the rank files' layer tensors must be exactly those names."""
    config = AutoConfig.from_pretrained(hf_dir)
    weights = read_weights(hf_dir)
    per_stage = config.num_hidden_layers // layout.pp
    checkpoint_dir = resolve_checkpoint(root)[1]
    differing = []
    for pp_rank in range(layout.pp):
        for tp_rank in range(layout.tp):
            path = checkpoint_dir / legacy_format.rank_dirname(tp_rank, pp_rank, 0, layout) / legacy_format.FILE_NAME
            state = torch.load(path, weights_only=False)["model"]
            held = {n: t for n, t in state.items() if n.startswith("decoder.layers.") and isinstance(t, torch.Tensor)}
            expected = {
                f"decoder.layers.{local}.{name}": tensor
                for local in range(per_stage)
                for name, tensor in _layer_tensors(
                    weights, pp_rank * per_stage + local, config, layout.tp, tp_rank
                ).items()
            }
            assert sorted(held) == sorted(expected), path
            differing += [f"{path.parent.name}/{n}" for n in expected if not torch.equal(held[n], expected[n])]
    return differing


def test_legacy_rank_files_hold_megatron_cores_shards(tiny_models, tmp_path, monkeypatch) -> None:
    """Every rank's `in_proj` (`[q_r; k_r; v_r; z_r; b_r; a_r]`), `conv1d` and the rest at TP2 x PP2 as written in
    the test; the check fails on files whose parts were split as one plain column split."""
    hf_dir = tiny_models["qwen3_5"]
    kwargs = {"layout": LEGACY_LAYOUT, "spec": "local", "checkpoint_format": "torch", "show_progress": False}
    convert_hf_to_mcore(hf_dir, tmp_path / "m", **kwargs)
    assert _legacy_mismatches(tmp_path / "m", hf_dir, LEGACY_LAYOUT) == []
    monkeypatch.setattr(legacy_format, "rank_shard", plain_column_split)
    convert_hf_to_mcore(hf_dir, tmp_path / "broken", **kwargs)
    differing = _legacy_mismatches(tmp_path / "broken", hf_dir, LEGACY_LAYOUT)
    assert differing and {n.rsplit(".", 1)[0].split(".", 3)[-1] for n in differing} == {
        "self_attention.in_proj",
        "self_attention.conv1d",
    }


def test_what_is_not_supported_is_refused_by_name(tiny_bf16, tmp_path) -> None:
    with pytest.raises(BridgeError, match=f"cp=2: {NAME}'s Gated DeltaNet layers are not computed"):
        convert_hf_to_mcore(tiny_bf16, tmp_path / "b", layout=Layout(cp=2), show_progress=False)
    assert not (tmp_path / "b").exists()


VISION = {
    "depth": 1,
    "hidden_size": 16,
    "intermediate_size": 24,
    "num_heads": 2,
    "out_hidden_size": 64,
    "patch_size": 2,
    "spatial_merge_size": 1,
    "temporal_patch_size": 1,
}
"""A one-block vision tower (transformers' `Qwen3_5VisionConfig` fields)."""


def _qwen3_5_vl(directory: Path) -> torch.nn.Module:
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = tiny_config(NAME)
    del text["architectures"]
    torch.manual_seed(7)
    model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=VISION)).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(directory)
    return model


def _raw(directory: Path) -> dict[str, bytes]:
    return {
        name: t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for name, t in read_weights(directory).items()
    }


def test_the_vision_language_release_converts_its_language_model_and_exports_the_whole_class(tmp_path) -> None:
    """`Qwen3_5ForConditionalGeneration` at TP2 x PP2 and back: one line saying what converted, the vision tower
    carried, every tensor's bytes and `config.json` as they were, transformers' text logits the source's."""
    from transformers import AutoModelForImageTextToText

    model = _qwen3_5_vl(tmp_path / "hf")
    result = convert_hf_to_mcore(tmp_path / "hf", tmp_path / "m", layout=Layout(tp=2, pp=2), show_progress=False)
    (note,) = result.notes
    assert f"Qwen3_5ForConditionalGeneration: its language model ({NAME}) converted" in note
    keys = DCPCheckpoint(resolve_checkpoint(tmp_path / "m")[1]).tensor_keys()
    assert not any("visual" in key for key in keys)
    convert_mcore_to_hf(tmp_path / "m", tmp_path / "back", show_progress=False)
    original, back = _raw(tmp_path / "hf"), _raw(tmp_path / "back")
    assert sorted(back) == sorted(original) and any(name.startswith("model.visual.") for name in back)
    assert [name for name in original if back[name] != original[name]] == []
    assert (tmp_path / "back" / "config.json").read_bytes() == (tmp_path / "hf" / "config.json").read_bytes()
    loaded = AutoModelForImageTextToText.from_pretrained(tmp_path / "back", dtype=torch.float32).eval()
    tokens = torch.randint(0, 200, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=tokens).logits, model(input_ids=tokens).logits)
