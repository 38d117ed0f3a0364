"""The megatron-core side of GRPO on one rank: the policy model, its optimizer, log-probs and training steps.

Runs inside a `world.run_world` rank (process group and `parallel_state` initialised). The policy is a
`GPTModel` (local layer spec) loaded from a `torch_dist` checkpoint, wrapped in megatron-core's
`DistributedDataParallel` (fp32 gradient reduction, overlapped with the backward under data parallelism:
`ddp_settings`), trained by `get_megatron_optimizer` (AdamW, grad clipping) stepped by its
`OptimizerParamScheduler`. Every forward pass goes through `get_forward_backward_func()`, so pipeline
parallelism uses megatron-core's schedules.

Log-probs: the sampled token's `log_softmax(logits / temperature)` computed by `vocab_parallel_cross_entropy`
(megatron-core's torch-compiled version for bf16 on CUDA) over the TP-sharded vocabulary; logits of the padding rows of
the vocabulary (ids >= the real vocabulary) are pushed to the dtype's minimum first, so they take no probability mass,
exactly as in the engine whose vocabulary is unpadded. The loss is `grpo.algorithm.losses.grpo_loss` per micro-batch,
normalised by the mini-batch's global count; the schedule divides each micro-batch loss by the number of micro-batches
and DDP averages over data-parallel ranks, so the loss is multiplied back by both.

Micro-batches are padded rows (causal attention), or packed rows handed to megatron-core as `PackedSeqParams`
(THD: attention and RoPE per rollout; `grpo.algorithm.batching`, `sdpa_attention`).

Routing replay (`policy.router_replay`): the routers are built with megatron-core's replay hook, and before each
micro-batch's forward (log-probs, reference and training alike) they are handed the engine's expert choices for its
tokens where it carries them (`router_replay`).

Context parallelism (`context_parallel_size` > 1): every rank of a CP group holds the same micro-batches, padded per
sequence to a multiple of 2 x CP; the model gets this rank's share of each sequence (`cp_inputs`), `token_logprobs`
gathers the log-probs back in sequence order, and the loss is computed whole on every CP rank (each token's
gradient taken on the rank that holds it; megatron-core's schedule and DDP sum the CP ranks' gradients). At CP 1
nothing of this runs.

The expert score biases of sigmoid routers (megatron-core's `router.expert_bias` buffers) move only at
`policy.megatron_cfg.moe_router_bias_update_rate` (0 by default: the objective alone changes the model).

Simplifications: the reference policy for the KL term is the initial weights (and persistent buffers, the expert
biases), kept as a copy on this rank and swapped in for a forward pass; with PP > 1 log-probs and metrics live on
the last stage and are broadcast from there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from hf_mcore_bridge.convert.config_bridge import transformer_config_kwargs
from hf_mcore_bridge.convert.layout import Layout
from hf_mcore_bridge.errors import BridgeError
from hf_mcore_bridge.grpo.algorithm.batching import (
    MicroBatch,
    move_predicted,
    pad_sequences_to_multiple,
    pad_to_length,
    pad_to_multiple,
    sequence_padding_index,
)
from hf_mcore_bridge.grpo.algorithm.losses import LossConfig, global_valid_count, grpo_loss
from hf_mcore_bridge.grpo.backends.megatron.config import MegatronConfig
from hf_mcore_bridge.megatron.cpu_patches import cuda_type_names
from hf_mcore_bridge.megatron.lora_config import LoraConfig
from hf_mcore_bridge.megatron.model import load_distributed_checkpoint, transformer_config
from hf_mcore_bridge.models.spec import ModelSpec

__all__ = [
    "Policy",
    "build_policy",
    "cast_parameters",
    "ddp_settings",
    "token_logprobs",
    "use_fused_adamw",
]


@dataclass
class Policy:
    """The trained model on this rank and what steps it."""

    model: Any
    """megatron-core `DistributedDataParallel` around this stage's `GPTModel`."""
    optimizer: Any
    """`MegatronOptimizer` from `get_megatron_optimizer`."""
    scheduler: Any
    """`OptimizerParamScheduler`."""
    model_cfg: ModelSpec
    padded_vocab: int
    dtype: torch.dtype
    reference: list[torch.Tensor] | None = None
    """Initial values of `model_state(module)` (the KL reference), or None when no KL term is used."""
    optimizer_steps: int = field(default=0)
    lora: LoraConfig | None = None
    """The run's `policy.lora` when enabled (its dropout masks are seeded per mini-batch: `megatron.lora_dropout`)."""

    @property
    def module(self) -> torch.nn.Module:
        """The bare `GPTModel`."""
        return self.model.module


def _transformer_config(
    model_cfg: ModelSpec,
    layout: Layout,
    dtype: torch.dtype,
    megatron: MegatronConfig,
    on_device_init: bool = False,
    router_replay: bool = False,
) -> Any:
    kwargs = transformer_config_kwargs(model_cfg, layout, dtype)
    if router_replay:  # every router owns a `RouterReplay` (`router_replay`); idle until a batch carries routing
        kwargs["moe_enable_routing_replay"] = True
    # weights loaded from a checkpoint are built on the CPU first; random ones are initialised where they live
    kwargs.update(use_cpu_initialization=not on_device_init, sequence_parallel=megatron.sequence_parallel)
    if model_cfg.moe is not None:  # 0 unless asked: megatron-core's default (1e-3) changes the model on its own
        kwargs["moe_router_bias_update_rate"] = megatron.moe_router_bias_update_rate
    if torch.cuda.is_available():  # megatron-core's torch-compiled SwiGLU: no Transformer Engine needed
        kwargs["bias_activation_fusion"] = True
        if model_cfg.moe is not None:  # the experts as torch grouped GEMMs (`grouped_experts`) where torch has them
            kwargs["moe_grouped_gemm"] = hasattr(torch, "_grouped_mm")
    if layout.pp > 1:  # micro-batches are padded to their own longest row
        kwargs["variable_seq_lengths"] = True
        # megatron-core refuses variable lengths with the allgather dispatcher (dense models included)
        kwargs["moe_token_dispatcher_type"] = "alltoall"
    kwargs.update(megatron.transformer)
    return transformer_config(kwargs)


def _gpt_model(config: Any, model_cfg: ModelSpec, padded_vocab: int) -> torch.nn.Module:
    """The policy's `GPTModel`: the project's layer spec (SDPA core attention, which also takes the block-diagonal
    masks of packed rows)."""
    from hf_mcore_bridge.megatron.model import gpt_model

    return gpt_model(config, model_cfg, padded_vocab)


def build_policy(
    model_cfg: ModelSpec,
    megatron: MegatronConfig,
    layout: Layout,
    dtype: torch.dtype,
    padded_vocab: int,
    checkpoint_dir: Path | None,
    total_optimizer_steps: int,
    keep_reference: bool,
    router_replay: bool = False,
    lora: LoraConfig | None = None,
) -> Policy:
    """This rank's policy at `layout` (the run's, as `parallel_state` was initialised with it), loaded from
    `checkpoint_dir`, with optimizer and scheduler. `checkpoint_dir=None` gives random weights (initialised on this
    rank's GPU where there is one): how `scripts/bench_training.py` measures the trainer's own training step.
    `router_replay`: build the MoE routers able to replay the engine's routing (`router_replay`). `lora` (when
    enabled): every base parameter frozen and adapters added (`megatron.lora.add_lora`) before DDP is built, so
    DDP's buffers and the optimizer hold the adapters alone."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from hf_mcore_bridge.megatron.cpu_patches import apply_foreach_multi_tensor_ops

    apply_foreach_multi_tensor_ops()  # without TE / Apex: gradient norms without a host sync per tensor

    on_device_init = checkpoint_dir is None and torch.cuda.is_available()
    config = _transformer_config(model_cfg, layout, dtype, megatron, on_device_init, router_replay)
    gpt = _gpt_model(config, model_cfg, padded_vocab)
    if torch.cuda.is_available():  # built on the CPU (use_cpu_initialization): train on this rank's GPU
        gpt = gpt.cuda(torch.cuda.current_device())
    cast_parameters(gpt, dtype)
    if checkpoint_dir is not None:
        load_distributed_checkpoint(gpt, checkpoint_dir)
    if lora is not None and lora.enabled:
        from hf_mcore_bridge.megatron.lora import add_lora, set_adapters

        adapters = add_lora(gpt, model_cfg, lora)
        if lora.adapter_path is not None:  # the run starts from a PEFT directory's A and B (validated up front)
            from hf_mcore_bridge.megatron.lora_peft import read_peft_adapter

            set_adapters(adapters, read_peft_adapter(Path(lora.adapter_path))[1])
    ddp_config = DistributedDataParallelConfig(**ddp_settings(megatron, parallel_state.get_data_parallel_world_size()))
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=gpt)
    config.no_sync_func = model.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    opt_kwargs: dict[str, Any] = {
        "optimizer": "adam",
        "bf16": dtype == torch.bfloat16,
        "fp16": dtype == torch.float16,
        "params_dtype": dtype,
        # the distributed optimizer works on DDP's buffers as laid out for it: one switch for both
        "use_distributed_optimizer": ddp_config.use_distributed_optimizer,
    }
    opt_config = OptimizerConfig(**(opt_kwargs | dict(megatron.optimizer)))
    with cuda_type_names():  # CPU: bf16 parameters with fp32 master copies, sorted by CUDA type names
        optimizer = get_megatron_optimizer(opt_config, [model])
    if torch.cuda.is_available():
        use_fused_adamw(optimizer)
    sched = megatron.scheduler
    decay_steps = sched.lr_decay_steps or max(total_optimizer_steps, sched.lr_warmup_steps + 1)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=sched.lr_warmup_init,
        max_lr=opt_config.lr,
        min_lr=sched.min_lr,
        lr_warmup_steps=sched.lr_warmup_steps,
        lr_decay_steps=decay_steps,
        lr_decay_style=sched.lr_decay_style,
        start_wd=opt_config.weight_decay,
        end_wd=opt_config.weight_decay,
        wd_incr_steps=decay_steps,
        wd_incr_style="constant",
    )
    reference = [t.detach().clone() for t in model_state(gpt)] if keep_reference else None
    enabled = lora if lora is not None and lora.enabled else None
    return Policy(model, optimizer, scheduler, model_cfg, padded_vocab, dtype, reference, lora=enabled)


def ddp_settings(megatron: MegatronConfig, data_parallel: int) -> dict[str, Any]:
    """`DistributedDataParallelConfig` keys: the trainer's defaults, then `megatron.ddp` over them. Defaults: fp32
    gradient buffers, reduced in fp32 (bf16 gradients summed over many micro-batches and ranks lose precision; as
    Megatron-LM's `--accumulate-allreduce-grads-in-fp32`), and with data parallelism the gradient reduction
    overlapped with the backward (buckets reduced as they fill). The distributed optimizer and the overlapped
    parameter all-gather (`use_distributed_optimizer`, `overlap_param_gather`) are the user's to turn on; the
    distributed optimizer also by `megatron.optimizer.use_distributed_optimizer` (DDP and the optimizer must agree:
    one switch is enough)."""
    defaults: dict[str, Any] = {"grad_reduce_in_fp32": True, "overlap_grad_reduce": data_parallel > 1}
    if "use_distributed_optimizer" in megatron.optimizer:
        defaults["use_distributed_optimizer"] = megatron.optimizer["use_distributed_optimizer"]
    return defaults | dict(megatron.ddp)


def cast_parameters(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Every parameter in `dtype`, in place. The local spec builds its norms as torch modules in fp32 whatever
    `params_dtype` says; under bf16 that keeps torch's RMSNorm off its fused kernel (a dtype mismatch on every
    call). Megatron-LM casts them with `Float16Module`, which would also rename every parameter (`module.`);
    casting the parameters alone leaves names, checkpoints and refit as they are (buffers such as RoPE tables
    stay fp32)."""
    for param in module.parameters():
        if param.dtype != dtype:
            param.data = param.data.to(dtype)


def use_fused_adamw(optimizer: Any) -> None:
    """Switch the torch AdamW inside a megatron-core optimizer to its fused CUDA kernel: one pass over parameters,
    gradients and states instead of foreach's several (megatron-core picks foreach when Apex and Transformer
    Engine are absent; the foreach step took a quarter of a 1B-shape training iteration on an H200). Call before
    the first step, while no optimizer state exists."""
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(chained, "optimizer", None)
        if isinstance(inner, torch.optim.AdamW) and not inner.state:
            for group in inner.param_groups:
                group.update(foreach=False, fused=True)


def token_logprobs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    vocab_size: int,
    temperature: float,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Log-probs `[B, S-1]` of `tokens[:, 1:]` under `log_softmax(logits / temperature)` over the real vocabulary.

    logits: [B, S, V_local], this TP rank's slice of the padded vocabulary (rank r holds ids
    `r * V_local ... (r + 1) * V_local - 1`); tokens: [B, S]. Collective over the TP group.

    Under context parallelism `logits` are this CP rank's `[B, S / cp, V_local]` (`context_parallel.cp_positions`
    of the row's sequences `cu_seqlens`, the whole row when None): each rank scores its own tokens against their
    global next tokens and the log-probs are gathered in sequence order, the same `[B, S-1]` on every CP rank.
    """
    from megatron.core import parallel_state

    if parallel_state.get_context_parallel_world_size() == 1:
        return _label_logprobs(logits[:, :-1], tokens[:, 1:], vocab_size, temperature)
    from hf_mcore_bridge.megatron.context_parallel import gather_in_order, split_sequence

    group = parallel_state.get_context_parallel_group()
    cp, rank = parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()
    cu = torch.tensor([0, tokens.shape[1]]) if cu_seqlens is None else cu_seqlens.cpu()
    labels = split_sequence(torch.roll(tokens, -1, dims=1), cp, rank, 1, cu)  # the last column is dropped below
    local = _label_logprobs(logits, labels, vocab_size, temperature)
    return gather_in_order(local, group, cu, dim=1)[:, :-1]


def _label_logprobs(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, temperature: float) -> torch.Tensor:
    """`[B, s]` log-probs of `labels` `[B, s]` under the TP-sharded `logits` `[B, s, V_local]` (`token_logprobs`)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    scaled = logits.float() / temperature
    local = scaled.shape[-1]
    first = parallel_state.get_tensor_model_parallel_rank() * local
    padding = torch.arange(first, first + local, device=scaled.device) >= vocab_size
    scaled = scaled.masked_fill(padding, torch.finfo(scaled.dtype).min)
    # both cross entropies subtract the row max from their input in place: `scaled` is ours alone.
    if logits.is_cuda and logits.dtype == torch.bfloat16:
        # megatron-core's torch-compiled cross entropy (`cross_entropy_loss_fusion`, native): the same arithmetic in
        # fewer kernels; its gradient is returned in bf16, which is what reaches bf16 logits in any case
        from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

        group = parallel_state.get_tensor_model_parallel_group()
        return -fused_vocab_parallel_cross_entropy(scaled, labels, group)
    return -vocab_parallel_cross_entropy(scaled, labels)


def _forward_step(
    loss_func: Callable[[MicroBatch, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]],
    moe_layers: tuple[int, ...],
    data_iterator: Iterator[MicroBatch],
    model: torch.nn.Module,
) -> tuple[torch.Tensor, Callable[[torch.Tensor], Any]]:
    from hf_mcore_bridge.megatron.sdpa_attention import packed_seq_params

    batch = next(data_iterator)
    # No mask: SDPA's causal flag for padded rows; packed rows are attended per sequence from their cu_seqlens.
    config = getattr(model, "config", None)
    packed = None if batch.cu_seqlens is None else packed_seq_params(batch.cu_seqlens, batch.max_seqlen, config)
    tokens, position_ids = cp_inputs(batch)
    if moe_layers:  # this micro-batch's routing replayed, or (none carried) the routers' own
        _replay_routing(model, batch, moe_layers)
    output = model(tokens, position_ids, None, packed_seq_params=packed)
    return output, partial(loss_func, batch)


def _replay_routing(model: torch.nn.Module, batch: MicroBatch, moe_layers: tuple[int, ...]) -> None:
    """Hand the routers of `model` the engine's choices for `batch`'s tokens on this rank (`router_replay`), or
    clear them where `batch` carries none."""
    from megatron.core import parallel_state

    from hf_mcore_bridge.grpo.backends.megatron.router_replay import local_routing, replay_routing

    ids = None
    if batch.routed_experts is not None:
        ids = local_routing(
            batch.routed_experts,
            cp_index(batch),
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_rank(),
            bool(getattr(getattr(model, "config", None), "sequence_parallel", False)),
        )
    replay_routing(model, ids, moe_layers)


def cp_index(batch: MicroBatch) -> torch.Tensor | None:
    """The positions `[S / cp]` of `batch`'s rows this context-parallel rank feeds the model, on the tokens' device:
    megatron-core's load-balanced split of each sequence (`context_parallel`); None at CP 1 (all of them)."""
    from megatron.core import parallel_state

    cp = parallel_state.get_context_parallel_world_size()
    if cp == 1:
        return None
    from hf_mcore_bridge.megatron.context_parallel import cp_positions

    cu = torch.tensor([0, batch.seq_len]) if batch.cu_seqlens is None else batch.cu_seqlens
    return cp_positions(cu, cp, parallel_state.get_context_parallel_rank()).to(batch.tokens.device)


def cp_inputs(batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens and positions `[B, S / cp]` this context-parallel rank feeds the model (all of them at CP 1,
    `cp_index`); packed rows keep their global `cu_seqlens`, from which megatron-core's RoPE and the attention
    place each token."""
    mine = cp_index(batch)
    if mine is None:
        return batch.tokens, batch.position_ids
    return batch.tokens[:, mine], batch.position_ids[:, mine]


def _run_schedule(policy: Policy, batches: list[MicroBatch], loss_func: Callable, forward_only: bool) -> list[dict]:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from hf_mcore_bridge.grpo.backends.megatron.router_replay import moe_layer_numbers

    moe_layers = moe_layer_numbers(policy.model_cfg) if policy.module.config.moe_enable_routing_replay else ()
    return get_forward_backward_func()(
        forward_step_func=partial(_forward_step, loss_func, moe_layers),
        data_iterator=iter(batches),
        model=[policy.model],
        num_microbatches=len(batches),
        seq_length=max(b.seq_len for b in batches),
        micro_batch_size=max(b.num_rows for b in batches),
        forward_only=forward_only,
    )


def _is_last_stage() -> bool:
    from megatron.core import parallel_state

    return parallel_state.is_pipeline_last_stage()


def _broadcast_from_last_stage(value: Any) -> Any:
    """`value` as held by the last stage of this rank's pipeline, on every stage of that pipeline."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return value
    holder = [value]
    dist.broadcast_object_list(
        holder,
        src=parallel_state.get_pipeline_model_parallel_last_rank(),
        group=parallel_state.get_pipeline_model_parallel_group(),
    )
    return holder[0]


def _over_data_parallel(results: list[dict[str, torch.Tensor]]) -> list[dict[str, float]]:
    """Every data-parallel replica's per-micro-batch metrics (as floats), this replica's first."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    mine = [{k: float(v) for k, v in r.items()} for r in results]
    if parallel_state.get_data_parallel_world_size() == 1:
        return mine
    everyone: list[list[dict[str, float]]] = [[] for _ in range(parallel_state.get_data_parallel_world_size())]
    dist.all_gather_object(everyone, mine, group=parallel_state.get_data_parallel_group())
    return [r for replica in everyone for r in replica]


def compute_logprobs(
    policy: Policy, batches: list[MicroBatch], temperature: float, reference: bool = False
) -> list[torch.Tensor]:
    """Per micro-batch, the policy's log-probs `[B, S-1]` (detached); `reference=True` uses the initial weights."""

    def loss_func(batch: MicroBatch, output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logprobs = token_logprobs(output, batch.tokens, policy.model_cfg.vocab_size, temperature, batch.cu_seqlens)
        return logprobs.sum() * 0.0, {"logprobs": logprobs.detach()}

    places = [_token_places(policy, b) for b in batches]
    lengths = [b.seq_len - 1 for b in batches]
    batches = _on_device(policy, batches)
    policy.model.eval()
    with torch.no_grad(), _SwappedIn(policy, policy.reference if reference else None):
        results = _run_schedule(policy, batches, loss_func, forward_only=True)
    policy.model.train()
    logprobs = (
        [_in_original_places(r["logprobs"], p, n) for r, p, n in zip(results, places, lengths, strict=True)]
        if _is_last_stage()
        else None
    )
    return _broadcast_from_last_stage(logprobs)


def _token_places(policy: Policy, batch: MicroBatch) -> torch.Tensor | None:
    """Where each token of `batch` sits in the row `_on_device` makes of it: None for the same place (padding
    only at the end), the places under context parallelism in a packed row, whose sequences are each padded
    (`pad_sequences_to_multiple`)."""
    cp = policy.module.config.context_parallel_size
    if cp == 1 or batch.cu_seqlens is None:
        return None
    return sequence_padding_index(batch.cu_seqlens, 2 * cp)[0]


def _in_original_places(values: torch.Tensor, places: torch.Tensor | None, length: int) -> torch.Tensor:
    """`values` `[B, S-1]` of a row as `_on_device` made it, back to the original row's `[B, length]` (host)."""
    if places is None:
        return values[:, :length].cpu()
    return values[:, places[:-1].to(values.device)].cpu()


def _model_device(policy: Policy) -> torch.device:
    return next(policy.module.parameters()).device


def _on_device(policy: Policy, batches: list[MicroBatch]) -> list[MicroBatch]:
    """The micro-batches on the model's device, padded to a multiple of TP where sequence parallelism needs it,
    under context parallelism each sequence to a multiple of 2 x CP (and the row to 2 x CP x TP with sequence
    parallelism), and under expert parallelism to the longest of each micro-batch over the expert-parallel ranks."""
    config = policy.module.config
    multiple = config.tensor_model_parallel_size if config.sequence_parallel else 1
    cp = config.context_parallel_size
    if cp > 1:
        batches = [pad_sequences_to_multiple(b, 2 * cp) for b in batches]
        multiple *= 2 * cp
    batches = [pad_to_multiple(b, multiple) for b in batches]
    if config.num_moe_experts and config.expert_model_parallel_size > 1:
        batches = _same_lengths_over_experts(batches, _model_device(policy))
    return [b.to(_model_device(policy)) for b in batches]


def _same_lengths_over_experts(batches: list[MicroBatch], device: torch.device) -> list[MicroBatch]:
    """Each micro-batch padded to the longest of its peers on the other expert-parallel ranks: megatron-core's
    all-gather token dispatcher gathers equal-sized token blocks over those ranks, which are data-parallel replicas
    holding different rollouts (rows of unequal lengths made gloo fail and would make NCCL hang or mix tokens).
    Collective over the expert (tensor x expert) parallel group."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_expert_tensor_and_model_parallel_group()
    counts = torch.tensor([len(batches), -len(batches)], device=device)
    dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=group)
    if int(counts[0]) != -int(counts[1]):
        raise BridgeError(
            f"expert-parallel ranks hold {-int(counts[1])} to {int(counts[0])} micro-batches; megatron-core's token"
            " dispatcher needs the same on each (sequence packing at expert_model_parallel_size > 1 does not give it)"
        )
    if not batches:
        return batches
    shapes = torch.tensor([[b.num_rows, -b.num_rows, b.seq_len] for b in batches], device=device)
    dist.all_reduce(shapes, op=dist.ReduceOp.MAX, group=group)
    if (shapes[:, 0] != -shapes[:, 1]).any():
        raise BridgeError("expert-parallel ranks hold micro-batches of different numbers of rows")
    return [pad_to_length(b, int(length)) for b, length in zip(batches, shapes[:, 2].tolist(), strict=True)]


def _padded_like(
    values: torch.Tensor, batch: MicroBatch, places: torch.Tensor | None, device: torch.device
) -> torch.Tensor:
    """`values: [B, S'-1]` moved into `batch`'s `[B, S-1]`: right-padded with zeros (`places` None), or token k of
    the original row put at `places[k]`, zeros elsewhere; on `device`."""
    if places is None:
        extra = batch.seq_len - 1 - values.shape[-1]
        return torch.nn.functional.pad(values, (0, extra)).to(device)
    return move_predicted(values.to(device), places, batch.seq_len)


def model_state(module: torch.nn.Module) -> list[torch.Tensor]:
    """What training changes in a model: its parameters, then its persistent buffers (the routers' expert biases)."""
    saved = set(module.state_dict())
    return [*module.parameters(), *(b for name, b in module.named_buffers() if name in saved)]


class _SwappedIn:
    """Context manager: the given values of `model_state` in place of the current ones (None: no swap)."""

    def __init__(self, policy: Policy, values: list[torch.Tensor] | None) -> None:
        self.params = model_state(policy.module)
        self.values = values
        self.saved: list[torch.Tensor] = []

    def __enter__(self) -> None:
        if self.values is not None:
            self.saved = [p.detach().clone() for p in self.params]
            for param, value in zip(self.params, self.values, strict=True):
                param.data.copy_(value)

    def __exit__(self, *exc: object) -> None:
        for param, value in zip(self.params, self.saved, strict=False):
            param.data.copy_(value)


def train_minibatch(
    policy: Policy,
    batches: list[MicroBatch],
    old_logprobs: list[torch.Tensor] | None,
    ref_logprobs: list[torch.Tensor] | None,
    loss_config: LossConfig,
    temperature: float,
    before_step: Callable[[dict[str, float]], None] | None = None,
) -> dict[str, float]:
    """One optimizer step on `batches`: forward/backward through the schedule, clip, AdamW, scheduler step.
    `old_logprobs` None: the forward's own log-probs, detached (one on-policy update). `before_step` sees the
    mini-batch's metrics after the backward and before the optimizer step (it may raise to stop the update).

    Returns the mini-batch's metrics (token-weighted means over micro-batches) plus `grad_norm` and `lr`.
    """
    from megatron.core import parallel_state

    device = _model_device(policy)
    places = [_token_places(policy, b) for b in batches]
    batches = _on_device(policy, batches)
    if old_logprobs is None:
        old_logprobs = [None] * len(batches)
    else:
        old_logprobs = [_padded_like(t, b, p, device) for t, b, p in zip(old_logprobs, batches, places, strict=True)]
    if ref_logprobs is not None:
        ref_logprobs = [_padded_like(t, b, p, device) for t, b, p in zip(ref_logprobs, batches, places, strict=True)]
    dp_group = parallel_state.get_data_parallel_group() if parallel_state.get_data_parallel_world_size() > 1 else None
    global_count = global_valid_count([b.mask for b in batches], loss_config.aggregation, dp_group)
    scale = len(batches) * parallel_state.get_data_parallel_world_size()
    extras = {
        id(b): (old_logprobs[i], None if ref_logprobs is None else ref_logprobs[i]) for i, b in enumerate(batches)
    }

    def loss_func(batch: MicroBatch, output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logprobs = token_logprobs(output, batch.tokens, policy.model_cfg.vocab_size, temperature, batch.cu_seqlens)
        old, ref = extras[id(batch)]
        loss, metrics = grpo_loss(
            logprobs,
            old,
            batch.advantages,
            batch.mask,
            global_count,
            loss_config,
            ref_logprobs=ref,
            engine_logprobs=batch.engine_logprobs,
        )
        return loss * scale, metrics

    policy.model.zero_grad_buffer()
    policy.optimizer.zero_grad()
    from hf_mcore_bridge.megatron.lora_dropout import dropout_rng

    # LoRA dropout: masks seeded by the step and the replica (data and context parallel rank, stage), alike over TP
    replica = parallel_state.get_data_parallel_rank(with_context_parallel=True) * 1_000 + (
        parallel_state.get_pipeline_model_parallel_rank()
    )
    with dropout_rng(policy.lora, policy.optimizer_steps, replica):
        results = _run_schedule(policy, batches, loss_func, forward_only=False)
    metrics = _weighted_means(_over_data_parallel(results)) if _is_last_stage() else None
    metrics = _broadcast_from_last_stage(metrics)
    if before_step is not None:
        before_step(metrics)
    _, grad_norm, _ = policy.optimizer.step()
    lr = policy.optimizer.param_groups[0]["lr"]
    policy.scheduler.step(increment=1)
    policy.optimizer_steps += 1
    return metrics | {"grad_norm": float(grad_norm or 0.0), "lr": float(lr)}


def _weighted_means(results: list[dict[str, float]]) -> dict[str, float]:
    """Token-weighted means of per-micro-batch metrics; `loss`-like terms are sums (each already global-normalised)."""
    summed = {"loss", "pg_loss", "kl_loss", "num_valid_tokens"}
    weights = [float(r["num_valid_tokens"]) for r in results]
    total = sum(weights) or 1.0
    out: dict[str, float] = {}
    for key in results[0]:
        values = [float(r[key]) for r in results]
        if key in summed:
            out[key] = sum(values)
        else:
            out[key] = sum(v * w for v, w in zip(values, weights, strict=True)) / total
    return out
