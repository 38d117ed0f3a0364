"""Training throughput of a policy update on random weights: the Megatron path vs the DTensor path vs plain HF.

For each model shape (Llama-3.2-1B- and Llama-3.1-8B-shaped, from `random_checkpoint.SHAPES`) and each row length
(4096 and 16384 tokens), every path trains on packed rows of random-length sequences that sum to exactly the row
length (one row per micro-batch and rank, the same rows for every path), with one optimizer step per iteration
over `--tokens-per-step` tokens per rank (32768 by default: 8 micro-batches of 4096-token rows, 2 of 16384), and
reports the mean seconds per iteration (iterations timed back to back after warm-up), training tokens/s, peak GPU
memory and MFU.

In the project's environment (`bash scripts/setup.sh`; on a GPU machine with its own torch
`TORCH_SPEC= EXTRAS= bash scripts/setup.sh`, offline with `WHEELS=DIR`; then `. .venv/bin/activate`):

    python scripts/bench_training.py --nproc 2 --json bench.json        # on H200s (one process per GPU, NCCL)
    python scripts/bench_training.py --tiny                             # a tiny shape on CPU (smoke test)

What each path is, and assumes:
- megatron: the GRPO trainer's own code (`bridge train grpo` with `policy.megatron_cfg`): the policy built by
  `grpo.backends.megatron.policy.build_policy` (random weights instead of a checkpoint) and stepped by
  `grpo.backends.megatron.policy.train_minibatch` on packed rows given as the trainer's `MicroBatch`es, with the GRPO
  loss on the trainer's log-probs (old log-probs computed once per set of rows by `compute_logprobs`, in the warm-up;
  random +-1 advantages). So every setting is the trainer's: this project's `GPTModel` (megatron-core's local layer spec
  with `SDPAttention`; no Transformer Engine) with its parameters cast to bf16 (`cast_parameters`, the effect of
  Megatron-LM's `Float16Module` on the fp32 norms), megatron-core `DistributedDataParallel` with
  `grpo.backends.megatron.policy.ddp_settings` (fp32 gradient buffers and reduction; with data parallelism the reduction
  overlapped with the backward), `get_megatron_optimizer` (torch AdamW on fp32 main parameters, switched to its fused
  kernel), the torch-compiled SwiGLU (`bias_activation_fusion`) and cross entropy (megatron-core's fused vocab-parallel
  one, on CUDA in bf16), `get_forward_backward_func`. Packed rows go in as `PackedSeqParams` (THD): attention per
  sequence through torch's varlen flash attention on CUDA (`sdpa_attention`), RoPE restarting per sequence. The only
  keys set are ones a user sets in `policy.megatron_cfg` (`megatron_ddp`): with data parallelism
  `ddp.use_distributed_optimizer` (`--distributed-optimizer`, default on) and `ddp.overlap_param_gather`
  (`--overlap-param-gather`, default off, as in the trainer); the recomputation keys in `transformer`. Parallelism:
  `--megatron-parallel dp` (data parallel over nproc, as NeMo-RL runs the 8B), `tp` (TP = nproc, with sequence
  parallelism), `cp` (context parallelism CP = nproc, `hf_mcore_bridge.megatron.context_parallel`; each sequence padded
  to a multiple of 2 x CP) or `auto` (default): dp, and then every row length that needed activation recomputation (or
  ran out of memory) under dp again at TP = nproc with sequence parallelism, which splits the activations over the GPUs
  instead of recomputing them; both are reported, and the Megatron / DTensor ratio takes the faster.
- dtensor: the trainer's DTensor backend (`policy.dtensor_cfg`): `grpo.backends.dtensor.policy.build_dtensor_policy` on
  the HF `LlamaForCausalLM` (randomly initialised; fp32 parameters, bf16 compute, fp32 gradient reduction, fused
  torch AdamW on CUDA) stepped by its `train_minibatch` with the same GRPO loss. `--dtensor-search auto` (default)
  measures, in one world, every configuration of `dtensor_layouts`: FSDP2 over every rank with gradients
  reduce-scattered after each micro-batch (FSDP2's default, overlapped with the backward) and, with more than one
  rank, once per step (`defer_gradient_sync`, where it fits in memory); TP over every rank where the heads and FFN
  divide; each with sdpa and (on CUDA) flex attention. The Megatron / DTensor ratio takes the fastest. Packed rows
  are given as `position_ids` restarting per sequence and no attention mask; transformers then builds the
  block-diagonal mask itself (for sdpa a dense `[T, T]` one, which keeps SDPA off its flash kernel; for flex a
  block mask).
- hf: plain HF on one GPU (a one-rank world of its own), fp32 parameters under `torch.autocast(bf16)` (what
  transformers' Trainer does with `bf16=True`), cross entropy on the labels, fused torch AdamW. It runs where it
  fits: a reference point, not a trainer of this project.
Every path clips the gradient norm at 1.0 and uses torch's fused AdamW kernel on CUDA. Weights are initialised randomly
on the device. Each (shape, path) runs in a world of its own (fresh processes), so memory one leaves behind cannot
weigh on the next. `--recompute auto` (default) uses full activation recomputation (megatron-core's
`recompute_granularity="full"`, which needs CUDA; transformers' checkpointing) for a row length where the shorter
length's peak memory predicts that it will not fit without (`predicted_oom`): turned on in the built model for
the Megatron and HF paths, in a rebuilt one for FSDP2, which wraps the checkpointed layers when sharding. A
configuration that ran out of memory anyway is retried with it in a rebuilt model; the table says which ran with
it. A configuration still out of memory is reported as OOM. All ranks are assumed to run out of memory together
(they hold the same shapes); a rank that alone runs out while the others wait in a collective would hang the
world, which the prediction makes rarer. `--profile` profiles one more iteration of each configuration and prints
where its time went (`profile_summary`: device busy time, host synchronisations, kernel time by kind).

FLOPs (model FLOPs, identical for every path; recomputation is not counted, so it lowers MFU):
    per row = 6 * N_matmul * T + 6 * L * (heads * head_dim) * sum_i s_i^2
N_matmul counts the weights of every matrix product a token goes through: per layer q, k, v, o and the gated MLP
(gate, up, down), plus the output layer (vocab x hidden, also when tied to the embedding); embedding lookups and
norms are not counted. 6 = 2 FLOPs per multiply-add x 3 (the forward product and two backward ones). The second
term is causal attention (QK^T and AV: 2 products x 2 FLOPs x s^2 / 2 x heads x head_dim, times 3 for fwd+bwd),
summed over the packed sequences s_i of the row, not the row length T: attention across sequences is masked and is
no work. This is Megatron-LM's `num_floating_point_operations` with the causal half and per-sequence lengths.
MFU = FLOPs per iteration / (seconds per iteration x GPUs x 989e12), the H200's dense bf16 peak.
Tokens/s counts every token of every row trained in an iteration (with TP, the ranks of a TP group share a row).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import resource
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from profile_summary import profile_call
from random_checkpoint import SHAPES, TINY_SHAPE

from hf_mcore_bridge.convert.layout import Layout
from hf_mcore_bridge.megatron.world import run_world

H200_BF16_PEAK = 989e12
"""Dense bf16 FLOP/s of one H200 (the MFU denominator)."""

PATHS = ("megatron", "dtensor", "hf")


@dataclass(frozen=True)
class DTensorLayout:
    """One configuration of the DTensor path (`policy.dtensor_cfg` settings and the attention kernel)."""

    tp: int = 1
    """`tensor_parallel_size`; FSDP2 shards over the world / tp ranks."""
    defer_sync: bool = False
    """`defer_gradient_sync`: gradients reduce-scattered once per optimizer step instead of per micro-batch."""
    attention: str = "sdpa"
    """transformers' `attn_implementation`: sdpa or flex_attention."""

    def label(self, world: int) -> str:
        parts = [f"FSDP2 dp_shard={world // self.tp}"] + [f"TP{self.tp}"] * (self.tp > 1)
        parts += ["deferred-sync"] * self.defer_sync + [self.attention.removesuffix("_attention")]
        return " ".join(parts)


@dataclass(frozen=True)
class Options:
    """What to measure and how."""

    shapes: tuple[str, ...] = ("llama3.2-1b", "llama3-8b")
    """Keys of `random_checkpoint.SHAPES` (or "tiny")."""
    seq_lens: tuple[int, ...] = (4096, 16384)
    """Tokens per packed row (one row per micro-batch and rank)."""
    paths: tuple[str, ...] = PATHS
    """Which of megatron, dtensor, hf to run."""
    warmup: int = 1
    """Iterations run before timing (the first compiles the fused kernels and creates the optimizer state)."""
    iters: int = 3
    """Timed iterations, run back to back; their mean is reported."""
    micro_batches: int = 0
    """Rows per rank per optimizer step (gradient accumulation); 0: `tokens_per_step` // row length (at least 1)."""
    tokens_per_step: int = 32768
    """Tokens each rank trains per optimizer step when `micro_batches` is 0: 8 rows of 4096 or 2 of 16384. A GRPO
    step of 512 samples of ~600 tokens trains ~150K tokens per GPU on 2 GPUs, so this is on the small side."""
    distributed_optimizer: bool = True
    """Megatron with data parallelism: megatron-core's distributed optimizer (`policy.megatron_cfg.ddp.
    use_distributed_optimizer`), optimizer state sharded over the data-parallel ranks."""
    overlap_param_gather: bool = False
    """Megatron with the distributed optimizer: the updated parameters' all-gather overlaps the next forward
    (`policy.megatron_cfg.ddp.overlap_param_gather`; off by default in the trainer, and here)."""
    megatron_parallel: str = "auto"
    """"dp": Megatron data parallel over nproc with the distributed optimizer; "tp": TP = nproc (sequence parallel);
    "cp": context parallelism CP = nproc (every packed row split over the ranks; `context_parallel`);
    "auto": dp, then TP = nproc for the row lengths that needed recomputation (or ran out of memory) under dp."""
    recompute: str = "auto"
    """"off", "on", or "auto" (retry with activation recomputation after running out of memory)."""
    hf_attention: str = "sdpa"
    """transformers' attention implementation for the hf path, and the dtensor path with `dtensor_search` off."""
    dtensor_search: str = "auto"
    """"auto": measure every `dtensor_layouts` configuration and compare Megatron with the fastest; "off": FSDP2
    over every rank with `hf_attention` only."""
    dtensor_layout: DTensorLayout = DTensorLayout()
    """The configuration being measured (set per configuration by `bench_rank`)."""
    dtype: str = "bf16"
    """Compute dtype: bf16 or fp32."""
    doc_len: tuple[float, float] = (1 / 16, 1 / 2)
    """Packed sequence lengths are drawn uniformly between these fractions of the row length."""
    seed: int = 0
    profile: bool = False
    """After timing, profile one more iteration and print where its time goes (`profile_summary`, rank 0)."""
    lora_rank: int = 0
    """The Megatron path trains LoRA adapters of this rank on the seven attention and MLP projections (alpha 2 x
    rank, `policy.lora`) instead of the full weights; 0: full weights."""


@dataclass(frozen=True)
class Result:
    """One (shape, row length, path) measurement."""

    shape: str
    seq_len: int
    path: str
    layout: str
    gpus: int
    status: str
    """"ok", "OOM", or "error: ..."."""
    recompute: bool = False
    micro_batches: int = 1
    """Rows per rank and optimizer step."""
    step_s: float = math.nan
    tokens_per_iter: int = 0
    tokens_per_s: float = math.nan
    tokens_per_s_per_gpu: float = math.nan
    flops_per_iter: float = math.nan
    mfu: float = math.nan
    peak_mem_gib: float = math.nan


@dataclass
class Row:
    """One packed row on the device, with what every path needs."""

    tokens: torch.Tensor
    """[1, T] int64."""
    positions: torch.Tensor
    """[1, T] int64, restarting at 0 at every sequence."""
    lengths: list[int]
    cu_seqlens: torch.Tensor
    """[n + 1] int32, on the host (`sdpa_attention.packed_seq_params`)."""
    next_tokens: torch.Tensor
    """[1, T]: the label of each position for megatron-core (the next token)."""
    loss_mask: torch.Tensor
    """[1, T] float: 0 at each sequence's last token (its next token belongs to another sequence)."""
    hf_labels: torch.Tensor
    """[1, T]: transformers' labels (it shifts them itself): -100 at each sequence's first token."""


def shape_config(name: str) -> dict[str, Any]:
    return TINY_SHAPE if name == "tiny" else SHAPES[name]


def _dims(shape: dict[str, Any]) -> tuple[int, int, int, int, int, int, int]:
    hidden, heads = shape["hidden_size"], shape["num_attention_heads"]
    head_dim = shape.get("head_dim") or hidden // heads
    groups = shape.get("num_key_value_heads", heads)
    return shape["num_hidden_layers"], hidden, heads, groups, head_dim, shape["intermediate_size"], shape["vocab_size"]


def matmul_params(shape: dict[str, Any]) -> int:
    """Weights of the matrix products a token goes through: attention and gated MLP per layer, and the output
    layer (counted when tied too)."""
    layers, hidden, heads, groups, head_dim, ffn, vocab = _dims(shape)
    attention = hidden * (heads + 2 * groups) * head_dim + heads * head_dim * hidden
    return layers * (attention + 3 * hidden * ffn) + vocab * hidden


def row_flops(shape: dict[str, Any], lengths: list[int]) -> float:
    """Model FLOPs of one training step (forward + backward) on a packed row of sequences of `lengths`."""
    layers, _, heads, _, head_dim, _, _ = _dims(shape)
    tokens = sum(lengths)
    return 6.0 * matmul_params(shape) * tokens + 6.0 * layers * heads * head_dim * sum(n * n for n in lengths)


def packed_lengths(total: int, fractions: tuple[float, float], seed: int) -> list[int]:
    """Random sequence lengths summing to `total`, each between the given fractions of it (the last one cut)."""
    generator = torch.Generator().manual_seed(seed)
    low, high = max(2, int(total * fractions[0])), max(2, int(total * fractions[1]))
    lengths: list[int] = []
    while sum(lengths) < total:
        lengths.append(int(torch.randint(low, high + 1, (1,), generator=generator)))
    lengths[-1] -= sum(lengths) - total
    if lengths[-1] < 2 and len(lengths) > 1:  # too short to predict anything: give it to the one before
        lengths[-2] += lengths.pop()
    return lengths


def make_row(total: int, vocab: int, fractions: tuple[float, float], seed: int, device: torch.device) -> Row:
    lengths = packed_lengths(total, fractions, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, vocab, (1, total), generator=generator)
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    loss_mask = torch.ones(1, total)
    loss_mask[0, starts[1:] - 1] = 0.0
    hf_labels = tokens.clone()
    hf_labels[0, starts[:-1]] = -100
    return Row(
        tokens=tokens.to(device),
        positions=positions.to(device),
        lengths=lengths,
        cu_seqlens=starts.to(torch.int32),
        next_tokens=torch.roll(tokens, -1, dims=1).to(device),
        loss_mask=loss_mask.to(device),
        hf_labels=hf_labels.to(device),
    )


Step = Callable[[list[Row]], None]


@dataclass
class Trainer:
    """One path's model, built: its training step, and how to turn on activation recomputation without a rebuild
    (None: the path is rebuilt with it)."""

    step: Step
    enable_recompute: Callable[[], None] | None = None


def _dtype(opts: Options) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[opts.dtype]


def build_megatron(shape: dict[str, Any], opts: Options, recompute: bool, device: torch.device) -> Trainer:
    """The trainer's own policy (`grpo.backends.megatron.policy.build_policy`, random weights) stepped by its own
    `grpo.backends.megatron.policy.train_minibatch` (the GRPO loss on the trainer's log-probs) over packed rows; see the
    module docstring. Returns its training step."""
    from megatron.core import parallel_state

    from hf_mcore_bridge.convert.config_bridge import megatron_spec, padded_vocab
    from hf_mcore_bridge.grpo.algorithm.losses import LossConfig
    from hf_mcore_bridge.grpo.backends.megatron.config import MegatronConfig, megatron_layout
    from hf_mcore_bridge.grpo.backends.megatron.policy import build_policy, compute_logprobs, train_minibatch

    model_cfg = megatron_spec(shape)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    dp = parallel_state.get_data_parallel_world_size()
    megatron = MegatronConfig(
        tensor_model_parallel_size=tp,
        context_parallel_size=parallel_state.get_context_parallel_world_size(),
        sequence_parallel=tp > 1,
        sequence_packing=True,
        transformer=RECOMPUTE if recompute else {},
        optimizer={"lr": 1e-5, "weight_decay": 0.0, "clip_grad": 1.0},
        ddp=megatron_ddp(opts, dp),
    )
    from hf_mcore_bridge.megatron.lora_config import PROJECTIONS, LoraConfig

    rank = opts.lora_rank
    lora = LoraConfig(enabled=True, rank=rank, alpha=2.0 * rank, target_modules=PROJECTIONS) if rank else None
    policy = build_policy(
        model_cfg,
        megatron,
        megatron_layout(megatron),
        _dtype(opts),
        padded_vocab(model_cfg, Layout(tp=tp)),
        checkpoint_dir=None,
        total_optimizer_steps=1000,
        keep_reference=False,
        lora=lora,
    )

    def enable_recompute() -> None:  # megatron-core's TransformerBlock reads these at every forward
        for key, value in RECOMPUTE.items():
            setattr(policy.module.config, key, value)

    loss_config = LossConfig()
    prepared: dict[int, tuple[list[Any], list[torch.Tensor]]] = {}

    def step(rows: list[Row]) -> None:
        if id(rows) not in prepared:  # once per set of rows (in the warm-up): micro-batches and old log-probs
            batches = [row_micro_batch(row) for row in rows]
            prepared[id(rows)] = batches, compute_logprobs(policy, batches, temperature=1.0)
        batches, old_logprobs = prepared[id(rows)]
        train_minibatch(policy, batches, old_logprobs, None, loss_config, temperature=1.0)

    return Trainer(step, enable_recompute)


RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
"""megatron-core's full activation recomputation (`policy.megatron_cfg.transformer` keys; needs CUDA)."""


def megatron_ddp(opts: Options, data_parallel: int) -> dict[str, Any]:
    """The `policy.megatron_cfg.ddp` keys the Megatron path runs with: with data parallelism, the distributed
    optimizer and (where asked) the overlapped parameter all-gather; the trainer's defaults
    (`grpo.backends.megatron.policy.ddp_settings`) for everything else."""
    if data_parallel == 1:
        return {}
    distributed = opts.distributed_optimizer
    return {"use_distributed_optimizer": distributed, "overlap_param_gather": distributed and opts.overlap_param_gather}


def row_micro_batch(row: Row) -> Any:
    """One packed row as the trainer's `MicroBatch`: every token but each sequence's last predicts the next one,
    with a random advantage of +-1 per position (their values do not change the work)."""
    from hf_mcore_bridge.grpo.algorithm.batching import MicroBatch

    predicted = row.tokens.shape[1] - 1
    generator = torch.Generator().manual_seed(int(row.cu_seqlens[1]))
    advantages = torch.randint(0, 2, (1, predicted), generator=generator).float() * 2 - 1
    return MicroBatch(
        tokens=row.tokens,
        position_ids=row.positions,
        mask=row.loss_mask[:, :predicted],
        engine_logprobs=torch.zeros(1, predicted, device=row.tokens.device),
        advantages=advantages.to(row.tokens.device),
        cu_seqlens=row.cu_seqlens,
        max_seqlen=max(row.lengths),
    )


def hf_model(shape: dict[str, Any], opts: Options, device: torch.device) -> torch.nn.Module:
    """The transformers model of `shape`, randomly initialised on `device`, fp32 parameters (master weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in shape.items() if k not in ("architectures", "model_type")}
    config = AutoConfig.for_model(shape["model_type"], **fields)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=opts.hf_attention)
    return model.train()


def _hf_loss(model: torch.nn.Module, row: Row) -> torch.Tensor:
    return model(input_ids=row.tokens, position_ids=row.positions, labels=row.hf_labels).loss


def dtensor_layouts(
    opts: Options, world: int, shape: dict[str, Any], attentions: tuple[str, ...] = ("sdpa", "flex_attention")
) -> list[DTensorLayout]:
    """The DTensor configurations to measure: `--dtensor-search auto` tries FSDP2 over every rank with gradients
    reduced per micro-batch and (with more than one rank) once per step, TP over every rank where the heads and FFN
    divide, each with every attention of `attentions` (flex attention trains on CUDA only); `off` the single
    `--hf-attention` FSDP2 configuration."""
    if opts.dtensor_search == "off":
        return [DTensorLayout(attention=opts.hf_attention)]
    _, _, heads, groups, _, ffn, _ = _dims(shape)
    tps = [1] + [world] * (world > 1 and not (heads % world or groups % world or ffn % world))
    layouts = []
    for tp in tps:
        for defer in (False, True) if world // tp > 1 else (False,):
            layouts += [DTensorLayout(tp, defer, attention) for attention in attentions]
    return layouts


def build_dtensor(shape: dict[str, Any], opts: Options, recompute: bool, device: torch.device) -> Trainer:
    """The trainer's own DTensor policy (`grpo.backends.dtensor.policy.build_dtensor_policy` on a randomly
    initialised HF model) stepped by its own `train_minibatch` (the GRPO loss) over packed rows, in
    `opts.dtensor_layout`."""
    from hf_mcore_bridge.grpo.algorithm.losses import LossConfig
    from hf_mcore_bridge.grpo.backends.dtensor.config import DTensorConfig
    from hf_mcore_bridge.grpo.backends.dtensor.policy import build_dtensor_policy

    layout = opts.dtensor_layout
    settings = DTensorConfig(
        enabled=True,
        tensor_parallel_size=layout.tp,
        data_parallel_shard_size=dist.get_world_size() // layout.tp,
        activation_checkpointing=recompute,
        defer_gradient_sync=layout.defer_sync,
        lr=1e-5,
        weight_decay=0.0,
        clip_grad=1.0,
    )
    model = hf_model(shape, replace(opts, hf_attention=layout.attention), device)
    policy = build_dtensor_policy(None, settings, _dtype(opts), 1000, False, model=model)
    loss_config = LossConfig()
    prepared: dict[int, tuple[list[Any], list[torch.Tensor]]] = {}

    def step(rows: list[Row]) -> None:
        if id(rows) not in prepared:  # once per set of rows (in the warm-up): micro-batches and old log-probs
            batches = [row_micro_batch(row) for row in rows]
            prepared[id(rows)] = batches, policy.compute_logprobs(batches, temperature=1.0)
        batches, old_logprobs = prepared[id(rows)]
        policy.train_minibatch(batches, old_logprobs, None, loss_config, temperature=1.0)

    return Trainer(step)  # FSDP2 wraps the checkpointed layers when sharding: a rebuild


def build_hf(shape: dict[str, Any], opts: Options, recompute: bool, device: torch.device) -> Trainer:
    """The HF model on this rank's device alone, autocast to the compute dtype, torch AdamW."""
    model = hf_model(shape, opts, device)

    def enable_recompute() -> None:  # transformers 5.24 renamed gradient_checkpointing_enable
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable({"use_reentrant": False})  # the kwargs dict comes first under either name

    if recompute:
        enable_recompute()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    dtype = _dtype(opts)

    def step(rows: list[Row]) -> None:
        for row in rows:
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                loss = _hf_loss(model, row) / len(rows)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return Trainer(step, enable_recompute)


BUILDERS: dict[str, Callable[[dict[str, Any], Options, bool, torch.device], Trainer]] = {
    "megatron": build_megatron,
    "dtensor": build_dtensor,
    "hf": build_hf,
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def progress(text: str) -> None:
    """One line of progress from rank 0 (long configurations take minutes)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"  [{time.strftime('%H:%M:%S')}] {text}", flush=True)


def time_steps(step: Step, rows: list[Row], opts: Options, device: torch.device) -> float:
    """Mean seconds per iteration over `opts.iters` iterations run back to back (after `opts.warmup` untimed
    ones), the device synchronised only before the first and after the last, as in training: work an iteration
    leaves in flight (an asynchronous parameter all-gather) overlaps the next one and is still counted."""
    start = time.perf_counter()
    for _ in range(opts.warmup):
        step(rows)
    _sync(device)
    progress(f"warm-up {time.perf_counter() - start:.1f} s; timing {opts.iters} iterations")
    start = time.perf_counter()
    for _ in range(opts.iters):
        step(rows)
    _sync(device)
    return (time.perf_counter() - start) / opts.iters


def _peak_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # CPU: the process's peak RSS (KiB)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


@dataclass(frozen=True)
class _Placement:
    """How a path lays its rows over the ranks taking part."""

    layout: str
    gpus: int
    row_seed: int
    """Seed of this rank's rows (equal within a TP group, different across data-parallel ranks)."""
    share: int
    """Ranks training the same rows (TP, CP), which count their tokens and FLOPs once."""


def _placement(path: str, opts: Options) -> _Placement:
    from megatron.core import parallel_state

    world = dist.get_world_size()
    if path == "megatron":
        tp = parallel_state.get_tensor_model_parallel_world_size()
        cp = parallel_state.get_context_parallel_world_size()
        dp_rank = parallel_state.get_data_parallel_rank()
        layout = (f"TP{tp} SP" if tp > 1 else "TP1") + f" CP{cp}" * (cp > 1)
        dp = parallel_state.get_data_parallel_world_size()
        if dp > 1:
            ddp = megatron_ddp(opts, dp)
            layout += f" DP{dp}" + " dist-opt" * ddp["use_distributed_optimizer"]
            layout += " overlap-gather" * ddp["overlap_param_gather"]
        return _Placement(layout, world, opts.seed + 1000 * dp_rank, tp * cp)
    if path == "dtensor":
        tp = opts.dtensor_layout.tp
        return _Placement(opts.dtensor_layout.label(world), world, opts.seed + 1000 * (dist.get_rank() // tp), tp)
    return _Placement("1 GPU, autocast", 1, opts.seed, 1)  # a world of its own, one rank


def micro_batches(opts: Options, seq_len: int) -> int:
    """Rows per rank and optimizer step at this row length."""
    return opts.micro_batches or max(1, opts.tokens_per_step // seq_len)


def _measure(
    shape_name: str, seq_len: int, path: str, step: Step, opts: Options, place: _Placement, device: torch.device
) -> Result:
    shape = shape_config(shape_name)
    rows = [
        make_row(seq_len, shape["vocab_size"], opts.doc_len, place.row_seed + 10 * m, device)
        for m in range(micro_batches(opts, seq_len))
    ]
    times = torch.tensor([time_steps(step, rows, opts, device)], dtype=torch.float64, device=device)
    counts = torch.tensor(
        [sum(row_flops(shape, r.lengths) for r in rows) / place.share, len(rows) * seq_len / place.share],
        dtype=torch.float64,
        device=device,
    )
    peak = torch.tensor([_peak_gib(device)], dtype=torch.float64, device=device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # an iteration ends when the slowest rank does
    dist.all_reduce(counts)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    step_s = float(times)
    flops, tokens = counts.tolist()
    if opts.profile:
        summary = profile_call(lambda: step(rows), f"{shape_name} @ {seq_len} {path}")
        if dist.get_rank() == 0:
            print(summary, flush=True)
    return Result(
        shape=shape_name,
        seq_len=seq_len,
        path=path,
        layout=place.layout,
        gpus=place.gpus,
        status="ok",
        step_s=step_s,
        tokens_per_iter=round(tokens),
        tokens_per_s=tokens / step_s,
        tokens_per_s_per_gpu=tokens / step_s / place.gpus,
        micro_batches=len(rows),
        flops_per_iter=flops,
        mfu=flops / step_s / (place.gpus * H200_BF16_PEAK),
        peak_mem_gib=float(peak),
    )


def _agree(ok: bool, device: torch.device) -> bool:
    """Whether every rank succeeded."""
    flag = torch.tensor([1.0 if ok else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _allocated_gib(device: torch.device) -> float:
    return torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0


def predicted_oom(
    previous_peak_gib: float, previous_len: int, static_gib: float, seq_len: int, total_gib: float
) -> bool:
    """Whether rows of `seq_len` tokens are predicted to exceed 90% of the device's memory without recomputation:
    the memory above `static_gib` (what the built model held before its first step) at the previous, shorter row
    length, scaled with the row length. Optimizer state created at the first step counts as activations, so the
    prediction errs towards recomputation."""
    activations = max(0.0, previous_peak_gib - static_gib)
    return static_gib + activations * seq_len / previous_len > 0.9 * total_gib


def _predicted_oom(previous: Result | None, static_gib: float, seq_len: int, device: torch.device) -> bool:
    """`predicted_oom` on this rank's figures, agreed over the world (any rank's prediction counts)."""
    if device.type != "cuda" or previous is None or previous.status != "ok" or previous.recompute:
        return False
    total_gib = torch.cuda.get_device_properties(device).total_memory / 2**30
    predicted = predicted_oom(previous.peak_mem_gib, previous.seq_len, static_gib, seq_len, total_gib)
    return not _agree(not predicted, device)


def run_path(shape_name: str, path: str, opts: Options, place: _Placement, device: torch.device) -> list[Result]:
    """Every row length of one path on one shape. With `--recompute auto`, a row length predicted not to fit (from
    the previous length's peak memory, `predicted_oom`) starts with activation recomputation, turned on in the
    built model where the path can (`Trainer.enable_recompute`), else in a rebuilt one; one that runs out of memory
    anyway is retried with it in a rebuilt model; recomputation is then kept for the longer rows."""
    shape = shape_config(shape_name)
    recompute = opts.recompute == "on"
    trainer: Trainer | None = None
    static_gib = 0.0
    results: list[Result] = []
    for seq_len in sorted(opts.seq_lens):
        result = None
        previous = results[-1] if results else None
        if opts.recompute == "auto" and not recompute and _predicted_oom(previous, static_gib, seq_len, device):
            recompute = True  # an out-of-memory attempt could leave ranks apart in a collective: avoid it
            if trainer is not None and trainer.enable_recompute is not None:
                trainer.enable_recompute()
                progress(f"{shape_name} {path}: recomputation turned on for {seq_len}-token rows")
            else:
                trainer = None
                _free(device)
        for attempt in range(2):
            failure = ""
            try:
                if trainer is None:
                    start = time.perf_counter()
                    trainer = BUILDERS[path](shape, opts, recompute, device)
                    static_gib = _allocated_gib(device)
                    progress(
                        f"{shape_name} {path}{' with recomputation' if recompute else ''}: built in "
                        f"{time.perf_counter() - start:.0f} s ({static_gib:.1f} GiB on the device)"
                    )
                measured = _measure(shape_name, seq_len, path, trainer.step, opts, place, device)
                result = replace(measured, recompute=recompute)
            except Exception as err:  # reported per configuration; the run goes on
                failure = "OOM" if _is_oom(err) else f"error: {type(err).__name__}: {str(err).splitlines()[0][:120]}"
            if not _agree(not failure, device):
                failure = failure or "OOM elsewhere"
            if not failure:
                break
            progress(f"{shape_name} @ {seq_len} {path}: {failure}")
            trainer = None  # a model that ran out of memory mid-step is dropped whole
            _free(device)
            if not (failure.startswith("OOM") and opts.recompute == "auto" and not recompute and attempt == 0):
                break
            recompute = True
        if result is None:
            status = failure or "OOM"
            rows = micro_batches(opts, seq_len)
            result = Result(shape_name, seq_len, path, place.layout, place.gpus, status, recompute, rows)
        results.append(result)
    del trainer
    _free(device)
    return results


def bench_rank(shape_name: str, path: str, opts: Options, out: str) -> None:
    """Rank body (inside `world.run_world`): one path on one shape; rank 0 writes its results to `out`."""
    from hf_mcore_bridge.megatron.cpu_patches import apply_cpu_training_workarounds
    from hf_mcore_bridge.megatron.world import device as rank_device

    apply_cpu_training_workarounds()  # a no-op on CUDA
    if path == "dtensor":  # every configuration in this world, one after another
        results = []
        attentions = ("sdpa", "flex_attention") if rank_device().type == "cuda" else ("sdpa",)
        for layout in dtensor_layouts(opts, dist.get_world_size(), shape_config(shape_name), attentions):
            layout_opts = replace(opts, dtensor_layout=layout)
            progress(f"{shape_name} dtensor: {layout.label(dist.get_world_size())}")
            results += run_path(shape_name, path, layout_opts, _placement(path, layout_opts), rank_device())
    else:
        results = run_path(shape_name, path, opts, _placement(path, opts), rank_device())
    if dist.get_rank() == 0:
        for line in format_table(results).splitlines()[1:]:
            print(f"measured: {line}", flush=True)
        Path(out).write_text(json.dumps([asdict(r) for r in results]))


def run(opts: Options, nproc: int, on_results: Callable[[list[Result]], None] | None = None) -> list[Result]:
    """Measure every shape and path, each (shape, path) in a world of its own (`nproc` ranks, NCCL on GPUs, gloo
    on CPU; one rank for the one-GPU hf path), so nothing one leaves allocated (a megatron-core model dropped after
    an 8B run kept its memory in one process: the next path then ran out) weighs on the next. Calls
    `on_results` with the results so far after each world; returns them all."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # long rows fragment memory
    tp = nproc if opts.megatron_parallel == "tp" else 1
    cp = nproc if opts.megatron_parallel == "cp" else 1
    results: list[Result] = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "results.json"

        def world(path: str, layout: Layout, size: int, world_opts: Options) -> list[Result]:
            run_world(bench_rank, layout, shape_name, path, world_opts, str(out), world=size)
            measured = [Result(**r) for r in json.loads(out.read_text())]
            results.extend(measured)
            if on_results is not None:
                on_results(results)
            return measured

        for shape_name in opts.shapes:
            for path in opts.paths:
                if path == "hf":
                    world(path, Layout(), 1, opts)
                    continue
                measured = world(path, Layout(tp=tp, cp=cp) if path == "megatron" else Layout(tp=tp), nproc, opts)
                if path == "megatron" and opts.megatron_parallel == "auto" and nproc > 1:
                    again = tuple(r.seq_len for r in measured if r.recompute or r.status != "ok")
                    if again:
                        progress(f"{shape_name} megatron: {', '.join(map(str, again))}-token rows at TP{nproc} SP")
                        world(path, Layout(tp=nproc), nproc, replace(opts, seq_lens=again))
    return results


def format_table(results: list[Result]) -> str:
    header = (
        f"{'shape':<12}{'tokens/row':>11}{'rows/step':>10}  {'path':<9}{'layout':<38}{'GPUs':>5}{'recomp':>7}"
        f"{'step s':>9}"
        f"{'tokens/s':>11}{'tok/s/GPU':>11}{'MFU':>7}{'peak GiB':>10}  status"
    )
    lines = [header]
    for r in results:
        if r.status == "ok":
            numbers = (
                f"{r.step_s:>9.3f}{r.tokens_per_s:>11.0f}{r.tokens_per_s_per_gpu:>11.0f}{r.mfu * 100:>6.1f}%"
                f"{r.peak_mem_gib:>10.1f}"
            )
        else:
            numbers = f"{'-':>9}{'-':>11}{'-':>11}{'-':>7}{'-':>10}"
        recompute = "yes" if r.recompute else "no"
        lines.append(
            f"{r.shape:<12}{r.seq_len:>11}{r.micro_batches:>10}  {r.path:<9}{r.layout:<38}{r.gpus:>5}{recompute:>7}"
            f"{numbers}  {r.status}"
        )
    return "\n".join(lines)


def fastest(results: list[Result]) -> dict[tuple[str, int, str], Result]:
    """The fastest successful result per (shape, row length, path): a path measured at two layouts counts once."""
    best: dict[tuple[str, int, str], Result] = {}
    for r in results:
        key = (r.shape, r.seq_len, r.path)
        if r.status == "ok" and (key not in best or r.tokens_per_s_per_gpu > best[key].tokens_per_s_per_gpu):
            best[key] = r
    return best


def ratios(results: list[Result]) -> list[str]:
    """Megatron's tokens/s per GPU over the DTensor path's, per shape and row length (each at its fastest layout)."""
    by_key = fastest(results)
    lines = []
    for shape, seq_len in dict.fromkeys((r.shape, r.seq_len) for r in results):
        megatron, dtensor = by_key.get((shape, seq_len, "megatron")), by_key.get((shape, seq_len, "dtensor"))
        if megatron and dtensor:
            ratio = megatron.tokens_per_s_per_gpu / dtensor.tokens_per_s_per_gpu
            lines.append(
                f"{shape} @ {seq_len}: Megatron / DTensor tokens/s per GPU = {ratio:.2f}x (each at its fastest: "
                f"Megatron {megatron.layout}, DTensor {dtensor.layout})"
            )
    return lines


def _csv(kind: Callable[[str], Any]) -> Callable[[str], tuple]:
    return lambda text: tuple(kind(part) for part in text.split(",") if part)


def parse_args(argv: list[str] | None = None) -> tuple[Options, int, Path | None]:
    defaults = Options()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", type=_csv(str), default=defaults.shapes, help="comma-separated SHAPES keys")
    parser.add_argument("--seq-lens", type=_csv(int), default=defaults.seq_lens, help="tokens per packed row")
    parser.add_argument("--paths", type=_csv(str), default=defaults.paths, help="megatron,dtensor,hf")
    parser.add_argument("--nproc", type=int, default=max(1, torch.cuda.device_count()), help="ranks (one per GPU)")
    parser.add_argument("--warmup", type=int, default=defaults.warmup, help="untimed iterations")
    parser.add_argument("--iters", type=int, default=defaults.iters, help="timed iterations (mean reported)")
    parser.add_argument(
        "--micro-batches",
        type=int,
        default=defaults.micro_batches,
        help="rows per rank and optimizer step (0: --tokens-per-step / row length)",
    )
    parser.add_argument(
        "--tokens-per-step", type=int, default=defaults.tokens_per_step, help="tokens per rank and optimizer step"
    )
    parser.add_argument(
        "--megatron-parallel",
        choices=("auto", "dp", "tp", "cp"),
        default=defaults.megatron_parallel,
        help="auto: dp, then TP=nproc for row lengths that needed recomputation under dp",
    )
    parser.add_argument(
        "--distributed-optimizer",
        action=argparse.BooleanOptionalAction,
        default=defaults.distributed_optimizer,
        help="Megatron with data parallelism: megatron-core's distributed optimizer",
    )
    parser.add_argument(
        "--overlap-param-gather",
        action=argparse.BooleanOptionalAction,
        default=defaults.overlap_param_gather,
        help="Megatron, distributed optimizer: overlap the parameter all-gather with the next forward",
    )
    parser.add_argument("--recompute", choices=("off", "on", "auto"), default=defaults.recompute)
    parser.add_argument("--hf-attention", default=defaults.hf_attention, help="transformers attn_implementation")
    parser.add_argument(
        "--dtensor-search",
        choices=("auto", "off"),
        default=defaults.dtensor_search,
        help="auto: FSDP2 and TP, per-micro-batch and deferred gradient sync, sdpa and flex; the fastest compared",
    )
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default=defaults.dtype)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--profile", action="store_true", help="profile one more iteration of each; print a summary")
    parser.add_argument("--lora-rank", type=int, default=0, help="megatron path: train LoRA adapters of this rank")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--tiny", action="store_true", help="tiny shape and rows, fp32, one rank (CPU smoke test)")
    args = parser.parse_args(argv)
    unknown = set(args.paths) - set(PATHS)
    if unknown:
        parser.error(f"unknown paths {sorted(unknown)}; choose from {', '.join(PATHS)}")
    opts = Options(
        shapes=args.shapes,
        seq_lens=args.seq_lens,
        paths=args.paths,
        warmup=args.warmup,
        iters=args.iters,
        micro_batches=args.micro_batches,
        tokens_per_step=args.tokens_per_step,
        megatron_parallel=args.megatron_parallel,
        distributed_optimizer=args.distributed_optimizer,
        overlap_param_gather=args.overlap_param_gather,
        recompute=args.recompute,
        hf_attention=args.hf_attention,
        dtensor_search=args.dtensor_search,
        dtype=args.dtype,
        seed=args.seed,
        profile=args.profile,
        lora_rank=args.lora_rank,
    )
    nproc = args.nproc
    if args.tiny:
        # fp32: megatron-core's bf16 optimizer accepts CUDA tensors only
        opts = replace(opts, shapes=("tiny",), seq_lens=(64, 128), micro_batches=2, warmup=1, iters=2, dtype="fp32")
        nproc = 1
    return opts, nproc, args.json


def main(argv: list[str] | None = None) -> None:
    opts, nproc, json_path = parse_args(argv)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"device: {device} x {nproc}, torch {torch.__version__}; {opts}", flush=True)
    start = time.perf_counter()
    header: dict[str, Any] = {"options": asdict(opts), "nproc": nproc, "device": device}

    def write(results: list[Result], complete: bool) -> None:
        """The JSON as it stands (`"complete": false` until the end: a run stopped early leaves what it got)."""
        if json_path is not None:
            payload = {**header, "complete": complete, "results": [asdict(r) for r in results]}
            json_path.write_text(json.dumps(payload, indent=2))

    results = run(opts, nproc, lambda so_far: write(so_far, False))
    print(format_table(results))
    for line in ratios(results):
        print(line)
    print(f"wall time {time.perf_counter() - start:.0f} s")
    write(results, True)


if __name__ == "__main__":
    main()
