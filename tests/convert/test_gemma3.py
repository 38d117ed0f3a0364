"""Gemma 3: the published 270M config through megatron-core's `TransformerConfig`, transformers' per-layer-type RoPE
reading, what the description and megatron-core refuse (by name), and that the megatron-core parity check fails
when any of Gemma's own pieces is left out of the model megatron-core builds.

Round trips at every layout and format, and logit parity through megatron-core at TP2, PP2 and TP2 x PP2 (8
layers, window 6, 24-token sequences), come with the tiny model in `tiny_variants.VARIANTS`."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from published_configs import PUBLISHED
from transformers import AutoConfig

from hf_mcore_bridge.checkpoint.megatron_dirs import read_common
from hf_mcore_bridge.convert import config_bridge
from hf_mcore_bridge.convert.layout import Layout
from hf_mcore_bridge.convert.to_mcore import convert_hf_to_mcore
from hf_mcore_bridge.megatron.verify import VerifyJob, verify
from hf_mcore_bridge.models.config_errors import ConfigError
from hf_mcore_bridge.models.spec import ModelSpec
from hf_mcore_bridge.models.tiny_models import build_tiny_model

GEMMA3_270M = PUBLISHED["google/gemma-3-270m"]
GEMMA3_4B_IT = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "boi_token_index": 255999,
    "eoi_token_index": 256000,
    "eos_token_id": [1, 106],
    "image_token_index": 262144,
    "initializer_range": 0.02,
    "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "model_type": "gemma3_text",
        "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
    "torch_dtype": "bfloat16",
    "vision_config": {
        "hidden_size": 1152,
        "image_size": 896,
        "intermediate_size": 4304,
        "model_type": "siglip_vision_model",
        "num_attention_heads": 16,
        "num_hidden_layers": 27,
        "patch_size": 14,
        "vision_use_head": False,
    },
}
"""google/gemma-3-4b-it's config.json as published: its text_config states few fields (transformers' defaults fill
the rest, `layer_types` derived from `sliding_window_pattern`), linear RoPE scaling on the full layers."""


def test_published_config_is_described_and_built_as_transformers_reads_it() -> None:
    spec = config_bridge.megatron_spec(GEMMA3_270M)
    config = dict(GEMMA3_270M)
    theirs = AutoConfig.for_model(config.pop("model_type"), **config)
    assert ModelSpec.from_hf(theirs) == spec  # transformers 5's per-layer-type rope_parameters
    assert spec.sliding_rope is not None and spec.sliding_rope.theta == 10000.0 and spec.rope.theta == 1e6
    assert spec.softmax_scale == 256**-0.5 and spec.hidden_act == "gelu_pytorch_tanh"
    assert spec.layer_types.count("full_attention") == 3 and spec.sliding_window == 512
    from megatron.core.transformer import TransformerConfig

    kwargs = config_bridge.transformer_config_kwargs(spec, Layout(), torch.bfloat16)
    made = TransformerConfig(**kwargs)
    assert made.layernorm_zero_centered_gamma and made.qk_layernorm and made.softmax_scale == 256**-0.5
    assert made.window_size == (511, 0) and made.window_attn_skip_freq == [int((i + 1) % 6 != 0) for i in range(18)]
    x = torch.linspace(-4, 4, 101)
    assert torch.equal(made.activation_func(x), torch.nn.functional.gelu(x, approximate="tanh"))


def test_the_4b_vision_language_config_is_read_as_transformers_fills_it() -> None:
    spec = config_bridge.megatron_spec(GEMMA3_4B_IT)
    config = dict(GEMMA3_4B_IT)
    theirs = AutoConfig.for_model(config.pop("model_type"), **config)
    assert ModelSpec.from_hf(theirs) == spec  # every default and the derived layer_types as transformers has them
    assert spec.layer_types == tuple(theirs.text_config.layer_types) and spec.layer_types[5] == "full_attention"
    assert (spec.rope.rope_type, spec.rope.factor, spec.sliding_rope.theta) == ("linear", 8.0, 10000.0)
    assert (spec.num_attention_heads, spec.num_query_groups, spec.head_dim, spec.vocab_size) == (8, 4, 256, 262208)
    kwargs = config_bridge.gpt_model_kwargs(spec, config_bridge.padded_vocab(spec, Layout(tp=2)))
    assert kwargs["seq_len_interpolation_factor"] == 8.0 and kwargs["rotary_base"] == 1e6


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"layer_types": None, "sliding_window_pattern": 0}, "sliding_window_pattern"),
    ],
)
def test_what_the_description_cannot_hold_is_refused_by_name(change: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        ModelSpec.from_hf({**GEMMA3_270M, **change})


def test_what_megatron_core_cannot_compute_is_refused_by_name() -> None:
    local = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    params = {"full_attention": {"rope_type": "default", "rope_theta": 1e6}, "sliding_attention": local}
    config = {k: v for k, v in GEMMA3_270M.items() if k not in ("rope_theta", "rope_local_base_freq", "rope_scaling")}
    with pytest.raises(ConfigError, match=r"sliding_attention\.rope_type='linear'"):
        config_bridge.megatron_spec({**config, "rope_parameters": params})
    with pytest.raises(ConfigError, match="hidden_activation='gelu'"):
        config_bridge.megatron_spec({**GEMMA3_270M, "hidden_activation": "gelu"})


BROKEN = {
    "without post-norms": lambda args: setattr(args, "hf_post_norms", False),
    "sliding layers at the full layers' RoPE base": lambda args: delattr(args, "hf_sliding_rope"),
    "norms scaled by weight, not 1 + weight": lambda args: setattr(args, "apply_layernorm_1p", False),
    "embeddings not scaled": lambda args: setattr(args, "hf_embedding_scale", False),
    "softmax scale head_dim^-0.5": lambda args: delattr(args, "hf_query_pre_attn_scalar"),
    "full layers without linear RoPE scaling": lambda args: delattr(args, "rotary_seq_len_interpolation_factor"),
}
"""Each of Gemma's pieces left out of the model megatron-core builds (the checkpoint's `args` edited; the weights
are the same)."""


@pytest.mark.slow
def test_parity_check_fails_without_any_of_gemmas_pieces(tmp_path: Path) -> None:
    """One world verifies the checkpoint as converted (it passes) and, from the same weights, a model megatron-core
    builds without each piece (each fails, far beyond the tolerance)."""
    hf_dir = build_tiny_model(tmp_path / "hf", "Gemma3ForCausalLM")
    convert_hf_to_mcore(hf_dir, tmp_path / "good", show_progress=False)
    jobs = [VerifyJob(hf_dir, tmp_path / "good")]
    for i, change in enumerate(BROKEN.values()):
        broken = Path(shutil.copytree(tmp_path / "good", tmp_path / f"broken{i}"))
        shutil.rmtree(broken / "hf_assets")  # the model is built from the args
        common = read_common(broken / "release")
        change(common["args"])
        torch.save(common, broken / "release" / "common.pt")
        jobs.append(VerifyJob(hf_dir, broken))
    good, *broken_results = verify(jobs, Layout(), seq_len=24)
    assert good.passed, good.summary()
    for what, result in zip(BROKEN, broken_results, strict=True):
        assert result.max_abs_diff > 1e-2, f"{what}: {result.summary()}"
