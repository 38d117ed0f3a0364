"""Defaults that would otherwise change the objective silently: stop tokens come from the model's EOS ids (the
reference is transformers' own reading of the same files) and a run with none is refused in one line; truncated
sampling (top_p < 1, top_k > 0) is refused for training; `grpo.leave_one_out_std` parses and defaults to NeMo-RL's
choice (a NeMo-RL config's `use_leave_one_out_baseline` is pointed to `grpo.leave_one_out`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_mcore_bridge.grpo.algorithm.advantages import LeaveOneOutStd
from hf_mcore_bridge.grpo.data.stop_tokens import stop_token_ids, with_stop_token_ids
from hf_mcore_bridge.grpo.errors import GRPOConfigError
from hf_mcore_bridge.grpo.run.config import config_from_dict

from ..tiny_policy import WORDS, build_tokenizer

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": len(WORDS)}


def _base(model_path: Path, *overrides: str) -> list:
    data = {"policy": {"model_path": str(model_path)}, "data": {"task": "repeat_digit"}}
    return [data, list(overrides)]


def _model_dir(path: Path, config: dict, generation: dict | None = None, eos_token: str | None = None) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**LLAMA, **config}))
    if generation is not None:
        (path / "generation_config.json").write_text(json.dumps(generation))
    build_tokenizer(path)
    if eos_token is not None:
        (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos_token}))
    return path


@pytest.mark.parametrize("eos", [3, [3, 7]])
def test_stop_tokens_default_to_the_generation_config_eos(tmp_path: Path, eos: int | list[int]) -> None:
    from transformers import GenerationConfig

    model = _model_dir(tmp_path / "m", {"eos_token_id": 9}, {"eos_token_id": eos}, eos_token="Answer")
    expected = GenerationConfig.from_pretrained(model).eos_token_id
    config = with_stop_token_ids(config_from_dict(*_base(model)))
    assert config.generation.stop_token_ids == tuple(expected if isinstance(expected, list) else [expected])


def test_stop_tokens_fall_back_to_config_then_tokenizer(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    with_config = _model_dir(tmp_path / "a", {"eos_token_id": 9}, eos_token="Answer")
    assert stop_token_ids(config_from_dict(*_base(with_config))) == (9,)
    tokenizer_only = _model_dir(tmp_path / "b", {}, {"bos_token_id": 1}, eos_token="Answer")
    expected = AutoTokenizer.from_pretrained(tokenizer_only).eos_token_id
    assert expected == WORDS.index("Answer")
    assert stop_token_ids(config_from_dict(*_base(tokenizer_only))) == (expected,)


def test_stop_tokens_are_read_from_a_megatron_checkpoints_assets(tmp_path: Path) -> None:
    checkpoint = tmp_path / "ckpt" / "iter_0000002"
    checkpoint.mkdir(parents=True)
    (checkpoint / "metadata.json").write_text("{}")
    _model_dir(tmp_path / "ckpt" / "hf_assets", {}, {"eos_token_id": [4, 5]})
    assert stop_token_ids(config_from_dict(*_base(checkpoint))) == (4, 5)


def test_explicit_stop_tokens_win(tmp_path: Path) -> None:
    model = _model_dir(tmp_path / "m", {"eos_token_id": 9})
    assert stop_token_ids(config_from_dict(*_base(model, "generation.stop_token_ids=[2]"))) == (2,)
    assert stop_token_ids(config_from_dict(*_base(model, "generation.stop_token_ids=[]"))) == ()


def test_a_model_without_eos_is_refused_at_validation(tmp_path: Path) -> None:
    model = _model_dir(tmp_path / "m", {}, {"bos_token_id": 1})
    with pytest.raises(GRPOConfigError, match=r"declares no EOS token.*set generation\.stop_token_ids") as err:
        config_from_dict(*_base(model))
    assert "\n" not in str(err.value)
    config_from_dict(*_base(model, "generation.stop_token_ids=[0]"))  # the named key resolves it
    with pytest.raises(GRPOConfigError, match="does not exist"):
        with_stop_token_ids(config_from_dict(*_base(tmp_path / "missing")))


@pytest.mark.parametrize("backend", ["embedded", "vllm"])
@pytest.mark.parametrize("truncation", ["generation.top_p=0.9", "generation.top_k=5"])
def test_truncated_sampling_is_refused_for_training(tmp_path: Path, backend: str, truncation: str) -> None:
    overrides = [f"generation.backend={backend}", truncation, "generation.stop_token_ids=[0]"]
    with pytest.raises(GRPOConfigError, match=r"truncated sampling is refused for training.*top_p=1 and top_k=0"):
        config_from_dict(*_base(tmp_path, *overrides))


def test_leave_one_out_std_defaults_to_nemo_rl_and_parses(tmp_path: Path) -> None:
    base = _base(tmp_path, "grpo.leave_one_out=true", "generation.stop_token_ids=[0]")
    assert config_from_dict(*base).grpo.leave_one_out_std is LeaveOneOutStd.OTHERS
    assert config_from_dict(base[0], [*base[1], "grpo.leave_one_out_std=group"]).grpo.leave_one_out_std == "group"
    with pytest.raises(GRPOConfigError, match="leave_one_out_std"):
        config_from_dict(base[0], [*base[1], "grpo.leave_one_out_std=mean"])


def test_nemo_rl_leave_one_out_key_points_to_ours(tmp_path: Path) -> None:
    base = _base(tmp_path, "grpo.use_leave_one_out_baseline=true")
    with pytest.raises(GRPOConfigError, match=r"NeMo-RL's name for 'grpo\.leave_one_out'$"):
        config_from_dict(*base)
