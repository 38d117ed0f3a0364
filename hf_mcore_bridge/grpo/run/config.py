"""The GRPO run's configuration: frozen dataclasses, one per YAML section, and the loader that fills them.

A YAML file (or a dict) maps section by section onto `GRPOConfig`; `key.sub=value` overrides are applied on top
(values parsed as YAML scalars, so `grpo.seed=3` is an int). An unknown key anywhere is a `GRPOConfigError`
naming the closest valid key. `validate()` checks the whole config, cheap checks only, before any process starts.

The config is plain data composed of sections that live with the code that reads them, each validated there: the
loss (`algorithm.options.LossConfig`), the prompts and rewards (`data.config`), and the two training backends
(`backends.megatron.config`: `policy.megatron_cfg`, enabled by default; `backends.dtensor.config`:
`policy.dtensor_cfg`, the HF model under FSDP2 and DTensor TP, enabling it needs `megatron_cfg.enabled: false`).
This module holds the run's own sections (the outer loop, generation, checkpoints, logging, the cluster) and the
checks across sections. The ranks, the layout and the engine's TP are derived once, by `run.plan.parallel_dims`.
The megatron-core keys forwarded to its config classes are checked against those classes last (importing
megatron-core takes seconds; everything else is checked without torch).

Simplifications: the vLLM generation backend needs the `vllm` package (checked at validation); context
parallelism needs Transformer Engine and is refused by megatron-core's local spec.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import json
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hf_mcore_bridge.engine.options import DECODE_KERNELS
from hf_mcore_bridge.grpo.algorithm.options import DynamicSamplingConfig, LeaveOneOutStd, LossConfig
from hf_mcore_bridge.grpo.backends.dtensor.config import DTensorConfig, validate_dtensor
from hf_mcore_bridge.grpo.backends.megatron.config import MegatronConfig, validate_forwarded, validate_megatron
from hf_mcore_bridge.grpo.data.config import DataConfig, RewardConfig, validate_data, validate_reward
from hf_mcore_bridge.grpo.errors import GRPOConfigError, real_number, require, unknown_key
from hf_mcore_bridge.grpo.run.plan import cluster_ranks, parallel_dims
from hf_mcore_bridge.megatron.lora_config import (
    FUSED,
    INITS,
    REFITS,
    TARGETS,
    LoraConfig,
    expert_targets,
    peft_targets,
)

__all__ = [
    "CheckpointingConfig",
    "ClusterConfig",
    "GRPOConfig",
    "GRPOSection",
    "GenerationConfig",
    "LoggerConfig",
    "MLflowConfig",
    "PolicyConfig",
    "RouterReplayConfig",
    "WandbConfig",
    "apply_overrides",
    "config_from_dict",
    "load_config",
]


@dataclass(frozen=True)
class RouterReplayConfig:
    """Rollout routing replay (R3) for mixture-of-experts policies (NeMo-RL's `policy.router_replay`)."""

    enabled: bool = False
    """The engine records, for every prompt and generated token, the experts each MoE layer chose
    (`EngineConfig.record_routing`), returns them with the rollouts, and megatron-core's routers take those
    choices in every log-prob and training forward, the routing weights still computed from the current router
    (`grpo.backends.megatron.router_replay`): a token's probability is computed through the experts that sampled it.
    Needs a MoE model, the megatron-core backend and the embedded engine."""


@dataclass(frozen=True)
class PolicyConfig:
    """The model being trained."""

    model_path: str = ""
    """A Megatron checkpoint directory (`torch_dist`) or an HF model directory (converted on the way in)."""
    tokenizer: str | None = None
    """A `tokenizer.json` file or a directory holding one; None: the HF model directory (or its stored assets)."""
    dtype: str = "fp32"
    """Parameter and compute dtype of trainer and engine: `fp32`, `bf16` or `fp16`."""
    megatron_cfg: MegatronConfig = field(default_factory=MegatronConfig)
    """megatron-core settings."""
    dtensor_cfg: DTensorConfig = field(default_factory=DTensorConfig)
    """DTensor (FSDP2) settings; exactly one of `megatron_cfg` and `dtensor_cfg` is enabled."""
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)
    """Rollout routing replay for mixture-of-experts models (see `RouterReplayConfig`)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Low-rank adapters instead of full fine-tuning (see `megatron.lora_config.LoraConfig`, docs/lora.md)."""
    refit_bucket_mb: int = 1024
    """Refit hands the engine its new weights in buckets of at most this many MiB (one `load_weights` call per
    bucket; a larger tensor goes alone): the memory the refit holds beyond both models."""

    @property
    def backend_cfg(self) -> MegatronConfig | DTensorConfig:
        """The enabled backend's section; both carry the micro-batching keys (`micro_batch_size`,
        `sequence_packing`, `max_tokens_per_microbatch`)."""
        return self.dtensor_cfg if self.dtensor_cfg.enabled else self.megatron_cfg


@dataclass(frozen=True)
class GRPOSection:
    """The outer loop."""

    num_prompts_per_step: int = 8
    """Prompts drawn per step."""
    num_generations_per_prompt: int = 8
    """Completions sampled per prompt (the group of the advantage baseline)."""
    max_num_steps: int = 100
    """Steps to run (counting steps of a resumed run)."""
    num_minibatches: int = 1
    """Optimizer steps per GRPO step: the step's samples split into this many mini-batches (1: on-policy)."""
    separate_old_logprobs: bool = False
    """With one mini-batch, still compute the old log-probs in a forward pass of their own (by default they are
    the training forward's, detached: the same values without the extra pass). Always so with LoRA dropout
    (`policy.lora.dropout` > 0), whose training forwards are not the sampling policy's."""
    seed: int = 0
    """Seeds the prompt order and the sampling."""
    val_period: int = 0
    """Run validation every this many steps (0: never)."""
    val_num_prompts: int = 8
    """Prompts of the validation set scored at each validation."""
    val_num_generations: int = 1
    """Completions per validation prompt: 1 is greedy; more are sampled at `generation.temperature` and give
    `val_pass_at_1` (their mean reward) and `val_pass_at_k` (see `grpo.algorithm.pass_at_k`)."""
    normalize_rewards: bool = True
    """Divide advantages by a reward standard deviation (GRPO; the group's, or with `leave_one_out` the one
    `leave_one_out_std` names); False: Dr. GRPO."""
    leave_one_out: bool = False
    """Baseline each completion with the mean of the others of its group (NeMo-RL's `use_leave_one_out_baseline`)."""
    leave_one_out_std: LeaveOneOutStd = LeaveOneOutStd.OTHERS
    """With `leave_one_out` and `normalize_rewards`, what each advantage is divided by: `others`, the sample std of
    the other rewards of its group (NeMo-RL's; an advantage whose others are all equal is left undivided), or
    `group`, the sample std of the whole group (see `grpo.algorithm.advantages`)."""
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    """DAPO's dynamic sampling: `enabled` drops the groups whose rewards are all equal and generates up to
    `max_rounds` rounds of new prompts until `num_prompts_per_step` groups with reward variance remain (see
    `grpo.algorithm.dynamic_sampling`); logs `dropped_groups`, `generation_rounds` and `filled_groups`."""
    probe_prompt: str | None = None
    """Text of the fixed probe prompt compared engine vs trainer after each refit; None: the first training prompt."""
    max_token_mult_prob_error: float | None = None
    """Largest engine-vs-trainer `token_mult_prob_error` allowed, on each step's rollouts and on the probe prompt
    after each refit (1: the two sides' token probabilities agree exactly). None: 1.0001 for `policy.dtype` fp32,
    1.25 for bf16 and fp16, 1.6 with `generation.precision: fp8`, set from the margins measured on a trained model
    between a correct refit and wrong ones (`logprob_gate`, `docs/refit-checks.md`). The value is logged every
    step: NeMo-RL reads a steady climb past 1.01-1.02 as the policy drifting from what the engine computes."""
    on_logprob_mismatch: str = "stop"
    """What a value past `max_token_mult_prob_error` does: `stop` the run (one line naming the step, the value
    and likely causes) or `warn` and go on."""
    check_initial_weights: bool = True
    """Before step 1 of a run that starts from an HF directory, check that the policy's refit stream gives back
    every tensor of that directory exactly (`grpo.refit.source_check`: one extra stream and one read of the files)."""


@dataclass(frozen=True)
class GenerationConfig:
    """Rollouts."""

    backend: str = "embedded"
    """`embedded` (the in-process engine) or `vllm` (one vLLM engine per replica in the trainer's processes; needs
    vLLM)."""
    precision: str = "dtype"
    """`dtype` (the engine runs in `policy.dtype`) or `fp8` (embedded engine: its attention and dense MLP
    projections multiply by per-block e4m3 copies of the weights, requantized after every refit; see
    `engine.fp8`). The log-prob mismatch this causes is logged as `token_mult_prob_error` and can be corrected by
    `loss_fn.is_correction`; the gate's default limit is then `logprob_gate.FP8_MAX_TOKEN_MULT_PROB_ERROR`."""
    kv_cache_dtype: str = "auto"
    """`auto` (the KV cache in the engine's dtype) or `fp8` (embedded engine: keys and values stored as e4m3 over
    `kv_cache_scale`, half the bytes of bf16 for decode to read and twice the blocks in the same memory; see
    `EngineConfig.kv_cache_dtype`). Its log-prob mismatch shows in `token_mult_prob_error` like `precision`'s."""
    kv_cache_scale: float = 1.0
    """Per-tensor scale of the FP8 KV cache (`kv_cache_dtype: fp8`): an entry holds value / scale."""
    temperature: float = 1.0
    """Sampling temperature; the trainer's log-probs use the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass; must be 1 for training (the trainer scores the untruncated distribution)."""
    top_k: int = 0
    """Top-k truncation (0: off); must be 0 for training, as `top_p`."""
    max_new_tokens: int = 16
    """Tokens generated at most per completion."""
    stop_token_ids: tuple[int, ...] | None = None
    """Generation of a sample ends after one of these. None: the model's EOS ids (`eos_token_id` of its
    `generation_config.json`, else of `config.json`, else the tokenizer's `eos_token`); a run where none is found
    is refused. `[]`: no stop tokens, every completion runs to `max_new_tokens`."""
    max_model_len: int = 512
    """Prompt plus completion, at most."""
    kv_cache_memory_bytes: int = 64 << 20
    """The engine's KV-cache budget."""
    decode_attention: str = "auto"
    """The embedded engine's decode attention: `triton` (one Triton kernel over the paged blocks), `flex`
    (FlexAttention over the paged blocks, compiled per batch bucket), `gather` (blocks gathered, then SDPA; nothing
    compiled) or `auto` (`triton` on CUDA where Triton is installed, else `flex` on CUDA; `gather` elsewhere)."""
    flex_min_batch: int = 64
    """With `flex`, decode steps of fewer sequences use `gather` (bounds the compilations to large buckets)."""
    torch_compile: bool | None = None
    """`torch.compile` the engine's pointwise steps and sampler (fused kernels, compiled in each process's first
    steps); null: on CUDA. `false` together with `decode_attention: gather` compiles nothing (with `triton`, only
    the Triton kernel)."""
    tensor_parallel_size: int | None = None
    """Ranks one embedded engine is sharded over (`Engine(..., tp_group=...)`: heads, MLP and expert widths,
    vocabulary and KV heads split like megatron-core's tensor-parallel layers); null: the policy's TP
    (`policy.megatron_cfg.tensor_model_parallel_size`, or `policy.dtensor_cfg.tensor_parallel_size`). Must divide
    the run's world size: every `tensor_parallel_size` consecutive ranks form one engine replica, and the replicas
    share each step's prompts. Equal to the megatron-core policy's TP (dense models), each rank refits its engine
    part from its own shards, with no all-gather but the vocabulary's (`grpo.refit.stream.shard_local_hf_weights`)."""


@dataclass(frozen=True)
class CheckpointingConfig:
    """Megatron distributed checkpoints of policy and optimizer (see `grpo.backends.megatron.checkpoint`)."""

    enabled: bool = False
    """Write checkpoints (and resume from them)."""
    checkpoint_dir: str = "checkpoints"
    """Root directory: `iter_XXXXXXX/` per checkpoint and `latest_checkpointed_iteration.txt`."""
    save_period: int = 50
    """Steps between checkpoints; the last step is always saved."""
    resume: bool = True
    """Continue from the newest checkpoint under `checkpoint_dir` when there is one."""


@dataclass(frozen=True)
class WandbConfig:
    """A Weights & Biases run (NeMo-RL's `logger.wandb`)."""

    project: str = "hf-mcore-bridge"
    """The W&B project."""
    name: str | None = None
    """The run's name; None: W&B picks one."""
    entity: str | None = None
    """The W&B team or user; None: the logged-in default."""


@dataclass(frozen=True)
class MLflowConfig:
    """An MLflow run (NeMo-RL's `logger.mlflow`)."""

    experiment_name: str = "hf-mcore-bridge"
    """The MLflow experiment (created when missing)."""
    run_name: str | None = None
    """The run's name; None: MLflow picks one."""
    tracking_uri: str | None = None
    """Where runs are stored (`http://...`, `file:...`); None: `<log_dir>/mlruns`, a local file store."""


@dataclass(frozen=True)
class LoggerConfig:
    """Metrics and progress."""

    log_dir: str = "logs"
    """Where `metrics.jsonl` (and TensorBoard event files) go."""
    tensorboard: bool = False
    """Also write TensorBoard scalars (needs the `tensorboard` package)."""
    print_progress: bool = True
    """Print one progress line per step."""
    wandb_enabled: bool = False
    """Also log to Weights & Biases (needs `wandb`; `WANDB_MODE=offline` writes locally)."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """The W&B run."""
    mlflow_enabled: bool = False
    """Also log to MLflow (needs `mlflow-skinny` or `mlflow`)."""
    mlflow: MLflowConfig = field(default_factory=MLflowConfig)
    """The MLflow run."""
    num_val_samples_to_print: int = 4
    """Validation completions printed and logged as a table at each validation (0: none)."""


@dataclass(frozen=True)
class ClusterConfig:
    """The processes of the run."""

    gpus_per_node: int | None = None
    """Ranks started: one per GPU (CPU processes without CUDA). The data-parallel size is
    `gpus_per_node x num_nodes / (TP x PP x CP)`. None: TP x PP x CP x EP ranks (data parallel only as wide as EP
    needs)."""
    num_nodes: int = 1
    """Hosts the run spans. Above 1 the run is started by a launcher on every node (`torchrun`, see
    docs/scale-out.md) with `gpus_per_node` ranks each, and `logger.log_dir` and `checkpointing.checkpoint_dir` must
    be on storage that every node mounts at the same path."""


@dataclass(frozen=True)
class GRPOConfig:
    """A whole GRPO run."""

    policy: PolicyConfig = field(default_factory=PolicyConfig)
    """The model being trained."""
    grpo: GRPOSection = field(default_factory=GRPOSection)
    """The outer loop."""
    loss_fn: LossConfig = field(default_factory=LossConfig)
    """The GRPO loss (see `grpo.algorithm.options.LossConfig` and `grpo.algorithm.losses`)."""
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    """Rollouts."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompts."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Scoring."""
    checkpointing: CheckpointingConfig = field(default_factory=CheckpointingConfig)
    """Checkpoints."""
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    """Metrics and progress."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """How many ranks run."""

    def validate(self) -> None:
        """Every cross-field check that needs no model or process; raises `GRPOConfigError`."""
        _validate(self)


# Loading --------------------------------------------------------------------------------------------------------


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """Check `value` against a field's type hint; nested dataclasses are built recursively."""
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        if isinstance(value, hint):
            return value
        if not isinstance(value, Mapping):
            raise GRPOConfigError(f"{where} must be a mapping, got {type(value).__name__}")
        return _build(hint, value, f"{where}.")
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, where)
            except GRPOConfigError as err:
                errors.append(str(err))
        raise GRPOConfigError(errors[0] if errors else f"{where} may not be null")
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise GRPOConfigError(f"{where} must be a list, got {type(value).__name__}")
        return tuple(_coerce(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
    if origin is Mapping or hint is Mapping:
        if not isinstance(value, Mapping):
            raise GRPOConfigError(f"{where} must be a mapping, got {type(value).__name__}")
        return dict(value)
    return _scalar(value, hint, where)


def _scalar(value: Any, hint: Any, where: str) -> Any:
    if hint is Any:
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is int and isinstance(value, bool):
        raise GRPOConfigError(f"{where} must be an int, got {value!r}")
    if isinstance(hint, type) and issubclass(hint, str) and hint is not str and isinstance(value, str):
        try:
            return hint(value)  # StrEnum
        except ValueError as err:
            raise GRPOConfigError(f"{where}: {err}") from None
    if isinstance(hint, type) and not isinstance(value, hint):
        raise GRPOConfigError(f"{where} must be {hint.__name__}, got {type(value).__name__} {value!r}")
    return value


def _build(cls: type, data: Mapping[str, Any], where: str = "") -> Any:
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in names:
            raise unknown_key(str(key), names, where)
    kwargs = {key: _coerce(value, hints[key], f"{where}{key}") for key, value in data.items()}
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as err:
        raise GRPOConfigError(f"{where.rstrip('.') or 'config'}: {err}") from None


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise GRPOConfigError(f"override {dotted!r}: {part!r} is not a section")
        node = child
    node[parts[-1]] = value


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A copy of `data` with each `a.b.c=value` applied (value parsed as a YAML scalar/flow value)."""
    result = _deep_copy(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise GRPOConfigError(f"override {item!r} is not of the form key.sub=value")
        _set_dotted(result, key.strip(), _override_value(item, raw))
    return result


def _override_value(item: str, raw: str) -> Any:
    """An override's value, parsed as YAML (`3` an int, `[1, 2]` a list); text that is not YAML is refused naming
    the override and where the parser stopped."""
    if not raw.strip():
        return None
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError as err:
        raise GRPOConfigError(f"override {item!r}: the value is not valid YAML: {_yaml_problem(err)}") from None


def _yaml_problem(err: yaml.YAMLError) -> str:
    """The parser's complaint and where, on one line (`expected ',' or ']' ... at line 1, column 6`)."""
    mark = getattr(err, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    return " ".join(f"{problem}{where}".split())


def _deep_copy(data: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, Mapping) else v for k, v in data.items()}


def config_from_dict(data: Mapping[str, Any], overrides: Sequence[str] = ()) -> GRPOConfig:
    """A validated `GRPOConfig` from nested dicts plus dotted overrides."""
    config = _build(GRPOConfig, apply_overrides(data, overrides))
    config.validate()
    return config


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> GRPOConfig:
    """A validated `GRPOConfig` from a YAML file plus dotted overrides; an unreadable file or a YAML syntax error
    is a one-line `GRPOConfigError` naming the file (and the line and column)."""
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, UnicodeDecodeError) as err:
        raise GRPOConfigError(f"{path}: cannot read the config: {err}") from None
    except yaml.YAMLError as err:
        raise GRPOConfigError(f"{path}: not valid YAML: {_yaml_problem(err)}") from None
    if not isinstance(data, Mapping):
        raise GRPOConfigError(f"{path}: the top level must be a mapping of sections")
    return config_from_dict(data, overrides)


# Validation -----------------------------------------------------------------------------------------------------


def _validate(config: GRPOConfig) -> None:
    """Section by section, then across sections; the forwarded megatron-core keys last."""
    policy = config.policy
    require(bool(policy.model_path), "policy.model_path is required")
    require(policy.dtype in ("fp32", "bf16", "fp16"), f"policy.dtype={policy.dtype!r}: one of fp32, bf16, fp16")
    _validate_backend_switch(policy)
    if policy.dtensor_cfg.enabled:
        validate_dtensor(policy.dtensor_cfg, policy.dtype, config.loss_fn.aggregation, cluster_ranks(config))
    validate_megatron(policy.megatron_cfg, config.loss_fn.aggregation)
    require(policy.refit_bucket_mb >= 1, f"policy.refit_bucket_mb={policy.refit_bucket_mb} must be >= 1")
    if policy.router_replay.enabled:
        _validate_router_replay(config)
    _validate_lora(config)
    _validate_grpo(config.grpo)
    _validate_cluster(config.cluster)
    _validate_data_parallel(config, parallel_dims(config).dp)
    _validate_generation(config.generation)
    validate_data(config.data)
    validate_reward(config.reward)
    require(
        not config.checkpointing.enabled or config.checkpointing.save_period >= 1,
        "checkpointing.save_period must be >= 1",
    )
    from hf_mcore_bridge.grpo.data.stop_tokens import stop_token_ids

    if Path(policy.model_path).exists():  # a missing model is refused when the run starts (`with_stop_token_ids`)
        stop_token_ids(config)
    _validate_logger(config.logger)
    # last: the key names come from megatron-core's config classes, and importing it takes seconds; every mistake
    # the checks above can see is reported without it
    validate_forwarded(policy.megatron_cfg)


# transformer keys under which megatron-core's router would not replay a forward's routing as handed to it
_NO_REPLAY_KEYS = {
    "recompute_granularity": "a recomputed forward takes the replay's backward queue, which is not filled",
    "moe_router_fusion": "the fused top-k (Transformer Engine) has no replay hook",
}


def _validate_router_replay(config: GRPOConfig) -> None:
    """What routing replay cannot serve: the DTensor backend, vLLM, and megatron-core settings that bypass its
    hook. (A model without MoE layers is refused once the model is read, `trainer.prepare_run`.)"""
    where = "policy.router_replay.enabled=true"
    require(
        not config.policy.dtensor_cfg.enabled,
        f"{where} is implemented for the megatron-core backend only, not policy.dtensor_cfg (DTensor: the HF model's"
        " routers have no replay hook here)",
    )
    require(
        config.generation.backend == "embedded",
        f"{where} needs generation.backend=embedded (the engine that records each token's experts); vLLM's routed"
        " experts are not wired here",
    )
    for key, why in _NO_REPLAY_KEYS.items():
        value = config.policy.megatron_cfg.transformer.get(key)
        require(value in (None, False), f"{where} cannot be combined with policy.megatron_cfg.transformer.{key}: {why}")


def _check_adapter_path(lora: LoraConfig) -> None:
    """`policy.lora.adapter_path` is a PEFT LoRA directory whose rank, alpha and target modules are the config's
    (its `adapter_config.json` read as JSON, before torch loads)."""
    where = f"policy.lora.adapter_path={lora.adapter_path}"
    config_file = Path(str(lora.adapter_path)) / "adapter_config.json"
    require(config_file.is_file(), f"{where}: no adapter_config.json there (a PEFT adapter directory is expected)")
    require((config_file.parent / "adapter_model.safetensors").is_file(), f"{where}: no adapter_model.safetensors")
    try:
        saved = json.loads(config_file.read_text())
    except (OSError, ValueError) as err:
        raise GRPOConfigError(f"{where}: adapter_config.json is not readable JSON ({err})") from None
    targets = sorted(peft_targets(saved))
    found = (saved.get("r"), float(saved.get("lora_alpha", 0)), targets)
    wanted = (lora.rank, float(lora.alpha), sorted(lora.target_modules))
    require(
        found == wanted,
        f"{where}: the adapter has rank {found[0]}, alpha {found[1]:g}, target_modules {found[2]}; the config asks for"
        f" rank {wanted[0]}, alpha {wanted[1]:g}, target_modules {wanted[2]} (set policy.lora to the adapter's)",
    )


def _no_adapter_refit(config: GRPOConfig) -> str:
    """Why this run's engine cannot apply the adapters itself; empty where it can."""
    if config.policy.dtensor_cfg.enabled:
        return "the DTensor backend streams merged weights"
    if config.generation.backend != "embedded":
        return f"generation.backend={config.generation.backend} (the embedded engine applies adapters)"
    if experts := expert_targets(config.policy.lora):
        return f"the engine applies adapters on dense projections only, not {', '.join(experts)}"
    return ""


def _validate_lora(config: GRPOConfig) -> None:
    """`policy.lora`'s values, always; with `enabled`, what is not implemented yet, refused by name."""
    lora = config.policy.lora
    require(lora.rank >= 1, f"policy.lora.rank={lora.rank} must be >= 1")
    require(real_number(lora.alpha, "policy.lora.alpha") > 0, f"policy.lora.alpha={lora.alpha} must be > 0")
    dropout = real_number(lora.dropout, "policy.lora.dropout")
    require(0 <= dropout < 1, f"policy.lora.dropout={lora.dropout} must be in [0, 1) (the probability of a zero)")
    require(lora.init in INITS, f"policy.lora.init={lora.init!r}: one of {', '.join(INITS)}")
    require(lora.refit in REFITS, f"policy.lora.refit={lora.refit!r}: one of {', '.join(REFITS)}")
    require(bool(lora.target_modules), "policy.lora.target_modules is empty: name at least one HF projection")
    for name in lora.target_modules:
        if name not in TARGETS:
            close = difflib.get_close_matches(name, TARGETS, n=1, cutoff=0.5)
            hint = f"; did you mean '{close[0]}'?" if close else f"; implemented: {', '.join(TARGETS)}"
            raise GRPOConfigError(f"policy.lora.target_modules: {name!r} is not an implemented projection{hint}")
    for group in FUSED:
        chosen = [name for name in group if name in lora.target_modules]
        require(
            not chosen or len(chosen) == len(group),
            f"policy.lora.target_modules: {', '.join(group)} share one megatron-core linear; target all of them or"
            " none (a part of them is not implemented)",
        )
    if not lora.enabled:
        return
    if lora.adapter_path is not None:
        _check_adapter_path(lora)
    if lora.refit == "adapters" and (why := _no_adapter_refit(config)):
        raise GRPOConfigError(f"policy.lora.refit=adapters: {why} (set policy.lora.refit: merged)")
    experts = expert_targets(lora)
    require(
        not (experts and dropout),
        f"policy.lora.dropout={lora.dropout} with adapters on experts {list(experts)}: dropout is implemented on"
        " dense projections' adapters only (PEFT's expert adapters have none either)",
    )
    dtensor = config.policy.dtensor_cfg
    if dtensor.enabled:
        require(
            dtensor.tensor_parallel_size == 1 or not dropout,
            f"policy.lora.dropout={lora.dropout} with policy.dtensor_cfg.tensor_parallel_size="
            f"{dtensor.tensor_parallel_size}: adapter dropout under tensor parallelism is not implemented (a"
            " row-parallel projection's ranks would draw the same mask for their halves of x); set dropout to 0",
        )
        return
    megatron = config.policy.megatron_cfg
    if experts:
        require(
            dropout == 0,
            f"policy.lora.dropout={lora.dropout} with adapters on experts {list(experts)}: dropout is implemented on"
            " dense projections' adapters only (PEFT's expert adapters have none either)",
        )
        tp = megatron.tensor_model_parallel_size
        etp = megatron.expert_tensor_parallel_size or tp
        require(
            etp in (1, tp),
            f"policy.lora.target_modules {list(experts)} with expert tensor parallelism {etp}"
            f" (policy.megatron_cfg.expert_tensor_parallel_size) and tensor_model_parallel_size {tp}: adapters on"
            " experts are implemented at expert_tensor_parallel_size 1 or equal to tensor_model_parallel_size"
            " (megatron-core's gradient norm counts a replicated expert factor once per group only then)",
        )
        sequence_parallel = megatron.sequence_parallel or megatron.transformer.get("sequence_parallel", False)
        require(
            tp == 1 or sequence_parallel,
            f"policy.lora.target_modules {list(experts)} at tensor_model_parallel_size {tp}: megatron-core trains"
            " mixture-of-experts layers at tensor parallelism > 1 only with sequence parallelism (set"
            " policy.megatron_cfg.sequence_parallel: true)",
        )


def _validate_backend_switch(policy: PolicyConfig) -> None:
    megatron, dtensor = policy.megatron_cfg.enabled, policy.dtensor_cfg.enabled
    require(
        not (megatron and dtensor),
        "policy.dtensor_cfg.enabled=true needs policy.megatron_cfg.enabled=false: exactly one training backend"
        " (megatron_cfg.enabled defaults to true)",
    )
    require(
        megatron or dtensor,
        "no training backend: set policy.megatron_cfg.enabled=true or policy.dtensor_cfg.enabled=true",
    )


def _validate_grpo(grpo: GRPOSection) -> None:
    require(grpo.num_generations_per_prompt >= 2, "grpo.num_generations_per_prompt must be >= 2 (group baseline)")
    require(grpo.num_prompts_per_step >= 1, "grpo.num_prompts_per_step must be >= 1")
    require(grpo.max_num_steps >= 1, "grpo.max_num_steps must be >= 1")
    require(
        grpo.max_token_mult_prob_error is None or grpo.max_token_mult_prob_error >= 1.0,
        f"grpo.max_token_mult_prob_error={grpo.max_token_mult_prob_error} must be >= 1 (1: exact agreement)",
    )
    require(
        grpo.on_logprob_mismatch in ("stop", "warn"),
        f"grpo.on_logprob_mismatch={grpo.on_logprob_mismatch!r}: stop or warn",
    )
    samples = grpo.num_prompts_per_step * grpo.num_generations_per_prompt
    require(
        grpo.num_minibatches >= 1 and samples % grpo.num_minibatches == 0,
        f"grpo.num_minibatches={grpo.num_minibatches} must divide the step's {samples} samples",
    )
    require(grpo.val_num_generations >= 1, "grpo.val_num_generations must be >= 1")


def _validate_cluster(cluster: ClusterConfig) -> None:
    nodes = cluster.num_nodes
    require(nodes >= 1, f"cluster.num_nodes={nodes} must be >= 1")
    require(nodes == 1 or cluster.gpus_per_node is not None, "cluster.num_nodes > 1 needs gpus_per_node")


def _validate_data_parallel(config: GRPOConfig, dp: int) -> None:
    """Every mini-batch splits evenly over the `dp` data-parallel ranks."""
    samples = config.grpo.num_prompts_per_step * config.grpo.num_generations_per_prompt
    per_minibatch = samples // max(1, config.grpo.num_minibatches)
    require(
        per_minibatch % dp == 0,
        f"a mini-batch's {per_minibatch} samples do not split over the {dp} data-parallel ranks"
        " (grpo.num_prompts_per_step * num_generations_per_prompt / num_minibatches must be a multiple of it)",
    )


def _validate_generation(gen: GenerationConfig) -> None:
    require(gen.backend in ("embedded", "vllm"), f"generation.backend={gen.backend!r}: embedded or vllm")
    require(gen.precision in ("dtype", "fp8"), f"generation.precision={gen.precision!r}: dtype or fp8")
    require(
        gen.precision != "fp8" or gen.backend == "embedded",
        "generation.precision=fp8 is implemented for the embedded engine only (generation.backend=embedded)",
    )
    require(gen.kv_cache_dtype in ("auto", "fp8"), f"generation.kv_cache_dtype={gen.kv_cache_dtype!r}: auto or fp8")
    require(
        gen.kv_cache_dtype != "fp8" or gen.backend == "embedded",
        "generation.kv_cache_dtype=fp8 is implemented for the embedded engine only (generation.backend=embedded)",
    )
    require(gen.kv_cache_scale > 0, f"generation.kv_cache_scale={gen.kv_cache_scale} must be positive")
    require(
        gen.top_p == 1.0 and gen.top_k == 0,
        f"generation.top_p={gen.top_p} / top_k={gen.top_k}: truncated sampling is refused for training (the trainer"
        " scores the full softmax, so its log-probs and importance ratios would not be those of the sampled"
        " distribution); use top_p=1 and top_k=0 and tune the temperature instead",
    )
    require(
        gen.backend != "vllm" or importlib.util.find_spec("vllm") is not None,
        "generation.backend=vllm needs the 'vllm' package (not installed); use embedded",
    )
    require(
        gen.decode_attention in ("auto", *DECODE_KERNELS),
        f"generation.decode_attention={gen.decode_attention!r}: one of {', '.join(('auto', *DECODE_KERNELS))}",
    )
    require(gen.flex_min_batch >= 1, "generation.flex_min_batch must be >= 1")
    require(gen.temperature > 0, "generation.temperature must be > 0 for training (log-probs are tempered)")
    require(gen.max_new_tokens >= 1, "generation.max_new_tokens must be >= 1")


def _validate_logger(logger: LoggerConfig) -> None:
    if logger.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise GRPOConfigError("logger.tensorboard=true needs the 'tensorboard' package (pip install tensorboard)")
    require(logger.num_val_samples_to_print >= 0, "logger.num_val_samples_to_print must be >= 0")
    for enabled, package, key in (
        (logger.wandb_enabled, "wandb", "wandb"),
        (logger.mlflow_enabled, "mlflow", "mlflow"),
    ):
        require(
            not enabled or importlib.util.find_spec(package) is not None,
            f"logger.{key}_enabled=true needs the '{package}' package (pip install 'hf-mcore-bridge[loggers]')",
        )
