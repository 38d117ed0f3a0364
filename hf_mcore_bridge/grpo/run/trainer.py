"""The GRPO loop: `train_grpo(config) -> RunResult`.

    from hf_mcore_bridge.grpo.run.config import load_config
    from hf_mcore_bridge.grpo.run.trainer import train_grpo

    if __name__ == "__main__":  # ranks are spawned processes: guard script entry points
        result = train_grpo(load_config("examples/grpo_tiny.yaml", ["policy.model_path=/path/to/model"]))
        print(result.series("reward_mean"))

The parent process validates the config, converts an HF policy to a Megatron checkpoint if needed (an HF directory is
what the DTensor backend reads, so there a Megatron checkpoint is exported to HF instead), plans the run once
(`run.plan.RunPlan`: its dimensions, the refit path and the engine's config, carried to every rank by `PreparedRun`) and
starts one process per rank (`run.ranks.start_world`); under `torchrun` each process is a rank and global rank 0 does
the parent's part (`grpo.run.launch`, which also covers stopping on signals and the checks before a resume). The trained
policy is a `backends.base.TrainingBackend`: megatron-core (`policy.megatron_cfg`, described below) or the HF model
under FSDP2 (`policy.dtensor_cfg`, see `grpo.backends.dtensor.policy`); the loop is the same for both. On every rank,
each step:

1. rollouts: every rank draws the same `num_prompts_per_step` prompts; each engine replica (`grpo.run.generation`:
   `generation.tensor_parallel_size` ranks, the embedded engine or vLLM) samples `num_generations_per_prompt`
   completions for its share of them (whole prompts), scores them and computes their group advantages; the
   replicas' rollouts are all-gathered, so every rank holds the step's rollouts in prompt order. Each replica's
   first rank scores its share in reward worker processes (`grpo.data.scoring`), every sample handed to them as the
   engine finishes it (`reward.overlap`), so the step waits after generation only for the last samples' scores.
   With `grpo.dynamic_sampling` groups without reward variance are dropped and further rounds of new prompts
   generated the same way until the step has its groups; with `policy.router_replay` the rollouts carry the
   engine's expert choices, which the trainer's forwards replay;
2. log-probs: the megatron `GPTModel` computes the sampled tokens' log-probs (forward-only through
   `get_forward_backward_func`), and the reference policy's when the loss has a KL term; with one mini-batch
   (`grpo.num_minibatches: 1`) the "old" log-probs are the training forward's own, detached, and only the
   reference's forward (if any) runs here (`fuses_old_logprobs`; `grpo.separate_old_logprobs` or LoRA dropout
   forces the pass);
3. training: first the gate (`logprob_gate`): the rollouts' engine-vs-trainer `token_mult_prob_error` past
   `grpo.max_token_mult_prob_error` stops the run (or warns), the check that sees a wrong conversion; then the
   step's rollouts split into `num_minibatches` mini-batches, one optimizer step each;
4. refit: the weights are gathered over TP/PP and streamed through the mapping table into every rank's engine
   (each keeps its part); on every rank, every tensor its engine holds is checksummed against the part of the
   streamed tensor the trainer's side says that rank must hold (`refit.reference`, `_check_transfer`), and a
   fixed probe prompt is scored by the first replica's engine and the trainer and gated the same way
   (`probe_token_mult_prob_error`);
5. rank 0 logs the step's metrics (`metrics.jsonl`, progress line, TensorBoard if asked) and its rollouts
   (`rollouts.jsonl`).

The engine's first weights come through the same refit and checks before step 1, so a wrong conversion stops
the run at step 1 (a stopped step is neither logged nor saved).

The resolved config is saved as `grpo_config.yaml` in the log directory, and a PNG of reward and KL over the steps
(`training_curves.png`) is drawn there at the end.

Data parallelism: `cluster.gpus_per_node` ranks make `ranks / (TP x PP x CP)` replicas; every engine replica
generates its share of the prompts (above) and each data-parallel replica trains on every `dp`-th rollout of each
mini-batch (megatron-core's DDP averages the gradients; the loss is normalised by the global token count).
Gathering the rollouts keeps that split independent of which engine drew a rollout, so the rollouts and loss of a
run's first step are the same at any number of replicas. Each engine runs on its rank's device with the policy's
dtype. Prompts are rendered to token ids by `grpo.data.chat` (the chat template where there is one).
Simplifications: generation and training alternate (no overlap; only scoring overlaps generation); validation samples
`val_num_generations` a prompt (greedy when one) on the first replica, scored by the same reward
(`grpo.algorithm.pass_at_k`); policy+optimizer checkpoints every `save_period` steps
(`grpo.backends.megatron.checkpoint`) and resume from the newest one.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed

from hf_mcore_bridge.convert.config_bridge import from_megatron_args, padded_vocab
from hf_mcore_bridge.convert.layout import validate_layout
from hf_mcore_bridge.errors import BridgeError, RunStopped
from hf_mcore_bridge.grpo.algorithm.advantages import AdvantageConfig, group_advantages
from hf_mcore_bridge.grpo.algorithm.batching import MicroBatch, Rollout, make_microbatches, pack_microbatches
from hf_mcore_bridge.grpo.algorithm.dynamic_sampling import GroupPool
from hf_mcore_bridge.grpo.algorithm.losses import overlong_mask_from_finish_reasons, token_mult_prob_error
from hf_mcore_bridge.grpo.backends.base import TrainingBackend
from hf_mcore_bridge.grpo.data.scoring import ScoreResult
from hf_mcore_bridge.grpo.data.stop_tokens import model_assets_dir, with_stop_token_ids
from hf_mcore_bridge.grpo.errors import GRPOConfigError
from hf_mcore_bridge.grpo.refit.logprob_gate import check_logprob_agreement
from hf_mcore_bridge.grpo.refit.reference import ADAPTER_A, ADAPTER_B, EnginePartReference
from hf_mcore_bridge.grpo.refit.replay import RefitReplay, engine_weights_version
from hf_mcore_bridge.grpo.refit.stream import Checksums, PhaseTimes, buckets, mismatched, tensor_checksums
from hf_mcore_bridge.grpo.run.config import GRPOConfig
from hf_mcore_bridge.grpo.run.generation import (
    build_engine,
    engine_replicas,
    engine_tensor_names,
    prompt_share,
    readable_tensor,
)
from hf_mcore_bridge.grpo.run.metrics import MetricsLogger, read_metrics
from hf_mcore_bridge.grpo.run.plan import Backend, ParallelDims, RefitPath, RunPlan, parallel_dims, plan_run
from hf_mcore_bridge.grpo.run.plot import PLOT_FILE, plot_metrics
from hf_mcore_bridge.grpo.run.ranks import build_backend, start_world
from hf_mcore_bridge.models.spec import ModelSpec

__all__ = ["PreparedRun", "RunResult", "check_router_replay", "prepare_run", "train_grpo"]

ROLLOUTS_FILE = "rollouts.jsonl"
"""Every step's completions with their rewards, advantages and engine log-probs (rank 0 writes it)."""


@dataclass(frozen=True)
class RunResult:
    """What a run did: one metrics record per step (as in `metrics.jsonl`)."""

    steps: int
    """Steps completed."""
    metrics: list[dict[str, float]]
    """Per step: `reward_mean`, `kl_ref`, `clip_fraction`, `token_mult_prob_error`, timings, ..."""
    log_dir: Path
    """Where `metrics.jsonl` is."""

    def series(self, key: str) -> list[float]:
        """One metric over the steps (NaN where a step lacks it)."""
        return [float(m.get(key, float("nan"))) for m in self.metrics]


@dataclass(frozen=True)
class PreparedRun:
    """What the ranks need, resolved in the parent before any process starts."""

    checkpoint_dir: Path
    """What the policy starts from: a `torch_dist` checkpoint (iteration directory) for megatron-core, an HF
    directory for DTensor."""
    model_cfg: ModelSpec
    hf_config: dict[str, Any]
    """The engine's HF config."""
    tokenizer_file: Path
    padded_vocab: int
    log_dir: Path
    plan: RunPlan
    """The run's dimensions, refit path and engine config (`run.plan`), computed once here."""
    source_hf_dir: Path | None = None
    """The HF directory the policy was converted from (or, for DTensor, is): the initial refit's reference
    (`grpo.refit.source_check`); None where the run starts from a Megatron checkpoint."""


def _is_hf_dir(path: Path) -> bool:
    return (path / "config.json").exists() and any(path.glob("*.safetensors"))


def _tokenizer_file(config: GRPOConfig, candidates: list[Path]) -> Path:
    given = config.policy.tokenizer
    paths = [Path(given)] if given else candidates
    for path in paths:
        file = path / "tokenizer.json" if path.is_dir() else path
        if file.is_file():
            return file
    raise BridgeError(f"no tokenizer.json found (looked at {[str(p) for p in paths]}); set policy.tokenizer")


def prepare_run(config: GRPOConfig, dims: ParallelDims | None = None) -> PreparedRun:
    """Resolve the policy checkpoint (converting an HF directory), the engine's HF config and the tokenizer, and
    plan the run (`run.plan`) at `dims` (None: `parallel_dims(config)`)."""
    from hf_mcore_bridge.checkpoint.megatron_dirs import hf_assets_dir, read_common, resolve_checkpoint
    from hf_mcore_bridge.convert.to_mcore import convert_hf_to_mcore
    from hf_mcore_bridge.grpo.data.chat import check_rendering

    log_dir = Path(config.logger.log_dir)
    # the tokenizer (the HF directory's, or the HF assets a Megatron checkpoint keeps) is found before the policy
    # is converted either way or a log directory is made, so that a missing one costs nothing
    found_assets = model_assets_dir(Path(config.policy.model_path))
    tokenizer_file = _tokenizer_file(config, [found_assets] if found_assets else [])
    check_rendering(config.data, tokenizer_file)  # so is a chat template that cannot render the prompts
    dims = dims or parallel_dims(config)
    if dims.backend is Backend.DTENSOR:
        log_dir.mkdir(parents=True, exist_ok=True)
        return _prepare_hf_run(config, dims, log_dir, tokenizer_file)
    layout = dims.layout
    source = Path(config.policy.model_path)
    hf_dir: Path | None = None
    if _is_hf_dir(source):
        hf_dir = source
        source = log_dir / "initial_policy_mcore"
    log_dir.mkdir(parents=True, exist_ok=True)
    if hf_dir is not None:
        converted = convert_hf_to_mcore(
            hf_dir, source, layout=layout, dtype=config.policy.dtype, overwrite=True, show_progress=False
        )
        for note in converted.notes:  # e.g. multi-token-prediction layers dropped (`convert.mtp`)
            print(f"note: {note}", flush=True)
    root, checkpoint_dir = resolve_checkpoint(source)
    # multi-token-prediction layers are not trained (megatron-core computes them only with labels, for their own
    # loss): the policy is built, refit, saved and exported without them
    model_cfg = dataclasses.replace(from_megatron_args(read_common(checkpoint_dir)["args"]), mtp_layers=0)
    validate_layout(layout, model_cfg)
    check_router_replay(config, model_cfg)
    if model_cfg.moe is not None and layout.tp > 1 and not config.policy.megatron_cfg.sequence_parallel:
        raise GRPOConfigError(
            "policy.megatron_cfg.sequence_parallel must be true for a mixture-of-experts policy at"
            " tensor_model_parallel_size > 1 (megatron-core trains MoE layers under TP only with it)"
        )
    if model_cfg.moe is not None and model_cfg.moe.expert_mlp_bias and layout.tp > 1 and layout.ep == 1:
        raise GRPOConfigError(
            "policy.megatron_cfg.expert_model_parallel_size=1 at tensor_model_parallel_size > 1 is refused for biased"
            " experts: megatron-core's expert layers then go through the sequence-parallel reduce-scatter of a"
            " one-rank expert group and add their bias in place on its output (an autograd error); use"
            " expert_model_parallel_size >= 2"
        )
    assets = hf_dir or hf_assets_dir(root, checkpoint_dir)
    if assets is not None and (assets / "config.json").exists():
        hf_config = json.loads((assets / "config.json").read_text())
    else:
        hf_config = model_cfg.to_hf()
    divisible_by = config.policy.megatron_cfg.make_vocab_size_divisible_by
    return PreparedRun(
        checkpoint_dir=checkpoint_dir,
        model_cfg=model_cfg,
        hf_config=hf_config,
        tokenizer_file=tokenizer_file,
        padded_vocab=padded_vocab(model_cfg, layout, divisible_by),
        log_dir=log_dir,
        plan=plan_run(config, dims, model_cfg),
        source_hf_dir=hf_dir,
    )


def check_router_replay(config: GRPOConfig, model_cfg: ModelSpec) -> None:
    """Refuse routing replay (`policy.router_replay`) for a model without routed experts."""
    if config.policy.router_replay.enabled and model_cfg.moe is None:
        raise GRPOConfigError(
            f"policy.router_replay.enabled=true needs a mixture-of-experts model; {model_cfg.architecture} has no"
            " routed experts"
        )


def _prepare_hf_run(config: GRPOConfig, dims: ParallelDims, log_dir: Path, tokenizer_file: Path) -> PreparedRun:
    """The DTensor backend's start: an HF directory (a Megatron checkpoint is exported to one first); the
    tokenizer was found beforehand (in the HF directory, or in the checkpoint's HF assets the export copies)."""
    from hf_mcore_bridge.convert import config_bridge
    from hf_mcore_bridge.grpo.backends.dtensor.policy import hf_policy_dir

    hf_dir = hf_policy_dir(Path(config.policy.model_path), log_dir)
    hf_config = json.loads((hf_dir / "config.json").read_text())
    # the refit's reference (`refit.reference`) is cut by the conversion table: the run takes what conversion takes
    model_cfg = config_bridge.megatron_spec(hf_config)
    return PreparedRun(
        checkpoint_dir=hf_dir,
        model_cfg=model_cfg,
        hf_config=hf_config,
        tokenizer_file=tokenizer_file,
        padded_vocab=model_cfg.vocab_size,
        log_dir=log_dir,
        plan=plan_run(config, dims, model_cfg),
        source_hf_dir=hf_dir,
    )


def train_grpo(config: GRPOConfig) -> RunResult:
    """Run GRPO as configured; returns the per-step metrics. Raises `BridgeError` if a rank fails, `RunStopped`
    (with a message naming the last checkpoint) if SIGINT / SIGTERM stopped the spawned ranks.

    Under an env:// launcher (`torchrun`) this process is one rank of the launcher's world (see `grpo.run.launch`);
    the metrics returned are then complete on global rank 0, which writes them."""
    from hf_mcore_bridge.grpo.data.chat import with_template_stop_ids
    from hf_mcore_bridge.grpo.run import launch
    from hf_mcore_bridge.megatron.world import join_launched_world, launched_world, reports_here, stop_on_signals

    config.validate()
    explicit_stops = config.generation.stop_token_ids is not None
    config = with_stop_token_ids(config)
    dims = parallel_dims(config)
    launch.check_start(config, dims)

    def prepare() -> PreparedRun:
        return _prepare_parent(config, dims, explicit_stops)

    def with_template_stops(prepared: PreparedRun) -> GRPOConfig:
        # stop tokens the user listed are taken as given; else the chat template's end of turn joins the EOS ids
        return with_template_stop_ids(config, prepared.tokenizer_file, add_end_of_turn=not explicit_stops)

    if launched_world() is None:
        try:
            with stop_on_signals():  # also while preparing: a launcher started in the background ignores SIGINT
                prepared = prepare()
                start_world(prepared.plan.dims, _train_rank, with_template_stops(prepared), prepared)
        except RunStopped as stopped:
            log_dir = Path(config.logger.log_dir)
            raise RunStopped(stopped.signum, launch.stopped_message(config, log_dir, stopped)) from None
    else:
        join_launched_world()
        prepared = launch.prepare_once(prepare)
        shared = {"logger.log_dir": prepared.log_dir}
        if config.checkpointing.enabled:
            shared["checkpointing.checkpoint_dir"] = Path(config.checkpointing.checkpoint_dir)
        launch.check_shared_storage(shared)
        start_world(prepared.plan.dims, _train_rank, with_template_stops(prepared), prepared)
    metrics = read_metrics(prepared.log_dir)
    if metrics and reports_here():
        plot_metrics(metrics, prepared.log_dir / PLOT_FILE)
    return RunResult(steps=len(metrics), metrics=metrics, log_dir=prepared.log_dir)


def _prepare_parent(config: GRPOConfig, dims: ParallelDims, explicit_stops: bool) -> PreparedRun:
    """What happens once before the ranks start: check a resumed checkpoint against the policy, prepare and plan
    the run at `dims` (and say which step the run resumes from), trim the metrics of steps about to be rerun, save
    the config (with the chat template's end-of-turn stop token unless `explicit_stops`)."""
    from hf_mcore_bridge.grpo.data.chat import with_template_stop_ids
    from hf_mcore_bridge.grpo.run.launch import check_resumable

    resume = _resume_step(config)
    if resume is not None:
        check_resumable(config, resume)
    prepared = prepare_run(config, dims)
    if resume is not None:
        print(f"resuming from step {resume} ({config.checkpointing.checkpoint_dir})", flush=True)
    config = with_template_stop_ids(config, prepared.tokenizer_file, add_end_of_turn=not explicit_stops)
    _trim_metrics(prepared.log_dir, resume or 0)
    _save_config(config, prepared.log_dir)
    return prepared


def _save_config(config: GRPOConfig, log_dir: Path) -> None:
    """The resolved config as YAML beside the metrics (the model card of an export quotes it)."""
    import yaml

    from hf_mcore_bridge.grpo.run.export import CONFIG_FILE

    (log_dir / CONFIG_FILE).write_text(yaml.safe_dump(_plain_config(config), sort_keys=False))


def _plain_config(config: GRPOConfig) -> dict[str, Any]:
    """The config as plain JSON types (the saved YAML, the trackers' run parameters)."""
    return json.loads(json.dumps(dataclasses.asdict(config), default=str))


def _resume_step(config: GRPOConfig) -> int | None:
    """The step a run continues after (None: a fresh start)."""
    from hf_mcore_bridge.grpo.backends.megatron.checkpoint import latest_step

    ckpt = config.checkpointing
    return latest_step(Path(ckpt.checkpoint_dir)) if ckpt.enabled and ckpt.resume else None


def _trim_metrics(log_dir: Path, keep_through: int) -> None:
    """Drop metrics and rollouts of steps after `keep_through` (all for a fresh start): they are about to be rerun."""
    for name in ("metrics.jsonl", ROLLOUTS_FILE):
        path = log_dir / name
        lines = path.read_text().splitlines() if path.exists() else []
        kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= keep_through]
        path.write_text("".join(line + "\n" for line in kept))


def _log_rollouts(log_dir: Path, step: int, rollouts: list[Rollout]) -> None:
    """Append the step's rollouts to `rollouts.jsonl`, one JSON object per completion."""
    with (log_dir / ROLLOUTS_FILE).open("a", encoding="utf-8") as handle:
        for rollout in rollouts:  # without the routed experts (routing replay): tensors, and large
            fields = {
                f.name: getattr(rollout, f.name) for f in dataclasses.fields(rollout) if f.name != "routed_experts"
            }
            handle.write(json.dumps({"step": step, **fields}) + "\n")


# Inside a rank ---------------------------------------------------------------------------------------------------


class _RankContext:
    """This rank's engine (its part of its replica's engine), tokenizer and prompts; rank 0's logger (None
    elsewhere)."""

    def __init__(self, config: GRPOConfig, prepared: PreparedRun, policy: TrainingBackend) -> None:
        import torch.distributed as dist

        self.config, self.prepared = config, prepared
        self.is_rank0 = dist.get_rank() == 0
        self.plan = prepared.plan
        self.replicas = engine_replicas(self.plan.dims.engine_tp, policy.tp_group)
        self.plan.check_replicas(self.replicas)
        self.engine: Any = None
        self.prompts: Any = None
        self.val_records: list[Any] = []
        self.logger: MetricsLogger | None = None
        self.refit_replay = RefitReplay()
        self.vllm = config.generation.backend == "vllm"
        self.refit_shard_local = False
        """Whether the last refit streamed each rank's own shards (`TrainingBackend.shard_local_weights`)."""
        self.refit_names: list[str] | None = None
        """Every HF name the policy streams (`hf_names`), listed at the first refit."""
        self.adapter_refit = config.policy.lora.refits_adapters
        """LoRA adapters streamed and applied by the engine after the first refit (`LoraConfig.refits_adapters`)."""
        self.trained_names: list[str] | None = None
        """What a refit after the initial one streams (`trained_names`: LoRA's adapted projections; None: every
        tensor), listed at the first refit."""
        self.refit_bytes = 0
        """Bytes of the tensors the last eager refit streamed on this rank (as streamed: full or shard-local)."""
        self.engine_dtype = self.plan.engine.dtype
        """The engine's weights' dtype: streamed tensors are checksummed in it (float32 where the table says)."""
        self._set_up()
        self.refit_reference = EnginePartReference(
            prepared.model_cfg, *((1, 0) if self.vllm else (self.replicas.tp, self.replicas.tp_rank))
        )
        """What this rank's engine must hold of each streamed tensor, from the trainer's side (`refit.reference`;
        vLLM's tensors are not readable, so nothing is compared with its parts: the streamed tensors stand in)."""

    def _set_up(self) -> None:
        from tokenizers import Tokenizer

        from hf_mcore_bridge.grpo.data.chat import PromptRenderer, load_hf_tokenizer
        from hf_mcore_bridge.grpo.data.prompts import PromptIterator
        from hf_mcore_bridge.grpo.data.rewards import resolve_reward_fn
        from hf_mcore_bridge.grpo.data.scoring import RewardScorer
        from hf_mcore_bridge.grpo.run.loggers import build_trackers

        config, gen = self.config, self.config.generation
        self.tokenizer = Tokenizer.from_file(str(self.prepared.tokenizer_file))
        self.engine = build_engine(
            gen.backend,
            self.prepared.hf_config,
            self.plan.engine_on(str(_device())),
            self.tokenizer,
            self.prepared.log_dir,
            self.replicas.group,
        )
        train, self.val_records = _records(config)
        self.prompts = PromptIterator(train, seed=config.grpo.seed, shuffle=config.data.shuffle)
        self.reward_fn = resolve_reward_fn(config.reward.name)
        self.scorer = RewardScorer(self.reward_fn, config.reward.workers, config.reward.timeout_s)
        self.renderer = PromptRenderer.from_config(config.data, load_hf_tokenizer(self.prepared.tokenizer_file))
        self.probe_prompt = config.grpo.probe_prompt or self.renderer.token_ids(train[0]["prompt"])
        if not self.is_rank0:
            return
        self.logger = MetricsLogger(
            self.prepared.log_dir,
            config.logger.tensorboard,
            config.logger.print_progress,
            total_steps=config.grpo.max_num_steps,
            trackers=build_trackers(config.logger, self.prepared.log_dir, _plain_config(config)),
        )


def _device() -> torch.device:
    from hf_mcore_bridge.megatron.world import device

    return device()


def _records(config: GRPOConfig) -> tuple[list[Any], list[Any]]:
    from hf_mcore_bridge.grpo.data.prompts import load_train_val

    return load_train_val(config.data, config.grpo.val_num_prompts, config.grpo.seed)


def _broadcast(value: Any) -> Any:
    import torch.distributed as dist

    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def _sampling_params(config: GRPOConfig, n: int, seed: int, greedy: bool = False) -> Any:
    from hf_mcore_bridge.engine import SamplingParams

    gen = config.generation
    return SamplingParams(
        n=n,
        temperature=0.0 if greedy else gen.temperature,
        top_p=gen.top_p,
        top_k=gen.top_k,
        max_tokens=gen.max_new_tokens,
        stop_token_ids=gen.stop_token_ids,
        seed=seed,
    )


def _generate_rollouts(ctx: _RankContext, step: int) -> tuple[list[Rollout], dict[str, float]]:
    """The step's rollouts (`_generation_round`), and their statistics over every rollout generated. With
    `grpo.dynamic_sampling` groups whose rewards are all equal are dropped and further rounds of new prompts
    generated until `num_prompts_per_step` groups remain (`algorithm.dynamic_sampling.GroupPool`; every rank
    gathers every round, so every rank selects the same groups), logged as `dropped_groups`, `generation_rounds` and
    `filled_groups`. Also returns each replica's generation seconds (`generation_replica{r}_s` where there are
    several)."""
    config = ctx.config
    sampling = config.grpo.dynamic_sampling
    pool = GroupPool(config.grpo.num_prompts_per_step, config.grpo.num_generations_per_prompt)
    generated: list[Rollout] = []
    parts: list[list[tuple[list[Rollout], float, int, float]]] = []
    for round_index in range(sampling.max_rounds if sampling.enabled else 1):
        rollouts, gathered = _generation_round(ctx, step, round_index)
        generated += rollouts
        parts.append(gathered)
        pool.add(rollouts)
        if pool.full:
            break
    stats = _rollout_stats(ctx, generated, parts)
    if not sampling.enabled:
        return generated, stats
    rollouts, filled = pool.batch()
    return rollouts, stats | {
        "dropped_groups": float(len(pool.dropped)),
        "generation_rounds": float(pool.rounds),
        "filled_groups": float(filled),
        "kept_reward_mean": sum(r.reward for r in rollouts) / len(rollouts),
    }


def _generation_round(
    ctx: _RankContext, step: int, round_index: int
) -> tuple[list[Rollout], list[tuple[list[Rollout], float, int, float]]]:
    """One round of `num_prompts_per_step` new prompts: every engine replica samples, scores and computes the
    advantages of its share (whole groups, `prompt_share`); the replicas' rollouts are then all-gathered in prompt
    order (token ids: small), so every rank holds the round's rollouts as one engine would have made them. A prompt's
    samples are seeded by its index among the step's rounds. Returns the rollouts and, per replica, its rollouts,
    generation seconds, reward timeouts and seconds waited for scores."""
    import torch.distributed as dist

    config, replicas = ctx.config, ctx.replicas
    records = ctx.prompts.next_batch(config.grpo.num_prompts_per_step)  # the same draw on every rank
    first, end = prompt_share(len(records), replicas.size, replicas.replica)
    offset = round_index * config.grpo.num_prompts_per_step
    started = time.perf_counter()
    mine, timeouts, wait_s = (
        _replica_rollouts(ctx, step, records[first:end], offset + first) if end > first else ([], 0, 0.0)
    )
    seconds = time.perf_counter() - started
    parts: list[tuple[list[Rollout], float, int, float] | None] = [(mine, seconds, timeouts, wait_s)]
    if dist.get_world_size() > 1:  # one rank (one GPU): nothing to gather
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, (mine, seconds, timeouts, wait_s) if replicas.tp_rank == 0 else None)
    gathered = [part for part in parts if part is not None]  # one per replica, in replica (= prompt) order
    return [rollout for part, *_ in gathered for rollout in part], gathered


def _rollout_stats(
    ctx: _RankContext, rollouts: list[Rollout], rounds: list[list[tuple[list[Rollout], float, int, float]]]
) -> dict[str, float]:
    """Reward, length and scoring statistics of every rollout generated in the step (`rounds`: per round, per
    replica, as `_generation_round` returns them), the replicas' times summed over the rounds."""
    rewards = torch.tensor([r.reward for r in rollouts])
    lengths = torch.tensor([len(r.completion_ids) for r in rollouts], dtype=torch.float32)
    per_round = [part for gathered in rounds for part in gathered]
    stats = {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()),
        "completion_len_mean": float(lengths.mean()),
        "truncated_fraction": sum(r.truncated for r in rollouts) / len(rollouts),
        "reward_timeouts": float(sum(part[2] for part in per_round)),
        # the slowest replica's wait for its last scores after its engine returned (the gather waits for it)
        "reward_wait_s": sum(max(part[3] for part in gathered) for gathered in rounds),
        "generation_replicas": float(ctx.replicas.size),
    }
    if ctx.replicas.size > 1:
        stats |= {
            f"generation_replica{i}_s": sum(gathered[i][1] for gathered in rounds) for i in range(ctx.replicas.size)
        }
    return stats


def _replica_rollouts(ctx: _RankContext, step: int, records: list[Any], first: int) -> tuple[list[Rollout], int, float]:
    """This replica's rollouts of `records`, prompts `first...` of the step (counted over its generation rounds):
    each prompt's samples are seeded by (seed, step, its index in the step), whichever replica draws them; how many
    rewards ran out of time; and the seconds waited for scores after generation (`_generate_scored`). On a
    replica's other tensor-parallel ranks (their rollouts are not gathered) nothing is scored and none are
    returned."""
    config, group = ctx.config, ctx.config.grpo.num_generations_per_prompt
    prompts = [ctx.renderer.token_ids(r["prompt"]) for r in records]
    answers = [r["answer"] for r in records for _ in range(group)]
    params = _sampling_params(config, group, _seed(config, step))
    outputs, scored, wait_s = _generate_scored(ctx, prompts, params, answers, first_index=first)
    if scored is None:
        return [], 0, 0.0
    samples = [(out.prompt_token_ids, s) for out in outputs for s in out.samples]
    rewards = torch.tensor(scored.rewards)
    advantage_config = AdvantageConfig(
        normalize_std=config.grpo.normalize_rewards,
        leave_one_out=config.grpo.leave_one_out,
        leave_one_out_std=config.grpo.leave_one_out_std,
    )
    advantages = group_advantages(rewards, group, advantage_config)
    truncated = (overlong_mask_from_finish_reasons([s.finish_reason for _, s in samples]) == 0).tolist()
    rollouts = [
        Rollout(tuple(prompt), tuple(s.token_ids), tuple(s.logprobs or ()), float(r), float(a), cut, s.routed_experts)
        for (prompt, s), r, a, cut in zip(samples, rewards.tolist(), advantages.tolist(), truncated, strict=True)
    ]
    return rollouts, scored.timeouts, wait_s


def _generate_scored(
    ctx: _RankContext, prompts: list[list[int]], params: Any, answers: list[str], first_index: int | None = None
) -> tuple[list[Any], ScoreResult | None, float]:
    """The engine's outputs of `prompts` (`params.n` samples each; `first_index` passed on when given), their
    samples' scores in output order against `answers` (one per sample), and the seconds spent waiting for scores
    after the engine returned. With `reward.overlap` every sample goes to the reward workers the moment the engine
    finishes it (`Engine.generate`'s `on_sample`), so that wait is for the last samples only; without, the whole
    batch is scored after generation. Only a replica's first tensor-parallel rank scores (its rollouts are the ones
    gathered): elsewhere the scores are None."""
    where = {} if first_index is None else {"first_index": first_index}
    if ctx.replicas.tp_rank != 0:
        return ctx.engine.generate(prompts, params, **where), None, 0.0
    if not ctx.config.reward.overlap:
        outputs = ctx.engine.generate(prompts, params, **where)
        started = time.perf_counter()
        scored = ctx.scorer.score([s.text or "" for out in outputs for s in out.samples], answers)
        return outputs, scored, time.perf_counter() - started
    with ctx.scorer.start(len(answers)) as batch:

        def hand_over(i: int, sample: Any) -> None:  # prompt i's sample: flat index i * n + its index
            index = i * params.n + sample.index
            batch.submit(index, sample.text or "", answers[index])

        outputs = ctx.engine.generate(prompts, params, on_sample=hand_over, **where)
        started = time.perf_counter()
        scored = batch.result()
    return outputs, scored, time.perf_counter() - started


def _seed(config: GRPOConfig, step: int) -> int:
    return config.grpo.seed * 1_000_003 + step


def _microbatches(config: GRPOConfig, rollouts: list[Rollout]) -> list[MicroBatch]:
    mcfg, mask_truncated = config.policy.backend_cfg, config.loss_fn.overlong_filtering
    if mcfg.sequence_packing:
        return pack_microbatches(rollouts, mcfg.max_tokens_per_microbatch, mask_truncated)
    return make_microbatches(rollouts, mcfg.micro_batch_size, mask_truncated)


def _minibatches(policy: TrainingBackend, config: GRPOConfig, rollouts: list[Rollout]) -> list[list[MicroBatch]]:
    """The step's mini-batches, each as this data-parallel rank's micro-batches (every `dp`-th rollout)."""
    size = len(rollouts) // config.grpo.num_minibatches
    dp, rank = policy.dp_size, policy.dp_rank
    return [_microbatches(config, rollouts[i : i + size][rank::dp]) for i in range(0, len(rollouts), size)]


def _flat_mult_error(
    policy: TrainingBackend, batches: list[MicroBatch], logprobs: list[torch.Tensor], over_dp: bool = True
) -> float:
    """`token_mult_prob_error` over all the tokens of `batches` (and of the other data-parallel ranks' batches)."""
    trainer = torch.cat([lp.flatten() for lp in logprobs])
    engine = torch.cat([b.engine_logprobs.flatten() for b in batches])
    mask = torch.cat([b.mask.flatten() for b in batches])
    count = mask.sum().double()
    total = torch.stack([token_mult_prob_error(trainer[None], engine[None], mask[None]).double() * count, count])
    if over_dp and policy.dp_size > 1:
        total = total.to(_device())  # NCCL reduces device tensors only
        torch.distributed.all_reduce(total, group=policy.dp_group)
    return float(total[0] / total[1].clamp(min=1))


def _train_step(
    policy: TrainingBackend, config: GRPOConfig, rollouts: list[Rollout], gate: Callable[[float], None] | None = None
) -> dict[str, float]:
    """Log-probs, then one optimizer step per mini-batch; `gate` sees the rollouts' `token_mult_prob_error` before
    any optimizer step (it may stop the run before any update). With one mini-batch (`fuses_old_logprobs`) the old
    log-probs are the training forward's own, detached, and no separate forward computes them."""
    temperature = config.generation.temperature
    minibatches = _minibatches(policy, config, rollouts)
    flat = [b for mini in minibatches for b in mini]
    fused = fuses_old_logprobs(config)
    started = time.perf_counter()
    old = None if fused else policy.compute_logprobs(flat, temperature)
    ref = policy.compute_logprobs(flat, temperature, reference=True) if policy.has_reference else None
    logprobs_s = time.perf_counter() - started
    stats = {"logprobs_s": logprobs_s}
    if old is not None:
        stats["token_mult_prob_error"] = _flat_mult_error(policy, flat, old)
        if gate is not None:
            gate(stats["token_mult_prob_error"])

    def before_step(metrics: dict[str, float]) -> None:  # the training forward's log-probs, before its update
        if old is None and gate is not None:
            gate(metrics["token_mult_prob_error"])

    started = time.perf_counter()
    per_minibatch, offset = [], 0
    for mini in minibatches:
        part = slice(offset, offset + len(mini))
        per_minibatch.append(
            policy.train_minibatch(
                mini,
                None if old is None else old[part],
                None if ref is None else ref[part],
                config.loss_fn,
                temperature,
                before_step=before_step,
            )
        )
        offset += len(mini)
    stats["train_s"] = time.perf_counter() - started
    if old is None:  # the one mini-batch's: its trainer log-probs are those of the policy that sampled
        stats["token_mult_prob_error"] = per_minibatch[0]["token_mult_prob_error"]
    first = per_minibatch[0]  # the on-policy mini-batch: its KL and clip fraction are the step's invariants
    means = {k: sum(m[k] for m in per_minibatch) / len(per_minibatch) for k in first if k != "token_mult_prob_error"}
    # `loss` and `grad_norm` above are means over the mini-batches; with several, each one's is logged as well
    each = {
        f"minibatch{i}_{k}": m[k] for i, m in enumerate(per_minibatch) if len(per_minibatch) > 1 for k in _PER_MINIBATCH
    }
    return (
        stats
        | means
        | each
        | {"first_minibatch_clip_fraction": first["clip_fraction"], "first_minibatch_approx_kl": first["approx_kl"]}
    )


def fuses_old_logprobs(config: GRPOConfig) -> bool:
    """Whether a step takes its old log-probs from its training forward: with one mini-batch the policy that
    sampled is the policy at the start of the only update, so `exp(lp - lp.detach())` is the ratio (1 in value,
    the surrogate's gradient) and a separate forward pass would compute the same numbers again. With LoRA dropout
    (`policy.lora.dropout` > 0) never: the training forward drops adapter inputs, the sampling policy did not, so
    the old log-probs come from a forward in eval mode (as with `grpo.separate_old_logprobs`)."""
    lora = config.policy.lora
    dropout = lora.enabled and lora.dropout > 0  # the training forward drops: not the policy that sampled
    return config.grpo.num_minibatches == 1 and not config.grpo.separate_old_logprobs and not dropout


ADAPTER_DIR = "lora_adapter"
"""Where a LoRA run writes its trained adapters (a PEFT directory), under `logger.log_dir`."""

_PER_MINIBATCH = ("loss", "grad_norm")
"""Metrics logged for each mini-batch (`minibatch{i}_loss`, ...) when a step has several."""


def _refit(ctx: _RankContext, policy: TrainingBackend, step: int, initial: bool = False) -> dict[str, float]:
    """Stream the policy into every rank's engine (or replay the recorded refit, `refit.replay`), then check on
    every rank that its engine holds every streamed tensor (its part of it) exactly as streamed
    (`_check_transfer`). `step`: the step the weights are from (0 for a fresh start); `initial`: the engine's
    first weights (every tensor, also when a resumed run starts at a later step). Rank 0 returns the metrics
    (its own phases)."""
    started = time.perf_counter()
    if ctx.refit_names is None:  # the names do not change during a run: listed once (collective, every rank here)
        ctx.refit_names = policy.hf_names()
        # LoRA: the adapted projections' merged weights; where the engine applies the adapters
        # (`LoraConfig.refits_adapters`), the adapters themselves, named below from the first refit's stream
        ctx.trained_names = None if ctx.adapter_refit else policy.trained_names()
    # after the initial refit, only what training changes (LoRA: the adapted projections, merged)
    only = None if initial else ctx.trained_names
    times = PhaseTimes()
    sources = policy.refit_sources()
    sent, mode = ctx.refit_replay.run(
        lambda phase_times: _stream_into_engine(ctx, policy, sources, phase_times, only),
        sources,
        engine_weights_version(ctx.engine),
        times,
    )
    if ctx.adapter_refit and ctx.trained_names is None:  # the adapters the first (whole) refit streamed
        ctx.trained_names = [name for name in sent.names if name.endswith((ADAPTER_A, ADAPTER_B))]
    if torch.cuda.is_available():  # the copies are asynchronous: time them to their end
        torch.cuda.synchronize()
    refit_s = time.perf_counter() - started
    phases = times.totals()
    started = time.perf_counter()
    compared = _check_transfer(ctx, policy, sent, step, only)  # every rank checks its own engine
    if not ctx.is_rank0:
        return {}
    return {
        "refit_s": refit_s,
        "refit_gather_s": phases["gather"],  # TP / EP all-gathers (DTensor: full_tensor)
        "refit_transfer_s": phases["transfer"],  # the pipeline stages' tensors exchanged (PP > 1)
        # the rest of producing the stream: the table's to_hf and the streamed tensors' checksums
        "refit_convert_s": max(0.0, phases["produce"] - phases["gather"] - phases["transfer"]),
        "refit_load_s": phases["load"],  # the engine's load_weights
        "refit_check_s": time.perf_counter() - started,  # the engine's tensors checksummed and compared
        "refit_checked_tensors": float(compared),
        "refit_replayed": float(mode != "eager"),  # 1: a replay of the recorded refit (phases not timed)
        # the path: 1 each rank its own shards into its engine's (engine TP = trainer TP, PP 1), 0 full tensors
        "refit_shard_local": float(ctx.refit_shard_local),
        "refit_gathers": float(times.counts["gather"]),  # all-gathered tensors (TP / EP / DTensor) on rank 0
        "refit_bytes": float(ctx.refit_bytes),  # bytes of the tensors streamed on rank 0 (as streamed, before cuts)
    }


def _stream_into_engine(
    ctx: _RankContext,
    policy: TrainingBackend,
    sources: list[torch.Tensor] | None,
    times: PhaseTimes,
    only: list[str] | None = None,
) -> Checksums:
    """One eager refit on this rank: the policy's HF tensors through the engine's `load_weights`, bucket by bucket;
    returns the checksums of every tensor as streamed (the part this rank's engine must hold, cut on the trainer's
    side by `ctx.refit_reference`, never by the engine's own slicing; in the engine's dtype) and of the `sources`
    it read. `only`: stream those tensors alone (the others stay as the engine holds them)."""
    names: list[str] = []
    ctx.refit_bytes = 0
    sums: list[torch.Tensor] = []
    # the planned path: each rank its own shards into its engine's part (no all-gather but the vocabulary's); else
    # full tensors, each engine rank keeping its part
    if ctx.adapter_refit:  # the engine applies the adapters: the base weights unmerged (first refit), the adapters
        stream = _adapter_stream(ctx, policy, times, initial=only is None)
    else:
        stream = policy.shard_local_weights(times, only) if ctx.plan.refit is RefitPath.SHARD_LOCAL else None
        ctx.refit_shard_local = stream is not None
    groups = buckets(stream or policy.hf_weights(times, only), ctx.config.policy.refit_bucket_mb << 20)
    while True:
        with times.phase("produce"):  # gathering, transferring, converting and checksumming up to a bucket
            bucket = next(groups, None)
            if bucket is not None:
                names.extend(name for name, _ in bucket)
                ctx.refit_bytes += sum(tensor.numel() * tensor.element_size() for _, tensor in bucket)
                reference = ctx.refit_reference
                parts = [
                    reference.part(name, tensor, ctx.refit_shard_local).to(reference.dtype(name, ctx.engine_dtype))
                    for name, tensor in bucket
                ]
                sums.append(tensor_checksums(parts))
        if bucket is None:
            break
        with times.phase("load"):
            if ctx.refit_shard_local:
                ctx.engine.load_weights(bucket, parts=True)
            else:
                ctx.engine.load_weights(bucket)
    values = torch.cat(sums) if sums else torch.zeros((0, 2), dtype=torch.int64)
    return Checksums(tuple(names), values, None if sources is None else tensor_checksums(sources))


def _adapter_stream(
    ctx: _RankContext, policy: TrainingBackend, times: PhaseTimes, initial: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """A LoRA run's refit into an engine that applies the adapters (`engine.lora`): at the first refit every base
    weight as the checkpoint holds it (unmerged; shard-local where planned) and then the adapters; afterwards the
    adapters alone (whole: the engine cuts its parts, the reference cuts them alike)."""
    base = None
    if initial:
        local = ctx.plan.refit is RefitPath.SHARD_LOCAL
        base = policy.shard_local_weights(times, merged=False) if local else None
        ctx.refit_shard_local = base is not None
        base = base or policy.hf_weights(times, merged=False)
    adapters = policy.adapter_weights(times)
    return itertools.chain(base or (), adapters)


def _check_transfer(
    ctx: _RankContext, policy: TrainingBackend, sent: Checksums, step: int, only: list[str] | None = None
) -> int:
    """Transfer integrity (on every rank, of its own engine), after every refit, eager or replayed: every HF tensor of
    the table was streamed once; every tensor the engine holds (all of them, where it exposes them: the embedded engine)
    has the checksum of the part of the streamed tensor this engine rank must hold, as the trainer's side works it out
    (`refit.reference`: from the full tensor by the mapping table's parallel styles and megatron-core's head and
    query-group split, or the trainer's own shard in a shard-local refit; never through the engine's own slicing); and
    the trainer tensors a recordable refit read have the checksums they have now (a replay that read stale storage).
    Raises `BridgeError` (one line); returns the number of engine tensors compared. Catches lost, duplicated,
    truncated, permuted, stale or misplaced copies, and an engine rank that keeps the wrong part (a shifted head, a KV
    head on the wrong rank, a wrong vocabulary block); NOT a conversion that is wrong the same way on both sides (a
    swapped q/k split, gate/up or expert order in the table's `to_hf`): that is the log-prob gate's job
    (`logprob_gate`)."""
    names = list(sent.names)
    streamed = set(names)
    problems = []
    # a refit of `only` (LoRA's trained tensors): those must all come; the engine's others were checked when last
    # streamed (the initial refit) and training does not change them
    expected = (
        set(only) if only is not None else set(ctx.refit_names or ()) | set(engine_tensor_names(ctx.engine) or ())
    )
    if missing := sorted(expected - streamed):
        problems.append(f"not streamed: {_few(missing)}")
    if len(streamed) != len(names):
        problems.append(f"streamed more than once: {_few(sorted(n for n in streamed if names.count(n) > 1))}")
    held = [readable_tensor(ctx.engine, name) for name in names]
    readable = [i for i, tensor in enumerate(held) if tensor is not None]
    if readable:
        rows = sent.values if len(readable) == len(names) else sent.values[readable]
        engine_sums = tensor_checksums([held[i] for i in readable if held[i] is not None])
        if differ := mismatched([names[i] for i in readable], rows, engine_sums):
            problems.append(f"the engine's tensor differs from the one streamed for {len(differ)}: {_few(differ)}")
    now = policy.refit_sources()
    if sent.sources is not None and now is not None:
        labels = [f"source {i}" for i in range(len(now))]
        if len(now) != sent.sources.shape[0] or mismatched(labels, sent.sources, tensor_checksums(now)):
            problems.append("the refit read trainer tensors that differ from the trainer's now (a stale replay)")
    if problems:
        when = "the initial refit" if step == 0 else f"the refit after step {step}"
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            when += f" (rank {torch.distributed.get_rank()})"
        raise BridgeError(f"{when} failed its check: " + "; ".join(problems))
    return len(readable)


def _few(names: list[str], shown: int = 6) -> str:
    return ", ".join(names[:shown]) + (f", ... ({len(names)} in all)" if len(names) > shown else "")


def _probe(ctx: _RankContext, policy: TrainingBackend, step: int) -> dict[str, float]:
    """Engine vs trainer on the fixed probe prompt: `token_mult_prob_error` of one sampled completion, gated by
    `grpo.max_token_mult_prob_error` (`logprob_gate`)."""
    rollout = None
    if ctx.replicas.replica == 0:  # every rank of the first engine replica takes part
        out = ctx.engine.generate([ctx.probe_prompt], _sampling_params(ctx.config, 1, seed=ctx.config.grpo.seed))[0]
        sample = out.samples[0]
        rollout = Rollout(
            tuple(out.prompt_token_ids),
            tuple(sample.token_ids),
            tuple(sample.logprobs or ()),
            routed_experts=sample.routed_experts,
        )
    rollout = _broadcast(rollout)
    batches = make_microbatches([rollout], 1)
    logprobs = policy.compute_logprobs(batches, ctx.config.generation.temperature)
    error = _flat_mult_error(policy, batches, logprobs, over_dp=False)
    check_logprob_agreement(ctx.config, step, error, "probe prompt", report=ctx.is_rank0)
    return {"probe_token_mult_prob_error": error}


def _validate(ctx: _RankContext, step: int) -> dict[str, float]:
    """Rank 0, every `val_period` steps: `val_num_generations` completions of each validation prompt (greedy when
    one), scored; `val_reward` and `val_pass_at_{k}` (`grpo.algorithm.pass_at_k`), and a few samples logged."""
    from hf_mcore_bridge.grpo.algorithm.pass_at_k import validation_metrics

    config = ctx.config
    period, n = config.grpo.val_period, config.grpo.val_num_generations
    if ctx.replicas.replica != 0 or period <= 0 or step % period != 0:  # the first replica's ranks validate
        return {}
    questions = [r["prompt"] for r in ctx.val_records]
    prompts = [ctx.renderer.token_ids(q) for q in questions]
    answers = [r["answer"] for r in ctx.val_records]
    params = _sampling_params(config, n, config.grpo.seed, greedy=n == 1)
    outputs, scored, _ = _generate_scored(ctx, prompts, params, [a for a in answers for _ in range(n)])
    if scored is None:  # another tensor-parallel rank of the first replica: rank 0 reports
        return {}
    texts = [[s.text or "" for s in out.samples] for out in outputs]
    rewards = [scored.rewards[i * n : (i + 1) * n] for i in range(len(questions))]
    if ctx.logger is not None:
        shown = range(min(config.logger.num_val_samples_to_print, len(questions)))
        ctx.logger.log_samples(
            step,
            [
                {"prompt": ctx.renderer.text(questions[i]), "completion": texts[i][0], "answer": answers[i]}
                | {"reward": rewards[i][0]}
                for i in shown
            ],
        )
    return validation_metrics(rewards) | {"val_reward_timeouts": float(scored.timeouts)}


def _train_rank(config: GRPOConfig, prepared: PreparedRun) -> None:
    if not torch.cuda.is_available():  # CPU: the ranks share the cores; oversubscribed threads crawl
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // torch.distributed.get_world_size()))
    torch.manual_seed(config.grpo.seed)
    policy = build_backend(config, prepared)
    ctx = _RankContext(config, prepared, policy)
    first_step = _maybe_resume(ctx, policy) + 1
    # the engine's first weights come from the trainer, through the table and the refit's checks: a wrong
    # conversion shows in the first step's rollouts (the gate below)
    initial = _refit(ctx, policy, first_step - 1, initial=True)
    if first_step == 1 and prepared.source_hf_dir is not None and config.grpo.check_initial_weights:
        initial["initial_weights_checked"] = _check_initial_weights(ctx, policy, prepared.source_hf_dir)
    for step in range(first_step, config.grpo.max_num_steps + 1):
        started = time.perf_counter()
        rollouts, rollout_stats = _generate_rollouts(ctx, step)  # every replica its share, gathered everywhere
        generation_s = time.perf_counter() - started
        metrics = _train_step(policy, config, rollouts, gate=_rollouts_gate(ctx, step))
        metrics |= _refit(ctx, policy, step)
        metrics |= _probe(ctx, policy, step) | _validate(ctx, step)
        step_s = time.perf_counter() - started
        if ctx.logger is not None:
            _log_rollouts(prepared.log_dir, step, rollouts)
            tokens = sum(len(r.prompt_ids) + len(r.completion_ids) for r in rollouts)
            extra = {}
            if step == first_step:  # the initial refit's time and, where checked, its tensors against the source
                extra = {"initial_refit_s": initial["refit_s"]} | {
                    k: v for k, v in initial.items() if k == "initial_weights_checked"
                }
            ctx.logger.log(
                step,
                rollout_stats
                | metrics
                | extra
                | {"generation_s": generation_s, "step_s": step_s, "tokens_per_s": tokens / step_s},
            )
        _maybe_save(ctx, policy, step)
    # LoRA: the trained adapters as a PEFT directory beside the metrics (`bridge export --peft` of a checkpoint too)
    policy.save_adapters(Path(config.logger.log_dir) / ADAPTER_DIR, config.policy.model_path)
    ctx.scorer.close()
    if ctx.logger is not None:
        ctx.logger.close()


def _check_initial_weights(ctx: _RankContext, policy: TrainingBackend, hf_dir: Path) -> float:
    """The policy's full-tensor refit stream against the HF directory it came from (`grpo.refit.source_check`),
    compared on rank 0, which stops the run on a difference (the world ends with its failing rank); every rank
    exhausts the stream (it gathers). Returns the tensors compared (on rank 0). With LoRA adapters the base weights
    are compared (unmerged: adapters read from `policy.lora.adapter_path` are not the checkpoint's)."""
    from hf_mcore_bridge.grpo.refit.source_check import compare_with_source

    return float(compare_with_source(policy.hf_weights(merged=False), hf_dir, report=ctx.is_rank0))


def _rollouts_gate(ctx: _RankContext, step: int) -> Callable[[float], None]:
    """The step's rollouts' engine-vs-trainer `token_mult_prob_error`, gated before training (`logprob_gate`)."""

    def gate(error: float) -> None:
        check_logprob_agreement(ctx.config, step, error, "step's rollouts", report=ctx.is_rank0)

    return gate


def _maybe_resume(ctx: _RankContext, policy: TrainingBackend) -> int:
    """Load the newest checkpoint when resuming; returns the last completed step (0 for a fresh start)."""
    step = _resume_step(ctx.config)
    if step is None:
        return 0
    state = policy.load_checkpoint(Path(ctx.config.checkpointing.checkpoint_dir), step)
    ctx.prompts.load_state_dict(state["prompts"])  # every rank draws the step's prompts
    return step


def _maybe_save(ctx: _RankContext, policy: TrainingBackend, step: int) -> None:
    ckpt = ctx.config.checkpointing
    if not ckpt.enabled or (step % ckpt.save_period != 0 and step != ctx.config.grpo.max_num_steps):
        return
    prompts = _broadcast(ctx.prompts.state_dict() if ctx.is_rank0 else None)
    state = {"prompts": prompts, "optimizer_steps": policy.optimizer_steps}
    policy.save_checkpoint(Path(ckpt.checkpoint_dir), step, state)
