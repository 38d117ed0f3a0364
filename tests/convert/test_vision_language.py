"""Language models inside vision-language checkpoints (`models.vision_language`), on a tiny Kimi-K2.5
(`Kimi_K25ForConditionalGeneration`: the tiny DeepSeek-V3 as its language model, `model_type` `kimi_k2`, and a
one-layer vision tower) and a tiny `Gemma3ForConditionalGeneration` (`gemma3_vl`), built and saved by transformers.
Logit parity of the Gemma 3 one's language model through megatron-core at PP2: `tests/megatron/test_parity.py`.

The references are transformers' own: the class it saves (in its `save_pretrained` layout, and renamed into the
layout Moonshot publishes), its logits on text, and the bytes of its safetensors files. Conversion to megatron-core
and back must give the same class: every tensor's bytes under the same name, the `config.json` file itself; the
engine must compute the wrapper's text log-probs from its weights as given, in-memory or saved.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from cli_errors import assert_one_line_error, run
from safetensors.torch import load_file, save_file

from hf_mcore_bridge.checkpoint.dcp_reader import DCPCheckpoint
from hf_mcore_bridge.convert.layout import Layout
from hf_mcore_bridge.convert.to_hf import convert_mcore_to_hf
from hf_mcore_bridge.convert.to_mcore import convert_hf_to_mcore
from hf_mcore_bridge.engine import Engine, EngineConfig, SamplingParams
from hf_mcore_bridge.errors import CheckpointError, UnsupportedArchitectureError
from hf_mcore_bridge.models.config_errors import ConfigError
from hf_mcore_bridge.models.spec import ModelSpec
from hf_mcore_bridge.models.tiny_models import tiny_config
from hf_mcore_bridge.models.vision_language import CARRIED_FILE

VISION = {
    "patch_size": 2,
    "num_attention_heads": 2,
    "num_hidden_layers": 1,
    "hidden_size": 16,
    "intermediate_size": 24,
    "pos_emb_height": 4,
    "pos_emb_width": 4,
    "pos_emb_time": 2,
}
"""A one-layer vision tower (transformers' `Kimi_K25VisionConfig` fields)."""


def _kimi_k25(seed: int = 3) -> torch.nn.Module:
    from transformers.models.kimi_k25 import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    text = {**tiny_config("DeepseekV3ForCausalLM"), "model_type": "kimi_k2"}  # as K2.5's text_config names it
    del text["architectures"]
    config = Kimi_K25Config(
        text_config=text, vision_config=VISION, projection_hidden_size=16, tie_word_embeddings=False
    )
    torch.manual_seed(seed)
    model = Kimi_K25ForConditionalGeneration(config).eval()
    persistent = set(model.state_dict())
    with torch.no_grad():  # norms start at 1, biases at 0: randomised so a misplaced one shows
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.1)
        for name, buffer in model.named_buffers():
            if name in persistent and buffer.is_floating_point():
                buffer.add_(torch.randn_like(buffer) * 0.1)
    return model


def _published(saved: Path, out: Path) -> Path:
    """transformers' save renamed into Moonshot's published layout (`language_model.model.layers.{layer}`)."""
    shutil.copytree(saved, out)
    tensors = load_file(out / "model.safetensors")
    renamed = {k.replace("language_model.model.blocks.", "language_model.model.layers."): v for k, v in tensors.items()}
    assert renamed.keys() != tensors.keys()
    save_file(renamed, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def kimi_k25(tmp_path_factory) -> tuple[torch.nn.Module, dict[str, Path]]:
    model = _kimi_k25()
    root = tmp_path_factory.mktemp("kimi_k25")
    model.save_pretrained(root / "saved")
    return model, {"transformers-saved": root / "saved", "published": _published(root / "saved", root / "published")}


def _raw_tensors(directory: Path) -> dict[str, tuple[torch.dtype, bytes]]:
    """Every tensor of a directory's safetensors files: its dtype and its bytes."""
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        for name, tensor in load_file(file).items():
            out[name] = (tensor.dtype, tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return out


def _text_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens).logits.float()


@pytest.mark.parametrize(
    ("layout", "parallel"),
    [("transformers-saved", Layout()), ("published", Layout(tp=2, pp=2, ep=2))],
    ids=["transformers-saved", "published-tp2pp2ep2"],
)
def test_the_language_model_converts_and_export_writes_the_whole_class_again(kimi_k25, layout, parallel, tmp_path):
    model, dirs = kimi_k25
    source = dirs[layout]
    result = convert_hf_to_mcore(source, tmp_path / "m", layout=parallel, show_progress=False)
    (note,) = result.notes
    assert "Kimi_K25ForConditionalGeneration: its language model (DeepseekV3ForCausalLM) converted" in note
    assert result.model.architecture == "DeepseekV3ForCausalLM" and result.model.num_layers == 4
    keys = DCPCheckpoint(tmp_path / "m" / "release").tensor_keys()
    assert not any("vision" in key or "projector" in key for key in keys)  # the language model only
    export = convert_mcore_to_hf(tmp_path / "m", tmp_path / "hf", show_progress=False)
    assert export.notes == ()
    original, back = _raw_tensors(source), _raw_tensors(tmp_path / "hf")
    assert sorted(back) == sorted(original)
    assert [name for name in original if back[name] != original[name]] == []  # every tensor's bytes, by name
    tower = [name for name in original if name.startswith(("vision_tower.", "mm_projector.", "model.mm_projector."))]
    assert len(tower) == 23
    assert (tmp_path / "hf" / "config.json").read_bytes() == (source / "config.json").read_bytes()
    if layout != "published":
        return
    from transformers import AutoModelForImageTextToText

    loaded = AutoModelForImageTextToText.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(loaded) is type(model)
    tokens = torch.randint(0, 211, (2, 7), generator=torch.Generator().manual_seed(4))
    assert torch.equal(_text_logits(loaded, tokens), _text_logits(model, tokens))


def test_the_carried_tensors_are_the_sources_bytes(kimi_k25, tmp_path):
    """What conversion keeps among the HF assets is transformers' vision tower and projector, byte for byte."""
    _, dirs = kimi_k25
    result = run("convert", "--to", "mcore", dirs["published"], tmp_path / "m", "--no-progress")
    assert result.exit_code == 0, result.output
    notes = [line for line in result.output.splitlines() if line.startswith("note: ")]
    assert len(notes) == 1 and "Kimi_K25ForConditionalGeneration: its language model" in notes[0]  # one line
    kept = tmp_path / "m" / "hf_assets"
    carried = {n: v for n, v in _raw_tensors(dirs["published"]).items() if not n.startswith("language_model.")}
    assert {n: (t.dtype, t.view(-1).view(torch.uint8).numpy().tobytes()) for n, t in
            load_file(kept / CARRIED_FILE).items()} == carried  # fmt: skip
    assert json.loads((kept / "config.json").read_text())["vision_config"]["hidden_size"] == 16
    from hf_mcore_bridge.bridge import AutoBridge

    bridge = AutoBridge.from_pretrained(dirs["published"])  # the bridge API takes the language model, and says so
    assert bridge.architecture == "DeepseekV3ForCausalLM" and bridge.hf_config["architectures"] == [bridge.architecture]
    assert len(bridge.notes) == 1 and "save_hf writes the language model alone" in bridge.notes[0]


def _reference_logprobs(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> list[float]:
    logprobs = torch.log_softmax(_text_logits(model, torch.tensor([prompt + tokens]))[0], dim=-1)
    return [logprobs[len(prompt) - 1 + i, token].item() for i, token in enumerate(tokens)]


def test_the_engine_runs_the_wrappers_language_model_as_transformers_does(kimi_k25):
    """From the wrapper's config object and its in-memory state dict (`model.language_model.`), and from the
    directory Moonshot's layout is saved in: the vision tower is skipped, the log-probs are transformers'."""
    model, dirs = kimi_k25
    prompt = torch.randint(0, 211, (9,), generator=torch.Generator().manual_seed(1)).tolist()
    config = EngineConfig(device="cpu", dtype=torch.float32, max_model_len=64, kv_cache_memory_bytes=1 << 22)
    engine = Engine(model.config, config)
    loaded = engine.load_weights(model.state_dict().items())
    assert loaded == set(engine.model.targets)
    (output,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=5))
    sample = output.samples[0]
    assert sample.logprobs == pytest.approx(_reference_logprobs(model, prompt, sample.token_ids), abs=1e-5)
    saved = Engine.from_pretrained(dirs["published"], config).model.state_dict()  # Moonshot's names
    assert [name for name, tensor in engine.model.state_dict().items() if not torch.equal(saved[name], tensor)] == []


def test_what_the_mechanism_does_not_know_is_refused(kimi_k25, tmp_path):
    _, dirs = kimi_k25
    config = json.loads((dirs["published"] / "config.json").read_text())
    with pytest.raises(UnsupportedArchitectureError, match="'gpt2'"):  # a text model of no registered architecture
        ModelSpec.from_hf({**config, "text_config": {**config["text_config"], "model_type": "gpt2"}})
    with pytest.raises(ConfigError, match="has no text_config"):
        ModelSpec.from_hf({k: v for k, v in config.items() if k != "text_config"})
    stray = tmp_path / "stray"
    shutil.copytree(dirs["published"], stray)
    tensors = load_file(stray / "model.safetensors")
    save_file({**tensors, "audio_tower.proj.weight": torch.zeros(2, 2)}, stray / "model.safetensors")
    result = run("convert", "--to", "mcore", stray, tmp_path / "out", "--no-progress")
    assert_one_line_error(result, "unexpected tensor", "audio_tower.proj.weight")
    assert not (tmp_path / "out").exists()
    # an export of the class whose checkpoint lost the vision tower is refused, not written as half a model
    convert_hf_to_mcore(dirs["published"], tmp_path / "m", show_progress=False)
    kept = tmp_path / "m" / "hf_assets" / CARRIED_FILE
    save_file(load_file(kept), kept)  # the same tensors, without the names the text tensors were stored under
    with pytest.raises(CheckpointError, match="text_name_layout"):
        convert_mcore_to_hf(tmp_path / "m", tmp_path / "hf", show_progress=False)
    kept.unlink()
    with pytest.raises(CheckpointError, match=f"no {CARRIED_FILE}"):
        convert_mcore_to_hf(tmp_path / "m", tmp_path / "hf", show_progress=False)
    assert not (tmp_path / "hf").exists()
    text = tmp_path / "text.json"  # what the refusal offers: the language model alone, as a DeepSeek-V3
    text.write_text(json.dumps({**config["text_config"], "architectures": ["DeepseekV3ForCausalLM"]}))
    convert_mcore_to_hf(tmp_path / "m", tmp_path / "text", hf_config=text, show_progress=False)
    names = set(_raw_tensors(tmp_path / "text"))
    assert "model.embed_tokens.weight" in names and not any("vision" in n or "language_model" in n for n in names)


@pytest.mark.slow
def test_bridge_verify_compares_the_converted_language_model_with_transformers_wrapper(kimi_k25, tmp_path):
    """`verify` at EP2 takes transformers' Kimi-K2.5 (text logits) as the reference; the check sees another
    wrapper's weights."""
    from hf_mcore_bridge.megatron.verify import VerifyJob, verify

    _, dirs = kimi_k25
    convert_hf_to_mcore(dirs["published"], tmp_path / "m", show_progress=False)
    other = tmp_path / "other"
    _kimi_k25(seed=11).save_pretrained(other)
    ok, wrong = verify([VerifyJob(dirs["published"], tmp_path / "m"), VerifyJob(other, tmp_path / "m")], Layout(ep=2))
    assert ok.max_abs_diff <= 1e-4 and ok.top1_agreement == 1.0, ok.summary()
    assert wrong.max_abs_diff > 1e-3, wrong.summary()


@pytest.mark.parametrize("tied", [None, True, False])
def test_the_wrappers_flag_ties_the_output_layer_as_in_transformers(tied):
    """transformers ties Kimi-K2.5's output layer by the wrapper's `tie_word_embeddings` (absent: tied), whatever
    `text_config` says; the description reads it so."""
    from transformers.models.kimi_k25 import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    text = {**tiny_config("DeepseekV3ForCausalLM"), "tie_word_embeddings": tied is False}  # the other way
    del text["architectures"]
    config = Kimi_K25Config(text_config=text, vision_config=VISION, projection_hidden_size=16)
    raw = config.to_dict()
    if tied is None:
        del raw["tie_word_embeddings"]
    else:
        raw["tie_word_embeddings"] = config.tie_word_embeddings = tied
    model = Kimi_K25ForConditionalGeneration(config)
    transformers_ties = model.lm_head.weight is model.model.language_model.embed_tokens.weight
    assert ModelSpec.from_hf(raw).tie_word_embeddings is transformers_ties


def test_gemma3s_language_model_converts_and_export_writes_the_whole_class_again(gemma3_vl_dir, tmp_path):
    """At TP2 x PP2 and back: every tensor's bytes under its name (the SigLIP tower and the projector carried), the
    `config.json` file itself, and transformers' logits of the exported class those of the source."""
    from gemma3_vl import gemma3_vl

    result = convert_hf_to_mcore(gemma3_vl_dir, tmp_path / "m", layout=Layout(tp=2, pp=2), show_progress=False)
    (note,) = result.notes
    assert "Gemma3ForConditionalGeneration: its language model (Gemma3ForCausalLM) converted" in note
    assert result.model.architecture == "Gemma3ForCausalLM" and result.model.post_norms
    keys = DCPCheckpoint(tmp_path / "m" / "release").tensor_keys()
    assert not any("vision" in key or "projector" in key for key in keys)
    assert convert_mcore_to_hf(tmp_path / "m", tmp_path / "hf", show_progress=False).notes == ()
    original, back = _raw_tensors(gemma3_vl_dir), _raw_tensors(tmp_path / "hf")
    assert sorted(back) == sorted(original)
    assert [name for name in original if back[name] != original[name]] == []
    assert len([name for name in original if not name.startswith("language_model.")]) == 34
    assert (tmp_path / "hf" / "config.json").read_bytes() == (gemma3_vl_dir / "config.json").read_bytes()
    from transformers import AutoModelForImageTextToText

    loaded = AutoModelForImageTextToText.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    tokens = torch.randint(0, 207, (2, 9), generator=torch.Generator().manual_seed(4))
    assert torch.equal(_text_logits(loaded, tokens), _text_logits(gemma3_vl(), tokens))
