"""Rank functions of the context-parallel test worlds.

`cp_rank`: one 4-rank world runs every layout in turn. The reference is CP = 1 as the trainer has always run it
(no split, no gather); each layout re-initialises megatron-core's `parallel_state` in the same world and loads the
same megatron-core checkpoint.

`gather_rank`: the two gathers alone, in a plain torch world (no model, no megatron-core state), on values whose
place in the sequence the test knows.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import torch
import torch.distributed as dist

from hf_mcore_bridge.convert.config_bridge import padded_vocab, transformer_config_kwargs
from hf_mcore_bridge.convert.layout import Layout
from hf_mcore_bridge.grpo.algorithm.batching import (
    MicroBatch,
    pad_sequences_to_multiple,
    pad_to_multiple,
    response_values,
)
from hf_mcore_bridge.grpo.algorithm.losses import LossConfig, grpo_loss
from hf_mcore_bridge.megatron.model import gpt_model, load_distributed_checkpoint
from hf_mcore_bridge.models.spec import ModelSpec

LAYOUTS = {
    "tp1cp1": (Layout(), False),
    "tp1cp2": (Layout(cp=2), False),
    "tp2cp1": (Layout(tp=2), True),
    "tp2cp2": (Layout(tp=2, cp=2), True),
}
"""name -> (layout, sequence parallelism)."""


def _reinit(layout: Layout) -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=layout.tp, context_parallel_size=layout.cp)


def _model(model_cfg: ModelSpec, layout: Layout, sequence_parallel: bool, vocab: int) -> torch.nn.Module:
    from megatron.core.transformer import TransformerConfig

    kwargs = transformer_config_kwargs(model_cfg, layout, torch.float32)
    kwargs.update(use_cpu_initialization=True, sequence_parallel=sequence_parallel)
    return gpt_model(TransformerConfig(**kwargs), model_cfg, vocab)


def _prepared(batch: MicroBatch, layout: Layout, sequence_parallel: bool) -> MicroBatch:
    """The micro-batch as `policy._on_device` pads it for this layout."""
    multiple = layout.tp if sequence_parallel else 1
    if layout.cp > 1:
        batch = pad_sequences_to_multiple(batch, 2 * layout.cp)
        multiple *= 2 * layout.cp
    return pad_to_multiple(batch, multiple)


def cp_rank(model_cfg: ModelSpec, batches: dict[str, MicroBatch], checkpoint: str, out: str) -> None:
    """For every layout of `LAYOUTS` and every micro-batch: the completion tokens' log-probs (the trainer's
    `token_logprobs`), a GRPO loss over them and every parameter's gradient summed over the CP ranks (as DDP
    reduces it), saved by the ranks of CP rank 0 and DP rank 0 as `<out>/<layout>.tp<r>.pt`."""
    from megatron.core import dist_checkpointing, parallel_state

    from hf_mcore_bridge.grpo.backends.megatron.policy import cp_inputs, token_logprobs
    from hf_mcore_bridge.megatron.sdpa_attention import packed_seq_params

    vocab = padded_vocab(model_cfg, Layout(tp=2))
    torch.manual_seed(11)
    base = _model(model_cfg, Layout(), False, vocab)
    with torch.no_grad():  # norms away from 1, so that a misplaced norm would show
        for name, param in base.named_parameters():
            if param.dim() == 1:
                param.copy_(1 + 0.1 * torch.sin(torch.arange(param.numel()) + len(name)).to(param))
    if dist.get_rank() == 0:
        Path(checkpoint).mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save({"model": base.sharded_state_dict()}, checkpoint)
    dist.barrier()
    del base
    for name, (layout, sequence_parallel) in LAYOUTS.items():
        _reinit(layout)
        model = _model(model_cfg, layout, sequence_parallel, vocab)
        load_distributed_checkpoint(model, Path(checkpoint))
        results: dict[str, object] = {}
        for key, original in batches.items():
            batch = _prepared(original, layout, sequence_parallel)
            tokens, positions = cp_inputs(batch)
            packed = None if batch.cu_seqlens is None else packed_seq_params(batch.cu_seqlens, batch.max_seqlen)
            model.zero_grad(set_to_none=True)
            logits = model(tokens, positions, None, packed_seq_params=packed)
            logprobs = token_logprobs(logits, batch.tokens, model_cfg.vocab_size, 1.0, batch.cu_seqlens)
            old = logprobs.detach() - 0.05 * batch.mask  # ratios away from 1, inside the clip range
            count = batch.mask.sum()
            loss, _ = grpo_loss(logprobs, old, batch.advantages, batch.mask, count, LossConfig())
            loss.backward()
            grads = {}
            for pname, param in model.named_parameters():
                grad = param.grad.clone()
                if layout.cp > 1:  # what DDP's reduction over data x context ranks sums
                    dist.all_reduce(grad, group=parallel_state.get_context_parallel_group())
                if getattr(param, "sequence_parallel", False):  # as finalize_model_grads sums them over TP
                    dist.all_reduce(grad, group=parallel_state.get_tensor_model_parallel_group())
                grads[pname] = grad
            results[key] = {
                "logprobs": response_values(logprobs.detach(), batch),
                "loss": loss.detach(),
                "grads": grads,
            }
        if parallel_state.get_context_parallel_rank() == 0 and parallel_state.get_data_parallel_rank() == 0:
            torch.save(results, Path(out) / f"{name}.tp{parallel_state.get_tensor_model_parallel_rank()}.pt")
        dist.barrier()


GATHER_CASES = {"plain": (0, 16), "packed": (0, 4, 12, 16)}
"""name -> the row's `cu_seqlens` in units of 2 x CP tokens (each sequence a multiple of 2 x CP), for `gather_rank`."""


def held_positions(cu_seqlens: list[int], cp: int, rank: int) -> list[int]:
    """The global positions CP rank `rank` holds, written out from megatron-core's load-balanced layout (each
    sequence cut into 2 x CP chunks, the rank holding chunk `rank` then chunk `2 x CP - 1 - rank`), independently of
    `context_parallel.cp_positions`."""
    held = []
    for start, stop in itertools.pairwise(cu_seqlens):
        chunk = (stop - start) // (2 * cp)
        for index in (rank, 2 * cp - 1 - rank):
            held += range(start + index * chunk, start + (index + 1) * chunk)
    return held


def gather_inputs(cp: int, case: str) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """`cu_seqlens` of the case at `cp`, per-token values `[2, T]` (distinct) and gradient weights `[2, T]`, whole
    numbers in float64, so that sums over ranks are exact whatever their order."""
    cu = [2 * cp * n for n in GATHER_CASES[case]]
    total = cu[-1]
    values = torch.arange(2 * total, dtype=torch.float64).reshape(2, total) + 1
    weights = torch.randint(-50, 51, (2, total), generator=torch.Generator().manual_seed(cp)).double()
    return cu, values, weights


def gather_rank(out: str) -> None:
    """Both CP gathers of `context_parallel` over a CP4 group (the whole 4-rank world) and two CP2 groups (ranks
    {0, 1} and {2, 3}), on a plain row and on a packed row (`GATHER_CASES`): each rank hands in the values of the
    tokens it holds (`held_positions`) and saves, per `(cp, case)`, what `gather_in_order` returns for `[2, t]`
    values along dim 1 (as `token_logprobs` gathers log-probs) and `gather_sequence` for `[t, 2]` along dim 0 (as
    `cp_attention` gathers keys and values), with the gradient each sends back to this rank's input when this CP
    rank weights the output by `weights * (cp rank + 1)`. Saved as `<out>/rank<r>.pt` (on the host)."""
    from hf_mcore_bridge.megatron.context_parallel import gather_in_order, gather_sequence
    from hf_mcore_bridge.megatron.world import device

    world = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group, in the same order
    groups = {4: dist.group.WORLD, 2: pairs[world // 2]}
    results = {}
    for cp, group in groups.items():
        rank = dist.get_rank(group)
        for case in GATHER_CASES:
            cu, values, weights = gather_inputs(cp, case)
            values, weights = values.to(device()), weights.to(device())  # NCCL where there is CUDA
            mine = values[:, held_positions(cu, cp, rank)]
            scale = rank + 1
            local = mine.clone().requires_grad_()
            in_order = gather_in_order(local, group, torch.tensor(cu), dim=1)
            (in_order * weights * scale).sum().backward()
            local_t = mine.T.clone().requires_grad_()
            sequence = gather_sequence(local_t, group, torch.tensor(cu), dim=0)
            (sequence * weights.T * scale).sum().backward()
            results[cp, case] = {
                "in_order": in_order.detach().cpu(),
                "in_order_grad": local.grad.cpu(),
                "sequence": sequence.detach().cpu(),
                "sequence_grad": local_t.grad.cpu(),
                "cp_rank": rank,
            }
    torch.save(results, Path(out) / f"rank{world}.pt")
