"""Building a megatron-core `GPTModel` for one pipeline stage and loading a distributed checkpoint into it.

Uses megatron-core's own pieces only: `TransformerConfig`, the local layer spec (Transformer Engine is not
assumed), `GPTModel`, and `dist_checkpointing.load`. The caller has initialised the process group and
`parallel_state`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hf_mcore_bridge.config_bridge import ModelConfig, gpt_model_kwargs, transformer_config_kwargs
from hf_mcore_bridge.layout import Layout


def build_gpt_model(
    model: ModelConfig,
    layout: Layout,
    dtype: torch.dtype,
    padded_vocab: int,
    *,
    device: torch.device,
    vp_stage: int | None = None,
) -> torch.nn.Module:
    """A `GPTModel` for this rank's pipeline stage (and virtual stage), parameters on `device`."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    kwargs = transformer_config_kwargs(model, layout, dtype)
    kwargs["use_cpu_initialization"] = True
    config = TransformerConfig(**kwargs)
    spec = get_gpt_layer_local_spec(qk_layernorm=model.qk_norm, normalization="RMSNorm")
    pre = parallel_state.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    post = parallel_state.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    gpt = GPTModel(
        config, spec, pre_process=pre, post_process=post, vp_stage=vp_stage, **gpt_model_kwargs(model, padded_vocab)
    )
    return gpt.to(device)


def load_distributed_checkpoint(module: torch.nn.Module, checkpoint_dir: Path) -> None:
    """Load a `torch_dist` checkpoint into `module` through megatron-core's `dist_checkpointing.load`."""
    from megatron.core import dist_checkpointing
    from megatron.core.safe_globals import register_safe_globals

    register_safe_globals()  # common.pt holds an argparse Namespace; Megatron-LM registers these at start-up
    # Megatron-LM nests the model under "model" ("model0", "model1", ... with virtual pipeline stages); the
    # returned dict also holds common.pt's entries (args, iteration, ...).
    state = dist_checkpointing.load({"model": module.sharded_state_dict()}, str(checkpoint_dir))
    module.load_state_dict(state["model"])


def causal_mask(seq_len: int, device: torch.device) -> torch.Tensor:
    """megatron-core's boolean attention mask `[1, 1, s, s]`: True where attention is masked out."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)[None, None]
