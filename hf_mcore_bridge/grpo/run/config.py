"""The GRPO run's configuration: frozen dataclasses, one per YAML section, and the loader that fills them.

A YAML file (or a dict) maps section by section onto `GRPOConfig`; `key.sub=value` overrides are applied on top
(values parsed as YAML scalars, so `grpo.seed=3` is an int). An unknown key anywhere is a `GRPOConfigError`
naming the closest valid key. `megatron_cfg.transformer` / `.optimizer` / `.ddp` are free-form dicts forwarded as
given to megatron-core's `TransformerConfig`, `OptimizerConfig` and `DistributedDataParallelConfig`; their keys
are checked against those classes' fields (megatron-core is imported for that), and keys the trainer derives
itself (model shape, parallel sizes, dtype) are refused there. `validate()` checks the whole config, cheap
checks only, before any process starts.

Two training backends, exactly one enabled: `policy.megatron_cfg` (megatron-core, `enabled: true` by default) and
`policy.dtensor_cfg` (the HF model under FSDP2 and DTensor TP; enabling it needs `megatron_cfg.enabled: false`).
`PolicyConfig.backend_cfg` is the enabled one's section, and `world_of` / `data_parallel_size` follow it.

Simplifications: the loss section IS the algorithm's `LossConfig` (one definition of the loss knobs); the vLLM
generation backend needs the `vllm` package (checked at validation); context parallelism needs Transformer
Engine and is refused by megatron-core's local spec.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hf_mcore_bridge.convert.layout import Layout, check_world, world_size
from hf_mcore_bridge.convert.transformer_impl import check_transformer_impl
from hf_mcore_bridge.engine.options import DECODE_KERNELS
from hf_mcore_bridge.errors import BridgeError
from hf_mcore_bridge.grpo.algorithm.options import Aggregation, LeaveOneOutStd, LossConfig
from hf_mcore_bridge.grpo.errors import GRPOConfigError

__all__ = [
    "CheckpointingConfig",
    "ClusterConfig",
    "DTensorConfig",
    "DataConfig",
    "GRPOConfig",
    "GRPOSection",
    "GenerationConfig",
    "LoggerConfig",
    "MLflowConfig",
    "MegatronConfig",
    "PolicyConfig",
    "RewardConfig",
    "SchedulerConfig",
    "WandbConfig",
    "apply_overrides",
    "config_from_dict",
    "layout_of",
    "load_config",
]


SUPPORTED_STYLES = ("constant", "linear", "cosine", "inverse-square-root")
"""`lr_decay_style` values the DTensor backend's scheduler (`grpo.lr_schedule`) implements."""


@dataclass(frozen=True)
class SchedulerConfig:
    """megatron-core's `OptimizerParamScheduler` (learning rate and weight decay per step)."""

    lr_warmup_steps: int = 0
    """Optimizer steps of linear warm-up from `lr_warmup_init` to the optimizer's `lr`."""
    lr_warmup_init: float = 0.0
    """Learning rate at step 0 of the warm-up."""
    lr_decay_steps: int | None = None
    """Optimizer steps over which the rate decays to `min_lr`; None: the run's total optimizer steps."""
    lr_decay_style: str = "constant"
    """`constant`, `linear`, `cosine`, `inverse-square-root` or `WSD` (megatron-core's names)."""
    min_lr: float = 0.0
    """Floor of the decayed learning rate."""


@dataclass(frozen=True)
class MegatronConfig:
    """How megatron-core runs the policy: parallel sizes plus keys forwarded to its config classes."""

    enabled: bool = True
    """Train with megatron-core (the default backend); set false to train with `policy.dtensor_cfg` instead."""
    tensor_model_parallel_size: int = 1
    """TP: heads, query groups, FFN width and vocabulary split over this many ranks."""
    pipeline_model_parallel_size: int = 1
    """PP: decoder layers split into this many stages."""
    context_parallel_size: int = 1
    """CP: every sequence split over this many ranks (megatron-core's load-balanced 2 x CP chunks; keys and values
    all-gathered in the project's attention, `context_parallel`); rows are padded per sequence to 2 x CP."""
    expert_model_parallel_size: int = 1
    """EP: routed experts split over this many ranks (MoE models)."""
    expert_tensor_parallel_size: int | None = None
    """ETP: each expert's weights split over this many ranks; None: the same as TP (megatron-core's default)."""
    sequence_parallel: bool = False
    """megatron-core's sequence parallelism (TP > 1 only)."""
    micro_batch_size: int = 4
    """Samples per micro-batch of the training and log-prob forward passes (padded to their longest)."""
    sequence_packing: bool = False
    """Pack whole rollouts into single rows with a block-diagonal causal mask instead (token aggregation only)."""
    max_tokens_per_microbatch: int = 1024
    """Row length budget of a packed micro-batch."""
    make_vocab_size_divisible_by: int = 128
    """Vocabulary padding rule (times TP), as Megatron-LM; padded logits are masked out of every softmax."""
    moe_router_bias_update_rate: float = 0.0
    """Routers with an expert score bias (GLM-4.5, DeepSeek-V3): how far megatron-core moves each expert's bias
    after every optimizer step, towards balanced expert loads (its `moe_router_bias_update_rate`, whose own default
    is 1e-3). 0, the default here as in NeMo-RL's GRPO recipes: the bias stays as the checkpoint has it, so routing
    changes only through the loss's gradients; a positive rate changes the model beyond what the objective asks
    (the KL reference keeps the initial biases)."""
    transformer: Mapping[str, Any] = field(default_factory=dict)
    """Extra `TransformerConfig` keys, forwarded as given (e.g. `recompute_granularity`)."""
    optimizer: Mapping[str, Any] = field(default_factory=lambda: {"lr": 1e-6, "weight_decay": 0.01, "clip_grad": 1.0})
    """`OptimizerConfig` keys, forwarded as given (`lr`, `weight_decay`, `adam_beta1`, `clip_grad`, ...)."""
    ddp: Mapping[str, Any] = field(default_factory=dict)
    """`DistributedDataParallelConfig` keys, forwarded as given (e.g. `overlap_grad_reduce`)."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    """Learning-rate and weight-decay schedule."""


def layout_of(megatron: MegatronConfig) -> Layout:
    """The parallel layout a `MegatronConfig` asks for."""
    return Layout(
        tp=megatron.tensor_model_parallel_size,
        pp=megatron.pipeline_model_parallel_size,
        cp=megatron.context_parallel_size,
        ep=megatron.expert_model_parallel_size,
        etp=megatron.expert_tensor_parallel_size,
    )


@dataclass(frozen=True)
class DTensorConfig:
    """The DTensor training backend: the HF transformers model sharded with FSDP2, optional tensor parallelism."""

    enabled: bool = False
    """Train the HF model with FSDP2 instead of megatron-core (needs `policy.megatron_cfg.enabled: false`)."""
    tensor_parallel_size: int = 1
    """TP over DTensor: attention heads and MLP width split over this many ranks (Llama-family models)."""
    context_parallel_size: int = 1
    """CP over DTensor: refused above 1 (`DTENSOR_CP_REFUSAL`); context parallelism runs on the megatron-core
    backend (`policy.megatron_cfg.context_parallel_size`)."""
    data_parallel_shard_size: int | None = None
    """FSDP2 ranks the parameters, gradients and optimizer state are sharded over (each trains on its share of
    every mini-batch); None: `cluster.gpus_per_node / tensor_parallel_size`, or 1 without `gpus_per_node`."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward (transformers' activation checkpointing)."""
    defer_gradient_sync: bool = False
    """Reduce-scatter gradients once per mini-batch (after its last micro-batch) instead of after every micro-batch
    (FSDP2's default). Fewer collectives, but each rank then holds the unsharded fp32 gradients between
    micro-batches: 32 GB for an 8B model, which ran out of memory on 2 H200s in `scripts/bench_training.py`."""
    micro_batch_size: int = 4
    """Samples per micro-batch of the training and log-prob forward passes (padded to their longest)."""
    sequence_packing: bool = False
    """Pack whole rollouts into single rows (positions restart per rollout) instead (token aggregation only)."""
    max_tokens_per_microbatch: int = 1024
    """Row length budget of a packed micro-batch."""
    lr: float = 1e-6
    """Peak learning rate of AdamW (the schedule's `max_lr`)."""
    weight_decay: float = 0.01
    """AdamW's decoupled weight decay, applied to matrices only (not to biases and norms, as megatron-core)."""
    betas: tuple[float, ...] = (0.9, 0.999)
    """AdamW's (beta1, beta2)."""
    eps: float = 1e-8
    """AdamW's epsilon."""
    clip_grad: float = 1.0
    """Gradients are scaled to this global L2 norm at most (0: no clipping)."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    """Learning-rate schedule, as for megatron-core (`WSD` excepted)."""


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
    the training forward's, detached: the same values without the extra pass)."""
    seed: int = 0
    """Seeds the prompt order and the sampling."""
    val_period: int = 0
    """Run validation every this many steps (0: never)."""
    val_num_prompts: int = 8
    """Prompts of the validation set scored at each validation."""
    val_num_generations: int = 1
    """Completions per validation prompt: 1 is greedy; more are sampled at `generation.temperature` and give
    `val_pass_at_1` (their mean reward) and `val_pass_at_k` (see `grpo.validation`)."""
    normalize_rewards: bool = True
    """Divide advantages by a reward standard deviation (GRPO; the group's, or with `leave_one_out` the one
    `leave_one_out_std` names); False: Dr. GRPO."""
    leave_one_out: bool = False
    """Baseline each completion with the mean of the others of its group (NeMo-RL's `use_leave_one_out_baseline`)."""
    leave_one_out_std: LeaveOneOutStd = LeaveOneOutStd.OTHERS
    """With `leave_one_out` and `normalize_rewards`, what each advantage is divided by: `others`, the sample std of
    the other rewards of its group (NeMo-RL's; an advantage whose others are all equal is left undivided), or
    `group`, the sample std of the whole group (see `grpo.advantages`)."""
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
    every tensor of that directory exactly (`grpo.source_check`: one extra stream and one read of the files)."""


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
    part from its own shards, with no all-gather but the vocabulary's (`grpo.refit.shard_local_hf_weights`)."""


@dataclass(frozen=True)
class DataConfig:
    """Where prompts come from: a built-in task, a JSONL file, or an HF dataset by name (where reachable)."""

    task: str | None = None
    """A built-in task of `grpo.tasks` (e.g. `repeat_digit`); exclusive with `train_jsonl`."""
    num_records: int = 1000
    """Records generated for a built-in task."""
    train_jsonl: str | None = None
    """A JSONL file of `{prompt, answer}` rows."""
    val_jsonl: str | None = None
    """Validation rows; None with a task: a disjoint seed of the same task."""
    hf_dataset: str | None = None
    """An HF dataset name or path for `datasets.load_dataset` (needs the `datasets` package and the Hub or a
    local copy); exclusive with `task` and `train_jsonl`."""
    hf_subset: str | None = None
    """The dataset's configuration name (`datasets.load_dataset(name=...)`; `main` for openai/gsm8k)."""
    hf_split: str = "train"
    """The dataset split to train on."""
    hf_val_split: str | None = None
    """The split to validate on (None: the first rows of the training split)."""
    prompt_field: str = "prompt"
    """The prompt's field name in the JSONL rows."""
    answer_field: str = "answer"
    """The answer's field name in the JSONL rows."""
    processor: str | None = None
    """A named row format (`gsm8k`, `math`, `deepscaler`, `openmathinstruct2`; see `grpo.processors`) that sets
    the fields and reduces the answer; None: `prompt_field` / `answer_field` as given."""
    shuffle: bool = True
    """Shuffle each epoch (seeded by `grpo.seed`)."""
    apply_chat_template: bool | None = None
    """Render prompts with the tokenizer's chat template (`tokenizer.apply_chat_template`); None: where the
    tokenizer has one (see `grpo.chat`)."""
    system_prompt: str | None = None
    """A system turn put before each question (needs the chat template)."""
    prompt_template: str | None = None
    """A format string around each question, e.g. `"{question} Put the final answer in \\boxed{{}}."`; None:
    the question as it is."""


_IN_PROCESS_REWARDS = ("number", "exact", "exact_match")
"""Built-in rewards cheap enough to score in the rank's own process by default."""


@dataclass(frozen=True)
class RewardConfig:
    """How a completion is scored."""

    @property
    def workers(self) -> int:
        """`num_workers`, resolved."""
        if self.num_workers is not None:
            return self.num_workers
        return 0 if self.name in _IN_PROCESS_REWARDS else 4

    name: str = "math"
    """A built-in reward (`math`: math-verify's symbolic check; `number`; `exact`) or a `module:function` taking
    `(completion_text, answer)` (see `grpo.rewards`)."""
    num_workers: int | None = None
    """Processes that score completions, per engine replica (started by its first rank; 0: in that rank's own
    process), see `grpo.scoring`. None: 0 for the microsecond-cheap `number` and `exact` rewards, 4 for the others
    (`math` and functions of your own)."""
    timeout_s: float = 5.0
    """Seconds one sample's reward may take; past it the sample scores 0 (`reward_timeouts` counts them)."""
    overlap: bool = True
    """Score each completion while the rest are generating: the embedded engine hands every sample to the reward
    workers as it finishes, so after generation only the last ones' scores are waited for (`reward_wait_s`). The
    rewards, their order and the metrics are those of scoring after generation (false), which vLLM's engine
    always amounts to (it returns a batch at once). No gain with `num_workers: 0`: there the engine's own process
    scores each sample as it arrives."""


@dataclass(frozen=True)
class CheckpointingConfig:
    """Megatron distributed checkpoints of policy and optimizer (see `grpo.checkpoint`)."""

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
    """Hosts the run spans. Above 1 the run is started by a launcher on every node (`torchrun`, see README) with
    `gpus_per_node` ranks each, and `logger.log_dir` and `checkpointing.checkpoint_dir` must be on storage that
    every node mounts at the same path."""


@dataclass(frozen=True)
class GRPOConfig:
    """A whole GRPO run."""

    policy: PolicyConfig = field(default_factory=PolicyConfig)
    """The model being trained."""
    grpo: GRPOSection = field(default_factory=GRPOSection)
    """The outer loop."""
    loss_fn: LossConfig = field(default_factory=LossConfig)
    """The GRPO loss (see `grpo.losses.LossConfig`)."""
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

_FORWARDED = ("transformer", "optimizer", "ddp")


_NEMO_RL_NAMES = {"use_leave_one_out_baseline": "leave_one_out"}
"""NeMo-RL keys spelled differently here: the suggestion names ours rather than the closest string."""


def _unknown(key: str, valid: Sequence[str], where: str) -> GRPOConfigError:
    if _NEMO_RL_NAMES.get(key) in valid:
        return GRPOConfigError(f"unknown config key '{where}{key}'; NeMo-RL's name for '{where}{_NEMO_RL_NAMES[key]}'")
    close = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.5)
    hint = f"; did you mean '{where}{close[0]}'?" if close else f"; valid keys here: {sorted(valid)}"
    return GRPOConfigError(f"unknown config key '{where}{key}'{hint}")


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
            raise _unknown(str(key), names, where)
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

_DERIVED_TRANSFORMER_KEYS = frozenset(
    {
        "num_layers",
        "hidden_size",
        "ffn_hidden_size",
        "num_attention_heads",
        "num_query_groups",
        "kv_channels",
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "context_parallel_size",
        "expert_model_parallel_size",
        "sequence_parallel",
        "params_dtype",
        "pipeline_dtype",
        "bf16",
        "fp16",
    }
)
"""TransformerConfig keys the trainer sets from the model and the parallel sizes."""

_EXPLICIT_TRANSFORMER_KEYS = {"moe_router_bias_update_rate": "policy.megatron_cfg.moe_router_bias_update_rate"}
"""TransformerConfig keys that have a key of their own (documented default) instead of `transformer.<key>`."""


def megatron_config_classes() -> dict[str, type]:
    """The megatron-core classes that `megatron_cfg.transformer/optimizer/ddp` are forwarded to."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer import TransformerConfig

    return {"transformer": TransformerConfig, "optimizer": OptimizerConfig, "ddp": DistributedDataParallelConfig}


def _validate_forwarded(megatron: MegatronConfig) -> None:
    for section, cls in megatron_config_classes().items():
        valid = [f.name for f in dataclasses.fields(cls)]
        for key in getattr(megatron, section):
            if key not in valid:
                raise _unknown(key, valid, f"policy.megatron_cfg.{section}.")
            if section == "transformer" and key in _EXPLICIT_TRANSFORMER_KEYS:
                raise GRPOConfigError(
                    f"policy.megatron_cfg.transformer.{key} is set by {_EXPLICIT_TRANSFORMER_KEYS[key]}; "
                    "set that instead"
                )
            if section == "transformer" and key in _DERIVED_TRANSFORMER_KEYS:
                raise GRPOConfigError(
                    f"policy.megatron_cfg.transformer.{key} is set by the trainer (from the model or the parallel "
                    "sizes); set the parallel sizes under policy.megatron_cfg instead"
                )


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise GRPOConfigError(message)


def _number(value: Any, where: str) -> float:
    """A real number from the config; YAML 1.1 reads `1e-6` (no dot) as text, so the message says how to write it."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        hint = " (YAML reads 1e-6 as text: write 1.0e-6)" if isinstance(value, str) else ""
        raise GRPOConfigError(f"{where} must be a number, got {value!r}{hint}")
    _require(value == value and abs(value) != float("inf"), f"{where} must be finite, got {value!r}")
    return float(value)


_OPTIMIZER_RANGES = {
    "lr": (0.0, None),
    "min_lr": (0.0, None),
    "weight_decay": (0.0, None),
    "clip_grad": (0.0, None),
    "adam_beta1": (0.0, 1.0),
    "adam_beta2": (0.0, 1.0),
}
"""Forwarded `OptimizerConfig` keys and their ranges, [low, high): megatron-core asserts them only inside a rank."""


def _validate_optimizer(megatron: MegatronConfig) -> None:
    for key, (low, high) in _OPTIMIZER_RANGES.items():
        if key not in megatron.optimizer:
            continue
        where = f"policy.megatron_cfg.optimizer.{key}"
        value = _number(megatron.optimizer[key], where)
        _require(value >= low, f"{where}={value:g} must be >= {low:g}")
        if high is not None:
            _require(value < high, f"{where}={value:g} must be < {high:g}")
    if "adam_eps" in megatron.optimizer:
        eps = _number(megatron.optimizer["adam_eps"], "policy.megatron_cfg.optimizer.adam_eps")
        _require(eps > 0, f"policy.megatron_cfg.optimizer.adam_eps={eps:g} must be > 0")


def _validate_schedule(schedule: SchedulerConfig, max_lr: float | None, where: str) -> None:
    """The checks megatron-core's `OptimizerParamScheduler` asserts, made in the parent with the key's name."""
    min_lr = _number(schedule.min_lr, f"{where}.min_lr")
    init = _number(schedule.lr_warmup_init, f"{where}.lr_warmup_init")
    _require(min_lr >= 0, f"{where}.min_lr={min_lr:g} must be >= 0")
    _require(init >= 0, f"{where}.lr_warmup_init={init:g} must be >= 0")
    _require(schedule.lr_warmup_steps >= 0, f"{where}.lr_warmup_steps={schedule.lr_warmup_steps} must be >= 0")
    decay = schedule.lr_decay_steps
    _require(
        decay is None or decay > schedule.lr_warmup_steps,
        f"{where}.lr_decay_steps={decay} must be larger than lr_warmup_steps={schedule.lr_warmup_steps}",
    )
    if max_lr is not None:
        _require(min_lr <= max_lr, f"{where}.min_lr={min_lr:g} is above the learning rate {max_lr:g}")
        _require(init <= max_lr, f"{where}.lr_warmup_init={init:g} is above the learning rate {max_lr:g}")


def dtensor_sizes(config: GRPOConfig) -> tuple[int, int]:
    """(data_parallel_shard_size, tensor_parallel_size) of the DTensor backend; the shard size defaults to
    `cluster.gpus_per_node / tensor_parallel_size`, or 1."""
    dcfg, given = config.policy.dtensor_cfg, cluster_ranks(config)
    tp = dcfg.tensor_parallel_size
    return dcfg.data_parallel_shard_size or (given // tp if given and tp >= 1 else 1), tp


def cluster_ranks(config: GRPOConfig) -> int | None:
    """`cluster.gpus_per_node x cluster.num_nodes`, or None where `gpus_per_node` is not given."""
    given = config.cluster.gpus_per_node
    return None if given is None else given * config.cluster.num_nodes


def world_of(config: GRPOConfig) -> int:
    """The number of ranks the run starts."""
    if config.policy.dtensor_cfg.enabled:
        dp_shard, tp = dtensor_sizes(config)
        return dp_shard * tp
    given = cluster_ranks(config)
    return world_size(layout_of(config.policy.megatron_cfg)) if given is None else given


def data_parallel_size(config: GRPOConfig) -> int:
    """Data-parallel replicas of the dense layers: ranks / (TP x PP x CP); the FSDP2 shards for DTensor."""
    if config.policy.dtensor_cfg.enabled:
        return dtensor_sizes(config)[0]
    mcfg = config.policy.megatron_cfg
    model_parallel = mcfg.tensor_model_parallel_size * mcfg.pipeline_model_parallel_size * mcfg.context_parallel_size
    return world_of(config) // model_parallel


def _validate_world(config: GRPOConfig) -> None:
    nodes = config.cluster.num_nodes
    _require(nodes >= 1, f"cluster.num_nodes={nodes} must be >= 1")
    _require(nodes == 1 or config.cluster.gpus_per_node is not None, "cluster.num_nodes > 1 needs gpus_per_node")
    try:
        if config.policy.megatron_cfg.enabled:
            check_world(layout_of(config.policy.megatron_cfg), world_of(config))
    except BridgeError as err:
        raise GRPOConfigError(f"cluster.gpus_per_node x num_nodes: {err}") from None
    samples = config.grpo.num_prompts_per_step * config.grpo.num_generations_per_prompt
    per_minibatch = samples // max(1, config.grpo.num_minibatches)
    dp = data_parallel_size(config)
    _require(
        per_minibatch % dp == 0,
        f"a mini-batch's {per_minibatch} samples do not split over the {dp} data-parallel ranks"
        " (grpo.num_prompts_per_step * num_generations_per_prompt / num_minibatches must be a multiple of it)",
    )


def generation_tensor_parallel_size(config: GRPOConfig) -> int:
    """`generation.tensor_parallel_size`, or the policy's TP when it is null."""
    given = config.generation.tensor_parallel_size
    if given is not None:
        return given
    policy = config.policy
    if policy.dtensor_cfg.enabled:
        return policy.dtensor_cfg.tensor_parallel_size
    return policy.megatron_cfg.tensor_model_parallel_size


def _validate_generation_tp(config: GRPOConfig) -> None:
    tp, world = generation_tensor_parallel_size(config), world_of(config)
    _require(tp >= 1, f"generation.tensor_parallel_size={tp} must be >= 1")
    _require(
        world % tp == 0,
        f"generation.tensor_parallel_size={tp} must divide the run's {world} ranks (each engine replica spans "
        f"{tp} of them)",
    )


def _validate_backend_switch(policy: PolicyConfig) -> None:
    megatron, dtensor = policy.megatron_cfg.enabled, policy.dtensor_cfg.enabled
    _require(
        not (megatron and dtensor),
        "policy.dtensor_cfg.enabled=true needs policy.megatron_cfg.enabled=false: exactly one training backend"
        " (megatron_cfg.enabled defaults to true)",
    )
    _require(
        megatron or dtensor,
        "no training backend: set policy.megatron_cfg.enabled=true or policy.dtensor_cfg.enabled=true",
    )


DTENSOR_CP_REFUSAL = (
    "policy.dtensor_cfg.context_parallel_size > 1 is not supported: torch's context_parallel ring attention"
    " replaces only the CUDA SDPA kernels (flash, efficient, cuDNN) and takes no attention mask, so it cannot be"
    " checked exactly on CPU and packed rows cannot go through it; use policy.megatron_cfg.context_parallel_size"
)
"""Why the DTensor backend has no context parallelism (torch 2.13's `_context_parallel._attention` dispatch table)."""


def _validate_dtensor(config: GRPOConfig) -> None:
    dcfg, given = config.policy.dtensor_cfg, cluster_ranks(config)
    where = "policy.dtensor_cfg"
    tp, dp_shard = dcfg.tensor_parallel_size, dcfg.data_parallel_shard_size
    _require(tp >= 1, f"{where}.tensor_parallel_size={tp} must be >= 1")
    _require(dp_shard is None or dp_shard >= 1, f"{where}.data_parallel_shard_size={dp_shard} must be >= 1")
    _require(dcfg.context_parallel_size == 1, DTENSOR_CP_REFUSAL)
    if given is not None:
        _require(
            given % tp == 0 and (dp_shard is None or given == dp_shard * tp),
            f"cluster.gpus_per_node x num_nodes={given} must equal {where}.data_parallel_shard_size x"
            " tensor_parallel_size"
            f" ({dp_shard or 'derived'} x {tp})",
        )
    _require(config.policy.dtype != "fp16", "policy.dtype=fp16 is not supported by the DTensor backend; use bf16")
    _require(dcfg.micro_batch_size >= 1, f"{where}.micro_batch_size must be >= 1")
    _require(dcfg.max_tokens_per_microbatch >= 2, f"{where}.max_tokens_per_microbatch must be >= 2")
    _require(
        not dcfg.sequence_packing or config.loss_fn.aggregation is Aggregation.TOKEN,
        f"{where}.sequence_packing needs loss_fn.aggregation=token (a packed row holds many sequences)",
    )
    _require(len(dcfg.betas) == 2, f"{where}.betas must be two numbers (beta1, beta2), got {list(dcfg.betas)}")
    _require(dcfg.lr >= 0 and dcfg.eps > 0 and dcfg.clip_grad >= 0, f"{where}: lr, eps, clip_grad must be >= 0")
    _require(dcfg.weight_decay >= 0, f"{where}.weight_decay={dcfg.weight_decay:g} must be >= 0")
    _validate_schedule(dcfg.scheduler, dcfg.lr, f"{where}.scheduler")
    style = dcfg.scheduler.lr_decay_style
    _require(
        style in SUPPORTED_STYLES,
        f"{where}.scheduler.lr_decay_style={style!r}: one of {', '.join(SUPPORTED_STYLES)}",
    )


def _validate(config: GRPOConfig) -> None:
    policy, mcfg, grpo, gen, data = (
        config.policy,
        config.policy.megatron_cfg,
        config.grpo,
        config.generation,
        config.data,
    )
    _require(bool(policy.model_path), "policy.model_path is required")
    _require(policy.dtype in ("fp32", "bf16", "fp16"), f"policy.dtype={policy.dtype!r}: one of fp32, bf16, fp16")
    _validate_backend_switch(policy)
    if policy.dtensor_cfg.enabled:
        _validate_dtensor(config)
    for name in ("tensor_model", "pipeline_model", "context", "expert_model"):
        size = getattr(mcfg, f"{name}_parallel_size")
        _require(size >= 1, f"policy.megatron_cfg.{name}_parallel_size={size} must be >= 1")
    etp = mcfg.expert_tensor_parallel_size
    _require(etp is None or etp >= 1, f"policy.megatron_cfg.expert_tensor_parallel_size={etp} must be >= 1")
    _validate_world(config)
    _require(
        mcfg.context_parallel_size == 1 or not mcfg.transformer.get("attention_dropout"),
        "policy.megatron_cfg.context_parallel_size > 1 takes no transformer.attention_dropout (the context-parallel"
        " attention does not implement dropout)",
    )
    _require(
        not mcfg.sequence_parallel or mcfg.tensor_model_parallel_size > 1,
        "policy.megatron_cfg.sequence_parallel needs tensor_model_parallel_size > 1",
    )
    _require(mcfg.micro_batch_size >= 1, "policy.megatron_cfg.micro_batch_size must be >= 1")
    _require(mcfg.max_tokens_per_microbatch >= 2, "policy.megatron_cfg.max_tokens_per_microbatch must be >= 2")
    _require(
        mcfg.make_vocab_size_divisible_by >= 1,
        f"policy.megatron_cfg.make_vocab_size_divisible_by={mcfg.make_vocab_size_divisible_by} must be >= 1",
    )
    _require(policy.refit_bucket_mb >= 1, f"policy.refit_bucket_mb={policy.refit_bucket_mb} must be >= 1")
    _require(
        not mcfg.sequence_packing or config.loss_fn.aggregation is Aggregation.TOKEN,
        "policy.megatron_cfg.sequence_packing needs loss_fn.aggregation=token (a packed row holds many sequences)",
    )
    _require(grpo.num_generations_per_prompt >= 2, "grpo.num_generations_per_prompt must be >= 2 (group baseline)")
    _require(grpo.num_prompts_per_step >= 1, "grpo.num_prompts_per_step must be >= 1")
    _require(grpo.max_num_steps >= 1, "grpo.max_num_steps must be >= 1")
    _require(
        grpo.max_token_mult_prob_error is None or grpo.max_token_mult_prob_error >= 1.0,
        f"grpo.max_token_mult_prob_error={grpo.max_token_mult_prob_error} must be >= 1 (1: exact agreement)",
    )
    _require(
        grpo.on_logprob_mismatch in ("stop", "warn"),
        f"grpo.on_logprob_mismatch={grpo.on_logprob_mismatch!r}: stop or warn",
    )
    samples = grpo.num_prompts_per_step * grpo.num_generations_per_prompt
    _require(
        grpo.num_minibatches >= 1 and samples % grpo.num_minibatches == 0,
        f"grpo.num_minibatches={grpo.num_minibatches} must divide the step's {samples} samples",
    )
    _require(gen.backend in ("embedded", "vllm"), f"generation.backend={gen.backend!r}: embedded or vllm")
    _require(gen.precision in ("dtype", "fp8"), f"generation.precision={gen.precision!r}: dtype or fp8")
    _require(
        gen.precision != "fp8" or gen.backend == "embedded",
        "generation.precision=fp8 is implemented for the embedded engine only (generation.backend=embedded)",
    )
    _require(gen.kv_cache_dtype in ("auto", "fp8"), f"generation.kv_cache_dtype={gen.kv_cache_dtype!r}: auto or fp8")
    _require(
        gen.kv_cache_dtype != "fp8" or gen.backend == "embedded",
        "generation.kv_cache_dtype=fp8 is implemented for the embedded engine only (generation.backend=embedded)",
    )
    _require(gen.kv_cache_scale > 0, f"generation.kv_cache_scale={gen.kv_cache_scale} must be positive")
    _require(
        gen.top_p == 1.0 and gen.top_k == 0,
        f"generation.top_p={gen.top_p} / top_k={gen.top_k}: truncated sampling is refused for training (the trainer"
        " scores the full softmax, so its log-probs and importance ratios would not be those of the sampled"
        " distribution); use top_p=1 and top_k=0 and tune the temperature instead",
    )
    _require(
        gen.backend != "vllm" or importlib.util.find_spec("vllm") is not None,
        "generation.backend=vllm needs the 'vllm' package (not installed); use embedded",
    )
    _require(
        gen.decode_attention in ("auto", *DECODE_KERNELS),
        f"generation.decode_attention={gen.decode_attention!r}: one of {', '.join(('auto', *DECODE_KERNELS))}",
    )
    _require(gen.flex_min_batch >= 1, "generation.flex_min_batch must be >= 1")
    _validate_generation_tp(config)
    impl = mcfg.transformer.get("transformer_impl")  # default: transformer_impl.default_transformer_impl()
    try:
        if impl is not None:
            check_transformer_impl(impl)
    except ValueError as err:
        raise GRPOConfigError(f"policy.megatron_cfg.transformer.{err}") from None
    _require(gen.temperature > 0, "generation.temperature must be > 0 for training (log-probs are tempered)")
    _require(gen.max_new_tokens >= 1, "generation.max_new_tokens must be >= 1")
    sources = [data.task, data.train_jsonl, data.hf_dataset]
    _require(
        sum(source is not None for source in sources) == 1,
        "set exactly one of data.task, data.train_jsonl and data.hf_dataset",
    )
    _require(
        not config.checkpointing.enabled or config.checkpointing.save_period >= 1,
        "checkpointing.save_period must be >= 1",
    )
    if mcfg.enabled:
        _validate_optimizer(mcfg)
        where = "policy.megatron_cfg.moe_router_bias_update_rate"
        rate = _number(mcfg.moe_router_bias_update_rate, where)
        _require(rate >= 0, f"{where}={rate:g} must be >= 0")
        lr = mcfg.optimizer.get("lr")
        _validate_schedule(mcfg.scheduler, None if lr is None else float(lr), "policy.megatron_cfg.scheduler")
    from hf_mcore_bridge.grpo.data.stop_tokens import stop_token_ids

    if Path(policy.model_path).exists():  # a missing model is refused when the run starts (`with_stop_token_ids`)
        stop_token_ids(config)
    from hf_mcore_bridge.grpo.data.rewards import RewardLoadError, resolve_reward_fn
    from hf_mcore_bridge.grpo.data.tasks import generate_records

    try:
        resolve_reward_fn(config.reward.name)
        if data.task is not None:
            generate_records(data.task, 0)
    except (RewardLoadError, ValueError) as err:
        raise GRPOConfigError(str(err)) from None
    if config.logger.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise GRPOConfigError("logger.tensorboard=true needs the 'tensorboard' package (pip install tensorboard)")
    _validate_data_and_logging(config)
    # last: the key names come from megatron-core's config classes, and importing it takes seconds; every mistake
    # the checks above can see is reported without it
    _validate_forwarded(mcfg)


def _validate_data_and_logging(config: GRPOConfig) -> None:
    from hf_mcore_bridge.grpo.data.chat import check_prompt_template
    from hf_mcore_bridge.grpo.data.processors import check_processor

    data, grpo, reward, logger = config.data, config.grpo, config.reward, config.logger
    try:
        if data.prompt_template is not None:
            check_prompt_template(data.prompt_template)
        if data.processor is not None:
            check_processor(data.processor)
    except ValueError as err:
        raise GRPOConfigError(str(err)) from None
    _require(data.task is None or data.processor is None, "data.processor applies to data files, not to data.task")
    _require(grpo.val_num_generations >= 1, "grpo.val_num_generations must be >= 1")
    _require(reward.num_workers is None or reward.num_workers >= 0, "reward.num_workers must be >= 0")
    _require(reward.timeout_s >= 0, "reward.timeout_s must be >= 0 (0: no limit)")
    _require(
        reward.name != "math" or importlib.util.find_spec("math_verify") is not None,
        "reward.name=math needs the 'math-verify' package (pip install 'math-verify[antlr4_13_2]'); or use"
        " reward.name=number (exact fractions, no symbolic check)",
    )
    _require(logger.num_val_samples_to_print >= 0, "logger.num_val_samples_to_print must be >= 0")
    for enabled, package, key in (
        (logger.wandb_enabled, "wandb", "wandb"),
        (logger.mlflow_enabled, "mlflow", "mlflow"),
    ):
        _require(
            not enabled or importlib.util.find_spec(package) is not None,
            f"logger.{key}_enabled=true needs the '{package}' package (pip install 'hf-mcore-bridge[loggers]')",
        )
