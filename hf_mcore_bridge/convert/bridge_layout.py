"""Megatron-Bridge's checkpoint layout: the model described by `run_config.yaml` instead of Megatron-LM `args`.

Facts from Megatron-Bridge's source (tag v0.6.0, `src/megatron/bridge/training/checkpointing.py`,
`training/utils/checkpoint_utils.py`, `training/state.py`, `training/model_load_save.py`):

- `<root>/iter_0000100/` holds the `torch_dist` files (`dist_checkpointing.save` of a state dict with `model`,
  `checkpoint_version` 3.0 and `iteration`: no `args`), `run_config.yaml` (the run's ConfigContainer; its `model`
  section is the model provider, a dataclass named by `_target_` whose fields are megatron-core's
  `TransformerConfig` fields plus the GPT provider's: `vocab_size`, `seq_length`, `rotary_base`,
  `share_embeddings_and_output_weights`, ...) and `train_state.pt` (`TrainState.state_dict()`: `step`,
  sample counters, FLOPs, `do_train/valid/test`, each a tensor).
- `<root>/latest_train_state.pt` is a copy of the newest `train_state.pt` (Megatron-Bridge reads it first to find
  the iteration) and `<root>/latest_checkpointed_iteration.txt` holds the step, for Megatron-LM.
- Callables and dtypes in the YAML are `{_target_: torch.nn.functional.silu, _call_: false}` references.
- `load_model_config(iter_dir)` instantiates the `model` section when `run_config.yaml` exists, else it reads
  Megatron-LM `args` from the common state.

Reading turns the `model` section into Megatron-LM argument names, so that the one `args` reader
(`config_bridge.from_megatron_args`) serves both layouts. YAML is read with `yaml.safe_load`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml

from hf_mcore_bridge.checkpoint import dtypes
from hf_mcore_bridge.checkpoint.megatron_dirs import LATEST_TRAIN_STATE
from hf_mcore_bridge.convert.layout import Layout
from hf_mcore_bridge.errors import CheckpointError
from hf_mcore_bridge.models.spec import ModelSpec

RUN_CONFIG = "run_config.yaml"
TRAIN_STATE = "train_state.pt"
GPT_PROVIDER = "megatron.bridge.models.gpt_provider.GPTModelProvider"

_RENAMED = {
    # Megatron-Bridge / TransformerConfig name -> Megatron-LM argument name
    "num_moe_experts": "num_experts",
    "layernorm_epsilon": "norm_epsilon",
    "seq_length": "max_position_embeddings",
    "rope_scaling": "use_rope_scaling",
    "gated_linear_unit": "swiglu",
}


def is_bridge_checkpoint(checkpoint_dir: Path) -> bool:
    """Whether an iteration directory is in Megatron-Bridge's layout."""
    return (checkpoint_dir / RUN_CONFIG).is_file()


def read_run_config(checkpoint_dir: Path) -> dict[str, Any]:
    """The parsed `run_config.yaml` of an iteration directory."""
    path = checkpoint_dir / RUN_CONFIG
    try:
        config = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise CheckpointError(f"{path} is unreadable: {str(err).splitlines()[0]}") from None
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        raise CheckpointError(f"{path} has no `model` section")
    return config


def _reference(value: Any) -> str | None:
    """`torch.bfloat16` for `{_target_: torch.bfloat16, _call_: false}`, else None."""
    return value.get("_target_") if isinstance(value, dict) else None


def args_from_run_config(config: dict[str, Any]) -> argparse.Namespace:
    """Megatron-LM-named `args` for the `model` section of a `run_config.yaml`."""
    model = config["model"]
    args: dict[str, Any] = {}
    for key, value in model.items():
        if key.startswith("_"):
            continue
        args[_RENAMED.get(key, key)] = value
    activation = _reference(model.get("activation_func"))
    if activation is not None and not activation.endswith(".silu"):
        raise CheckpointError(f"{RUN_CONFIG} names activation {activation}; only SiLU-gated MLPs are supported")
    args["untie_embeddings_and_output_weights"] = not model.get("share_embeddings_and_output_weights", True)
    args["group_query_attention"] = model.get("num_query_groups") is not None
    dtype = _reference(model.get("params_dtype"))
    if dtype is not None:
        args["params_dtype"] = dtypes.BY_NAME.get(dtype.removeprefix("torch."))
    return argparse.Namespace(**args)


def _dtype_reference(dtype: Any) -> dict[str, Any]:
    return {"_target_": f"torch.{dtypes.of(dtype).name}", "_call_": False}


def run_config(
    model: ModelSpec, layout: Layout, dtype: Any, *, make_vocab_size_divisible_by: int = 128
) -> dict[str, Any]:
    """A `run_config.yaml` whose `model` section is a `GPTModelProvider` for this model and layout."""
    section: dict[str, Any] = {
        "_target_": GPT_PROVIDER,
        "num_layers": model.num_layers,
        "hidden_size": model.hidden_size,
        "ffn_hidden_size": model.ffn_hidden_size,
        "num_attention_heads": model.num_attention_heads,
        "num_query_groups": model.num_query_groups,
        "kv_channels": model.head_dim,
        "normalization": "RMSNorm",
        "layernorm_epsilon": model.norm_epsilon,
        "gated_linear_unit": True,
        "activation_func": {"_target_": "torch.nn.functional.silu", "_call_": False},
        "add_bias_linear": False,
        "add_qkv_bias": model.qkv_bias,
        "qk_layernorm": model.qk_norm,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "position_embedding_type": "rope",
        "rotary_base": model.rope.theta,
        "rotary_percent": model.rope.partial_rotary_factor,
        "rope_scaling": model.rope.rope_type == "llama3",
        "rope_scaling_factor": model.rope.factor,
        "seq_length": model.max_position_embeddings,
        "vocab_size": model.vocab_size,
        "should_pad_vocab": True,  # the provider pads as Megatron-LM does: to make_vocab_size_divisible_by * TP
        "make_vocab_size_divisible_by": make_vocab_size_divisible_by,
        "share_embeddings_and_output_weights": model.tie_word_embeddings,
        "tensor_model_parallel_size": layout.tp,
        "pipeline_model_parallel_size": layout.pp,
        "virtual_pipeline_model_parallel_size": layout.vpp,
        "context_parallel_size": layout.cp,
        "expert_model_parallel_size": layout.ep,
        "expert_tensor_parallel_size": layout.etp,
        "params_dtype": _dtype_reference(dtype),
        "pipeline_dtype": _dtype_reference(dtype),
        "bf16": dtypes.of(dtype) == dtypes.BFLOAT16,
        "fp16": dtypes.of(dtype) == dtypes.FLOAT16,
    }
    if model.moe is not None:
        moe = model.moe
        section |= {
            "num_moe_experts": moe.num_experts,
            "moe_ffn_hidden_size": moe.ffn_hidden_size,
            "moe_router_topk": moe.topk,
            "moe_layer_freq": 1 if all(moe.moe_layers) else [int(m) for m in moe.moe_layers],
            "moe_router_pre_softmax": moe.pre_softmax,
            "moe_aux_loss_coeff": moe.aux_loss_coeff,
            "moe_shared_expert_intermediate_size": moe.shared_expert_size,
            "moe_shared_expert_gate": moe.shared_expert_gate,
            "moe_router_score_function": moe.score_function,
            "moe_router_enable_expert_bias": moe.expert_bias,
            "moe_router_topk_scaling_factor": moe.topk_scaling_factor,
            "moe_router_num_groups": moe.num_groups,
            "moe_router_group_topk": moe.group_topk,
            "moe_router_dtype": "fp32" if moe.router_fp32 else None,
        }
    return {"model": section, "checkpoint": {"ckpt_format": "torch_dist", "fully_parallel_save": True}}


def train_state(step: int) -> dict[str, Any]:
    """`TrainState.state_dict()` of a run at `step` with nothing consumed yet (tensors)."""
    import torch

    state = {name: torch.tensor(0, dtype=torch.int64) for name in ("consumed_train_samples", "skipped_train_samples")}
    return {
        "step": torch.tensor(step, dtype=torch.int64),
        **state,
        "consumed_valid_samples": torch.tensor(0, dtype=torch.int64),
        "floating_point_operations_so_far": torch.tensor(0, dtype=torch.float32),
        "do_train": torch.tensor(False),
        "do_valid": torch.tensor(False),
        "do_test": torch.tensor(False),
    }


def write_bridge_files(root: Path, checkpoint_dir: Path, config: dict[str, Any], step: int) -> None:
    """`run_config.yaml` and `train_state.pt` in the iteration directory; `latest_train_state.pt` and the
    Megatron-LM tracker in the root."""
    (checkpoint_dir / RUN_CONFIG).write_text(yaml.safe_dump(config, sort_keys=False))
    import torch

    state = train_state(step)
    for path in (checkpoint_dir / TRAIN_STATE, root / LATEST_TRAIN_STATE):
        with path.open("wb") as handle:
            torch.save(state, handle)
