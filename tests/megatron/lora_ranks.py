"""The rank function of the LoRA tests, run in a TP2 or EP2 gloo world (`megatron.world.run_world`).

Each case builds the model with `AutoBridge.get_model` (fp32, CPU, loaded from the HF directory), adds adapters
(`megatron.lora.add_lora`), copies in the test's whole A and B per HF module (`set_adapters`), and runs one forward
and backward of the test's loss: sum(logits * weights), logits whole (gathered over the vocabulary). Saved per
case on global rank 0: the logits, every adapter's gradients gathered whole (`full_adapters(grad=True)`, experts'
over the expert-parallel group), which parameters require gradients, the HF weights the adapters name for the
refit (`adapted_weights`), the experts' module and, from each rank, the replicated factors' gradients of the
dense linears (equal on both ranks).

A case may break one thing on purpose (`fault`), for the test to show its comparison fails then:
`scale` (alpha / rank doubled on every adapter), `qkv_rows` (the k and v adapters' output rows of the fused
`linear_qkv` exchanged), `gate_up_rows` (gate's and up's rows of `linear_fc1` exchanged), `experts_swapped` (the
adapters of each rank's first two experts exchanged, on `linear_fc1` and `linear_fc2`), `expert_gate_up` (the gate
and up halves of every expert's `linear_fc1` adapter output exchanged), `expert_tp_rows` (under expert tensor
parallelism, each rank's rows of an expert's `linear_fc1` B a contiguous chunk of [gate; up] instead of its
[gate_r; up_r]).

A case with `dropout` runs its forward and backward in training mode with adapter dropout, records every mask
drawn (on each rank: they must be equal) and then the logits of a forward in eval mode.

A case with `ddp` runs its forward and backward through megatron-core's `DistributedDataParallel` (its buffers laid
out for the distributed optimizer) and then `finalize_model_grads`, as the trainer does; its gradients are read
from DDP's buffers (`main_grad`). That is how a sequence-parallel case (`overrides` `sequence_parallel`) gets the
replicated factors' gradients summed over TP; its fault `sp_unreduced` takes their `sequence_parallel` mark off,
so that they stay this rank's tokens' part.

A case with `context_parallel` 2 re-initialises megatron-core's parallel state of the 2-rank world as CP2 (TP1) and
feeds each rank its two load-balanced chunks of the sequence (chunks r and 3 - r of 4, written out here), causal
attention over the whole sequence across the ranks; its logits are put back in sequence order and the adapters'
gradients summed over the CP ranks (what DDP's reduction over the data x context ranks sums). Such cases come last
(the world stays CP2).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class LoraCase:
    """One model with adapters in the world."""

    name: str
    hf_dir: str
    adapters: str
    """A `torch.save`d dict: HF module name -> (A, B), whole."""
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    fault: str | None = None
    merged: bool = False
    """Also stream the model's HF weights with the adapters merged (`megatron.lora.merged` around the bridge's
    `export_hf_weights`) and record whether every parameter is bit-for-bit restored after; and write the adapters
    as a PEFT directory (`megatron.lora_peft`) at `out_dir/<case>.peft`."""
    optimizer: bool = False
    """Also wrap the model in megatron-core's `DistributedDataParallel`, build its optimizer and record the
    elements of both (they must be the adapters' alone)."""
    overrides: tuple[tuple[str, object], ...] = ()
    """megatron-core config values for `get_model` (`moe_grouped_gemm`, say)."""
    dropout: float = 0.0
    """Adapter dropout: the forward and backward run in training mode inside `dropout_rng`, each adapter's whole
    mask is recorded (`masks`, by HF module name, on every rank), then a forward in eval mode (`eval_logits`)."""
    ddp: bool = False
    """Forward and backward through megatron-core's DDP (distributed-optimizer buffers), then `finalize_model_grads`;
    gradients from DDP's buffers."""
    context_parallel: int = 1
    """2: the world re-initialised as CP2 (TP1) for this case and those after it."""
    checkpoint: bool = False
    """Also save the model's sharded state dict with the adapters set (megatron-core's `dist_checkpointing`, as a
    run's checkpoint holds it) to `out_dir/<case>.ckpt`."""
    eval_forward: bool = False
    """Run the forward (and backward) in eval mode: megatron-core refuses a MoE layer's training forward at tensor
    parallelism > 1 without sequence parallelism; autograd is the same. Also records `expert_norm`: the experts'
    adapter gradient norm as megatron-core's optimizer computes it (the factors it does not count as tensor-parallel
    duplicates, squared norms summed over the expert tensor-parallel group)."""


def _swap_rows(holder: torch.nn.Module, first: int, second: int) -> None:
    """Exchange the output rows of two of a column-parallel holder's projections (same row count)."""
    sizes = [b.shape[0] for b in holder.lora_b]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    assert sizes[first] == sizes[second]
    rows = holder.rows.clone()
    for i, j in ((first, second), (second, first)):
        hit = (holder.rows >= starts[i]) & (holder.rows < starts[i] + sizes[i])
        rows[hit] = holder.rows[hit] - starts[i] + starts[j]
    holder.rows = rows


def _swap_experts(adapters: list) -> None:
    """Exchange the adapters of this rank's first two experts on every adapted expert linear."""
    linears: dict[str, list] = {}
    for holder in (h for h in adapters if h.expert):
        linears.setdefault(holder.names[0].split("[")[0], []).append(holder)
    with torch.no_grad():
        for first, second, *_ in linears.values():
            for mine, theirs in zip((*first.lora_a, *first.lora_b), (*second.lora_a, *second.lora_b), strict=True):
                saved = mine.clone()
                mine.copy_(theirs)
                theirs.copy_(saved)


def _break(adapters: list, fault: str | None, values: dict) -> None:
    if fault == "experts_swapped":
        _swap_experts(adapters)
    if fault == "expert_tp_rows":  # each rank's rows of B a contiguous chunk of [gate; up], not its [gate_r; up_r]
        with torch.no_grad():
            for holder in (h for h in adapters if h.expert and h.gate_up):
                rank, size = holder.tp
                holder.lora_b[0].copy_(values[holder.names[0]][1].chunk(size)[rank])
    for holder in adapters:
        if fault == "expert_gate_up" and holder.expert and holder.names[0].split("[")[0].endswith("gate_up_proj"):
            half = holder.rows.numel() // 2
            holder.rows = torch.cat((holder.rows[half:], holder.rows[:half]))
        if fault == "scale":
            holder.scale *= 2
        if fault == "qkv_rows" and holder.names[0].endswith("q_proj"):
            _swap_rows(holder, 1, 2)
        if fault == "gate_up_rows" and holder.names[0].endswith("gate_proj"):
            _swap_rows(holder, 0, 1)
        if fault == "sp_unreduced":  # the replicated factors' partial gradients left as they are
            for p in (*holder.lora_a, *holder.lora_b):
                p.sequence_parallel = False


def lora_rank(cases: list[LoraCase], tokens: torch.Tensor, weights_path: str, out_dir: str) -> None:
    """Run every case on this rank (see the module docstring); results in `out_dir/<case>.pt` (TP rank 0) and
    `out_dir/<case>.replicated.<rank>.pt`."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from hf_mcore_bridge import AutoBridge
    from hf_mcore_bridge.megatron.lora import adapted_weights, add_lora, full_adapters, merged, set_adapters
    from hf_mcore_bridge.megatron.lora_config import LoraConfig
    from hf_mcore_bridge.megatron.lora_dropout import dropout_rng
    from hf_mcore_bridge.models.parallel_style import Parallel

    loss_weights = torch.load(weights_path)
    batch, seq = tokens.shape
    positions = torch.arange(seq).expand(batch, -1)
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
    for case in cases:
        if case.context_parallel > 1:
            _context_parallel(case.context_parallel)
        held = _held(seq, case.context_parallel)
        bridge = AutoBridge.from_pretrained(case.hf_dir)
        (model,) = bridge.get_model(dtype="float32", load_weights=True, **dict(case.overrides))
        config = LoraConfig(
            enabled=True, rank=case.rank, alpha=case.alpha, target_modules=case.target_modules, dropout=case.dropout
        )
        adapters = add_lora(model, bridge.model_config, config)
        values = torch.load(case.adapters)
        set_adapters(adapters, values)
        _break(adapters, case.fault, values)
        if case.checkpoint:
            from megatron.core import dist_checkpointing

            directory = Path(out_dir) / f"{case.name}.ckpt"
            directory.mkdir(exist_ok=True)
            dist_checkpointing.save(model.sharded_state_dict(), str(directory))
        masks = _record_masks(adapters) if case.dropout else None
        if case.dropout:
            model.train()
        if case.eval_forward:
            model.eval()
        vocab = bridge.model_config.vocab_size
        module = _ddp(model) if case.ddp else model
        inputs = (tokens, positions, mask) if held is None else (tokens[:, held], positions[:, held], None)
        with dropout_rng(config, step=0, replica=0):
            output = module(*inputs)  # [batch, seq (this CP rank's tokens), vocab / TP]
            logits = gather_from_tensor_model_parallel_region(output)[..., :vocab]
            ((logits * (loss_weights if held is None else loss_weights[:, held])).sum()).backward()
        if case.ddp:
            _finalize(module, adapters)
        if held is not None:
            logits = _in_sequence_order(logits.detach(), held, seq, case.context_parallel)
            _sum_over_context(adapters)
        eval_logits = None
        if case.dropout:
            model.eval()
            with torch.no_grad():
                eval_logits = gather_from_tensor_model_parallel_region(model(tokens, positions, mask))[..., :vocab]
            torch.save(masks, Path(out_dir) / f"{case.name}.masks.{dist.get_rank()}.pt")
        grads = full_adapters(adapters, grad=True)
        expert_norm = _expert_grad_norm(adapters) if case.eval_forward else None
        replicated = {
            name: (a.grad if holder.parallel is Parallel.COLUMN else b.grad)
            for holder in adapters
            if not holder.expert  # each expert-parallel rank holds its own experts
            for name, a, b in zip(holder.names, holder.lora_a, holder.lora_b, strict=True)
        }
        torch.save(replicated, Path(out_dir) / f"{case.name}.replicated.{dist.get_rank()}.pt")
        whole = full_adapters(adapters)  # collective
        if case.merged and dist.get_rank() == 0:
            from hf_mcore_bridge.megatron.lora_peft import write_peft_adapter

            write_peft_adapter(whole, config, Path(out_dir) / f"{case.name}.peft", case.hf_dir)
        stream, restored = None, None
        if case.merged:
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            with merged(model):
                stream = {name: tensor.clone() for name, tensor in bridge.export_hf_weights([model])}
            restored = all(torch.equal(before[n], p) for n, p in model.named_parameters())
        adapted = adapted_weights(model)  # collective: over the pipeline stages and the expert-parallel group
        if dist.get_rank() == 0:  # TP rank 0; at EP2 both ranks hold whole adapters: one writes
            from megatron.core.transformer.moe.experts import SequentialMLP

            trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
            result = {"logits": logits.detach(), "grads": grads, "trainable": trainable, "eval_logits": eval_logits}
            result["adapted"] = adapted
            result["expert_norm"] = expert_norm
            experts = [m for m in model.modules() if isinstance(m, SequentialMLP)]
            # the experts' module, and why GroupedExperts would run SequentialMLP's forward (None: grouped GEMMs)
            result["experts"] = sorted(
                {(type(m).__name__, getattr(m, "sequential_reason", lambda: None)()) for m in experts}
            )
            result |= {"merged": stream, "restored": restored}
            result["optimizer"] = _optimizer_elements(model) if case.optimizer else None
            torch.save(result, Path(out_dir) / f"{case.name}.pt")
        elif case.optimizer:
            _optimizer_elements(model)  # collective


def _context_parallel(cp: int) -> None:
    """megatron-core's parallel state of this world re-initialised as CP `cp` (TP1)."""
    from megatron.core import parallel_state

    if parallel_state.get_context_parallel_world_size() != cp:
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=cp)


def _held(seq: int, cp: int) -> torch.Tensor | None:
    """The sequence positions this CP rank holds, megatron-core's load-balanced layout: chunks r and 2 cp - 1 - r
    of 2 cp (None at CP1)."""
    if cp == 1:
        return None
    from megatron.core import parallel_state

    rank, chunk = parallel_state.get_context_parallel_rank(), seq // (2 * cp)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in (rank, 2 * cp - 1 - rank)])


def _in_sequence_order(logits: torch.Tensor, held: torch.Tensor, seq: int, cp: int) -> torch.Tensor:
    """Every CP rank's logits [batch, held, vocab] put back in sequence order: [batch, seq, vocab]."""
    from megatron.core import parallel_state

    group = parallel_state.get_context_parallel_group()
    parts = [torch.empty_like(logits) for _ in range(cp)]
    places = [torch.empty_like(held) for _ in range(cp)]
    dist.all_gather(parts, logits.contiguous(), group=group)
    dist.all_gather(places, held, group=group)
    whole = logits.new_zeros(logits.shape[0], seq, logits.shape[-1])
    for part, place in zip(parts, places, strict=True):
        whole[:, place] = part
    return whole


def _sum_over_context(adapters: list) -> None:
    """Each adapter gradient summed over the CP ranks, in place."""
    from megatron.core import parallel_state

    for holder in adapters:
        for p in (*holder.lora_a, *holder.lora_b):
            dist.all_reduce(p.grad, group=parallel_state.get_context_parallel_group())


def _ddp(model: torch.nn.Module) -> torch.nn.Module:
    """`model` in megatron-core's DDP, its buffers laid out for the distributed optimizer."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from hf_mcore_bridge.megatron.cpu_patches import apply_cpu_training_workarounds

    apply_cpu_training_workarounds()
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True)
    return DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)


def _finalize(ddp: torch.nn.Module, adapters: list) -> None:
    """megatron-core's `finalize_model_grads`, then each adapter's gradient taken from DDP's buffer."""
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads([ddp])
    for holder in adapters:
        for p in (*holder.lora_a, *holder.lora_b):
            p.grad = p.main_grad.detach().clone()


def _expert_grad_norm(adapters: list) -> float:
    """The norm of the expert adapters' gradients as megatron-core's optimizer takes it: the squares of the factors
    that are not tensor-parallel duplicates (`param_is_not_tensor_parallel_duplicate` with its tensor-parallel
    group), summed over the expert tensor-parallel group (its gradient-statistics group at PP1, EP1)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    group = parallel_state.get_tensor_model_parallel_group()
    factors = [p for h in adapters if h.expert for p in (*h.lora_a, *h.lora_b)]
    squares = torch.zeros(())
    for p in factors:
        if param_is_not_tensor_parallel_duplicate(p, group):
            squares += p.grad.float().pow(2).sum()
    dist.all_reduce(squares, group=parallel_state.get_expert_tensor_parallel_group())
    return float(squares.sqrt())


def _record_masks(adapters: list) -> dict[str, list[torch.Tensor]]:
    """Every whole dropout mask the adapters draw, by HF module name (a fused linear draws one per projection, in
    `names` order), in megatron-core's [seq, batch, width] layout."""
    masks: dict[str, list[torch.Tensor]] = {}
    for holder in adapters:
        draw = holder.whole_keep_mask
        calls = [0]

        def recorded(x: torch.Tensor, holder=holder, draw=draw, calls=calls) -> torch.Tensor:
            mask = draw(x)
            name = holder.names[calls[0] % len(holder.names)]
            calls[0] += 1
            masks.setdefault(name, []).append(mask.detach().clone())
            return mask

        holder.whole_keep_mask = recorded
    return masks


def _optimizer_elements(model: torch.nn.Module) -> dict[str, int]:
    """Elements in megatron-core's DDP gradient buffers and in its optimizer's parameter groups for `model`."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from hf_mcore_bridge.megatron.cpu_patches import apply_cpu_training_workarounds, cuda_type_names

    apply_cpu_training_workarounds()
    ddp = DistributedDataParallel(config=model.config, ddp_config=DistributedDataParallelConfig(), module=model)
    with cuda_type_names():
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3), [ddp])
    in_buffers = sum(p.numel() for buffer in ddp.buffers for p in buffer.params)
    in_optimizer = sum(p.numel() for group in optimizer.param_groups for p in group["params"])
    in_expert_buffers = sum(p.numel() for buffer in ddp.expert_parallel_buffers for p in buffer.params)
    if in_expert_buffers:  # expert parameters: reduced over the expert-data-parallel group
        return {"ddp": in_buffers, "ddp_experts": in_expert_buffers, "optimizer": in_optimizer}
    return {"ddp": in_buffers, "optimizer": in_optimizer}
