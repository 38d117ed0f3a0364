"""`VllmEngine`: the `Engine` interface (generate, load_weights, sleep, wake_up) over `vllm.LLM`.

vLLM is imported only when a `VllmEngine` is created, so the rest of the package never needs it. vLLM is NOT
installable in this project's development and CI environment (CPU-only torch, no vLLM wheel for it), so this
class is exercised only where vLLM is installed; its contract test skips everywhere else. There is deliberately
no stand-in: a fake would only test itself.

Differences from the embedded engine that callers must know:
- Log-probabilities come from vLLM's `processed_logprobs` mode, which is log_softmax(logits / temperature) only
  when no top-k / top-p truncation is active (vLLM takes them after truncation). Requests that combine
  truncation with logprobs are refused rather than silently returning a different quantity.
- Weights are pushed into the worker's model with its own `load_weights` (HF names, full tensors), found at the
  in-process paths vLLM has used (`...driver_worker.model_runner.model`, `...driver_worker.worker.model_runner
  .model`), else through `LLM.apply_model`. Run vLLM in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) for a
  zero-copy refit.
- Only `stop_token_ids` end a sample (`ignore_eos=True`), as in the embedded engine.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

import torch

from hf_mcore_bridge.engine.engine import EngineAsleepError, EngineConfig, RequestOutput, SampleOutput
from hf_mcore_bridge.engine.sampling import SamplingParams

_MODEL_PATHS = (
    ("llm_engine", "model_executor", "driver_worker", "model_runner", "model"),
    ("llm_engine", "model_executor", "driver_worker", "worker", "model_runner", "model"),
)


def _in_process_model(llm: Any) -> Any | None:
    for path in _MODEL_PATHS:
        obj = llm
        for attr in path:
            obj = getattr(obj, attr, None)
            if obj is None:
                break
        if obj is not None and hasattr(obj, "load_weights"):
            return obj
    return None


def to_vllm_params(params: SamplingParams) -> Any:
    """The equivalent `vllm.SamplingParams`; refuses logprobs combined with truncation (see module docstring)."""
    import vllm

    truncates = params.temperature > 0 and (params.top_k > 0 or params.top_p < 1)
    if params.logprobs and truncates:
        raise NotImplementedError(
            "vLLM reports log-probs after top-k/top-p truncation; use top_k=0, top_p=1 or the embedded Engine"
        )
    return vllm.SamplingParams(
        n=params.n,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k if params.top_k > 0 else -1,
        max_tokens=params.max_tokens,
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=True,
        seed=params.seed,
        logprobs=0 if params.logprobs else None,
    )


class VllmEngine:
    """The `Engine` interface over vLLM (requires vLLM and a GPU).

    Args:
        model_dir: an HF model directory (config.json, tokenizer files; weights unless `load_format="dummy"`,
            in which case they come only from `load_weights`).
        config: the same resources and limits as `Engine` (dtype, max_num_seqs, max_model_len,
            kv_cache_memory_bytes, block_size; `use_cuda_graphs=False` maps to vLLM's `enforce_eager`).
        load_format: vLLM's load format.
        llm_kwargs: passed to `vllm.LLM` as they are.
    """

    def __init__(
        self,
        model_dir: str | Path,
        config: EngineConfig | None = None,
        load_format: str = "auto",
        **llm_kwargs: Any,
    ) -> None:
        import vllm

        cfg = config or EngineConfig()
        self.config = cfg
        self.llm = vllm.LLM(
            model=str(model_dir),
            dtype=str(cfg.dtype).removeprefix("torch."),
            max_num_seqs=cfg.max_num_seqs,
            max_model_len=cfg.max_model_len,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            kv_cache_memory_bytes=cfg.kv_cache_memory_bytes,
            block_size=cfg.block_size,
            enforce_eager=not cfg.use_cuda_graphs,
            enable_sleep_mode=True,
            enable_prefix_caching=False,
            logprobs_mode="processed_logprobs",
            load_format=load_format,
            **llm_kwargs,
        )
        self._sleep_level = 0

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Pushes HF-named full tensors into vLLM's model (its own stacked-parameter mapping applies)."""
        if self._sleep_level:
            raise EngineAsleepError("call wake_up() before load_weights")
        model = _in_process_model(self.llm)
        if model is not None:
            model.load_weights(weights)
            return
        if hasattr(self.llm, "apply_model"):
            materialised = list(weights)
            self.llm.apply_model(lambda m: m.load_weights(materialised))
            return
        raise RuntimeError(
            "cannot reach vLLM's model: none of "
            + ", ".join(".".join(p) for p in _MODEL_PATHS)
            + " exists and LLM.apply_model is missing"
        )

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode: level 1 frees the KV cache (weights offloaded to host), level 2 discards weights."""
        self.llm.sleep(level=level)
        self._sleep_level = level

    def wake_up(self) -> None:
        """After level 2 the weights must be reloaded with `load_weights` before `generate`."""
        self.llm.wake_up()
        self._sleep_level = 0

    def generate(
        self,
        prompts: Seq[str] | Seq[Seq[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Same contract as `Engine.generate`."""
        if self._sleep_level:
            raise EngineAsleepError("the engine is asleep; call wake_up() first")
        params = params or SamplingParams()
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        inputs = [p if isinstance(p, str) else {"prompt_token_ids": [int(t) for t in p]} for p in prompts]
        outputs = self.llm.generate(inputs, [to_vllm_params(p) for p in per_prompt], use_tqdm=False)
        return [self._convert(out, p) for out, p in zip(outputs, per_prompt, strict=True)]

    @staticmethod
    def _convert(output: Any, params: SamplingParams) -> RequestOutput:
        samples = []
        for completion in sorted(output.outputs, key=lambda c: c.index):
            token_ids = list(completion.token_ids)
            logprobs = None
            if params.logprobs and completion.logprobs is not None:
                logprobs = [step[tok].logprob for step, tok in zip(completion.logprobs, token_ids, strict=True)]
            reason = "stop" if completion.finish_reason == "stop" else "length"
            samples.append(SampleOutput(completion.index, token_ids, completion.text, reason, logprobs))
        return RequestOutput(prompt_token_ids=list(output.prompt_token_ids), samples=samples)
