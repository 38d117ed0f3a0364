"""Which megatron-core layer implementation a model is built with: Transformer Engine's modules where Transformer
Engine is installed and a GPU is present, megatron-core's local modules elsewhere.

The choice travels in `TransformerConfig.transformer_impl` (`local` or `transformer_engine`), which
`config_bridge.transformer_config_kwargs` sets to `default_transformer_impl()`; a caller may override it like any
other `TransformerConfig` key (in GRPO, `policy.megatron_cfg.transformer.transformer_impl`). `megatron.model`
builds the matching layer spec: Transformer Engine's (its fused attention, norms fused into the linear layers),
or the local spec with this project's SDPA core attention and sequence-parallel norms. Both name their
parameters the same way in checkpoints, so either loads the other's.
"""

from __future__ import annotations

import importlib.util

IMPLS = ("local", "transformer_engine")


def transformer_engine_installed() -> bool:
    """Whether the `transformer_engine` package can be imported (without importing it)."""
    return importlib.util.find_spec("transformer_engine") is not None


def default_transformer_impl() -> str:
    """`transformer_engine` where it is installed and CUDA is available (its modules run on GPUs only), else
    `local`."""
    import torch  # here, so that validating a config does not import torch

    return "transformer_engine" if transformer_engine_installed() and torch.cuda.is_available() else "local"


def check_transformer_impl(impl: str) -> None:
    """Raises ValueError for an unknown implementation or for Transformer Engine where it is not installed."""
    if impl not in IMPLS:
        raise ValueError(f"transformer_impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    if impl == "transformer_engine" and not transformer_engine_installed():
        raise ValueError("transformer_impl='transformer_engine' needs Transformer Engine, which is not installed")
