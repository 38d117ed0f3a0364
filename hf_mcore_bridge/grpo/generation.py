"""The trainer's rollout engine: the embedded engine, or vLLM behind the same calls (`generation.backend`).

`build_engine` makes the configured one on global rank 0. Both take text prompts, return `RequestOutput`s with
each sample's text, take refits through `load_weights` (HF names, full tensors) and are checked after each refit.

- `embedded`: `hf_mcore_bridge.engine.Engine`, with the run's tokenizer; its weights come only from refits.
- `vllm`: `VllmEngine` (needs vLLM and a GPU) started on a directory holding the HF config and tokenizer and
  vLLM's `load_format="dummy"`, so its weights, too, come only from refits (through vLLM's own `load_weights`).
  vLLM does not tokenize here (`skip_tokenizer_init`): prompts go in as the run tokenizer's ids and completions are
  decoded by it, so both backends see the same tokens. vLLM's parameters are not readable the way the embedded
  engine's are (its own fused, sharded layout), so its refits get no per-tensor check (`readable_tensor` and
  `engine_tensor_names` return None); the log-prob gate (`logprob_gate`: each step's rollouts and the probe
  prompt, engine vs trainer) covers both backends alike.

vLLM is not installed on this project's machines: the `vllm` path is exercised by its wiring test and the gate's
test with vLLM's engine replaced by the embedded one, never against vLLM itself.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Any

import torch

__all__ = ["VLLM_MODEL_DIR", "VllmGeneration", "build_engine", "engine_tensor_names", "readable_tensor"]

VLLM_MODEL_DIR = "vllm_model"
"""The directory (in the run's log directory) vLLM is started on: config and tokenizer, no weights."""


class VllmGeneration:
    """`VllmEngine` with the run's tokenizer on both sides of `generate`."""

    def __init__(self, engine: Any, tokenizer: Any) -> None:
        self.engine, self.tokenizer = engine, tokenizer

    def generate(self, prompts: Sequence[str | Sequence[int]], params: Any) -> list[Any]:
        ids = [list(self.tokenizer.encode(p).ids) if isinstance(p, str) else list(p) for p in prompts]
        outputs = self.engine.generate(ids, params)
        return [
            dataclasses.replace(
                out,
                samples=[dataclasses.replace(s, text=self.tokenizer.decode(list(s.token_ids))) for s in out.samples],
            )
            for out in outputs
        ]

    def load_weights(self, weights: Any) -> Any:
        return self.engine.load_weights(weights)


def build_engine(backend: str, hf_config: dict[str, Any], engine_config: Any, tokenizer: Any, log_dir: Path) -> Any:
    """The rollout engine of `generation.backend` (`embedded` or `vllm`), without weights until the first refit."""
    if backend == "embedded":
        from hf_mcore_bridge.engine import Engine

        return Engine(hf_config, engine_config, tokenizer=tokenizer)
    if backend != "vllm":
        raise ValueError(f"unknown generation backend {backend!r}")
    from hf_mcore_bridge.engine import VllmEngine

    model_dir = log_dir / VLLM_MODEL_DIR
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(hf_config, indent=2))
    tokenizer.save(str(model_dir / "tokenizer.json"))
    engine = VllmEngine(model_dir, engine_config, load_format="dummy", skip_tokenizer_init=True)
    return VllmGeneration(engine, tokenizer)


def readable_tensor(engine: Any, hf_name: str) -> torch.Tensor | None:
    """The tensor an engine holds for one HF name, where it can be read (the embedded engine, a name it holds);
    else None."""
    names = engine_tensor_names(engine)
    return engine.model.hf_view(hf_name) if names is not None and hf_name in names else None


def engine_tensor_names(engine: Any) -> AbstractSet[str] | None:
    """Every HF name whose tensor the engine holds (the embedded engine; a view, not a copy), or None where it
    does not say."""
    model = getattr(engine, "model", None)
    targets = getattr(model, "targets", None)
    return targets.keys() if hasattr(model, "hf_view") and targets is not None else None
