"""Rank functions the tests run inside megatron-core process worlds (`hf_mcore_bridge.megatron.world.run_world`).

Everything here is megatron-core's own machinery: `GPTModel`, `dist_checkpointing.save` / `load`.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed as dist

from hf_mcore_bridge.checkpoint.megatron_dirs import read_common, resolve_checkpoint
from hf_mcore_bridge.convert.config_bridge import from_megatron_args, padded_vocab
from hf_mcore_bridge.convert.layout import Layout
from hf_mcore_bridge.megatron.model import build_gpt_model, load_distributed_checkpoint
from hf_mcore_bridge.megatron.verify import forward_stage
from hf_mcore_bridge.megatron.world import device
from hf_mcore_bridge.models.spec import ModelSpec


def _save(model: torch.nn.Module, directory: Path) -> None:
    from megatron.core import dist_checkpointing

    if dist.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save({"model": model.sharded_state_dict()}, str(directory))
    dist.barrier()


def resave_rank(source: str, destination: str, layout: Layout) -> None:
    """Load a checkpoint at `layout` with megatron-core and save it again with megatron-core."""
    _, checkpoint_dir = resolve_checkpoint(Path(source))
    args = read_common(checkpoint_dir)["args"]
    model_cfg = from_megatron_args(args)
    model = build_gpt_model(model_cfg, layout, torch.float32, args.padded_vocab_size, device=device())
    load_distributed_checkpoint(model, checkpoint_dir)
    _save(model, Path(destination))


def random_save_rank(model_cfg: ModelSpec, layout: Layout, destination: str, tokens: torch.Tensor, out: str):
    """A randomly initialised megatron-core GPTModel: saved by megatron-core, and its logits on `tokens`."""
    random_save_ranks([(model_cfg, destination, out)], layout, tokens)


def random_save_ranks(jobs: list[tuple[ModelSpec, str, str]], layout: Layout, tokens: torch.Tensor) -> None:
    """`random_save_rank` for several (model, destination, logits file) in one world."""
    for model_cfg, destination, out in jobs:
        _random_save(model_cfg, layout, destination, tokens, out)


def _random_save(model_cfg: ModelSpec, layout: Layout, destination: str, tokens: torch.Tensor, out: str) -> None:
    torch.manual_seed(1234)
    model = build_gpt_model(model_cfg, layout, torch.float32, padded_vocab(model_cfg, layout), device=device())
    saved = set(model.state_dict())
    with torch.no_grad():  # norms start at 1 and the router's expert bias at 0: make them differ so that a misplaced
        # one shows in the logits
        for name, tensor in (*model.named_parameters(), *model.named_buffers()):
            if tensor.dim() == 1 and name in saved:
                tensor.copy_(1 + 0.1 * torch.sin(torch.arange(tensor.numel()) + len(name)).to(tensor))
    model.eval()
    _save(model, Path(destination))
    logits = forward_stage(model, model_cfg, tokens, torch.float32)
    if logits is not None:
        torch.save(logits, out)


def not_nan(value: float) -> bool:
    return not math.isnan(value)


def legacy_load_rank(root: str, layout: Layout, tokens: torch.Tensor, out: str) -> None:
    """Load this rank's legacy file into megatron-core modules with strict=True; logits when not interleaved."""
    legacy_load_ranks([(root, out)], layout, tokens)


def legacy_load_ranks(jobs: list[tuple[str, str]], layout: Layout, tokens: torch.Tensor) -> None:
    """`legacy_load_rank` for several (checkpoint root, logits file) in one world."""
    for root, out in jobs:
        _legacy_load(root, layout, tokens, out)


def _legacy_load(root: str, layout: Layout, tokens: torch.Tensor, out: str) -> None:
    from megatron.core import parallel_state

    from hf_mcore_bridge.convert.legacy_format import FILE_NAME, rank_dirname

    _, checkpoint_dir = resolve_checkpoint(Path(root))
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    state = torch.load(checkpoint_dir / rank_dirname(tp_rank, pp_rank, ep_rank, layout) / FILE_NAME, weights_only=False)
    model_cfg = from_megatron_args(state["args"])
    padded = state["args"].padded_vocab_size
    if layout.vpp:
        for v in range(layout.vpp):
            chunk = build_gpt_model(model_cfg, layout, torch.float32, padded, device=device(), vp_stage=v)
            chunk.load_state_dict(state[f"model{v}"], strict=True)
        return
    model = build_gpt_model(model_cfg, layout, torch.float32, padded, device=device()).eval()
    model.load_state_dict(state["model"], strict=True)
    logits = forward_stage(model, model_cfg, tokens, torch.float32)
    if logits is not None:
        torch.save(logits, out)


def sdpa_rank(model_cfg: ModelSpec, layout: Layout, lengths: list[int], out: str) -> None:
    """One randomly initialised model at `layout`, its core attention either SDPA or megatron-core's own local
    (unfused) attention, same weights. Saved by rank 0, logits gathered over TP:
    - `sdpa` / `local`: logits of each sequence run alone (causal);
    - `packed_<backend>`: the sequences packed into one row by the trainer's own code (`pack_microbatches`, then
      `policy._forward_step`, i.e. `PackedSeqParams` / THD), for each packed attention backend;
    - `logprobs_*`: the trainer's log-probs (`token_logprobs`, vocab-parallel) of the tokens inside each sequence;
    - `grad_diff_<backend>`: max |grad difference| (over ranks) between backward passes of a weighted sum of those
      log-probs, packed (SDPA) vs sequence by sequence (local attention), and `grad_max` for scale; flex only on
      CUDA (`flex_attention` has no CPU backward)."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from hf_mcore_bridge.grpo.algorithm.batching import Rollout, pack_microbatches
    from hf_mcore_bridge.grpo.backends.megatron.policy import _forward_step, token_logprobs
    from hf_mcore_bridge.megatron.model import causal_mask
    from hf_mcore_bridge.megatron.sdpa_attention import SDPAttention

    padded = padded_vocab(model_cfg, layout)
    torch.manual_seed(7)
    sdpa = build_gpt_model(model_cfg, layout, torch.float32, padded, device=device()).eval()
    local = build_gpt_model(model_cfg, layout, torch.float32, padded, device=device(), core_attention="local").eval()
    local.load_state_dict(sdpa.state_dict())
    generator = torch.Generator().manual_seed(8)
    sequences = [torch.randint(0, model_cfg.vocab_size, (n,), generator=generator) for n in lengths]
    weights = [torch.rand(n - 1, generator=generator).to(device()) for n in lengths]
    rollouts = [Rollout(tuple(s[:2].tolist()), tuple(s[2:].tolist()), (0.0,) * (len(s) - 2)) for s in sequences]
    (batch,) = pack_microbatches(rollouts, sum(lengths))
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # packing puts the longest first
    batch = batch.to(device())
    results: dict[str, list[torch.Tensor]] = {"sdpa": [], "local": [], "logprobs_local": []}

    def logprobs_of(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return token_logprobs(logits, tokens, model_cfg.vocab_size, temperature=1.0)[0]

    local_loss = torch.zeros((), device=device())
    for tokens, weight in zip(sequences, weights, strict=True):
        tokens = tokens.to(device())[None]
        positions = torch.arange(tokens.shape[1], device=device())[None]
        with torch.no_grad():
            results["sdpa"].append(gather_from_tensor_model_parallel_region(sdpa(tokens, positions, None))[0])
        logits = local(tokens, positions, causal_mask(tokens.shape[1], device()))
        results["local"].append(gather_from_tensor_model_parallel_region(logits.detach())[0])
        logprobs = logprobs_of(logits, tokens)
        results["logprobs_local"].append(logprobs.detach())
        local_loss = local_loss + (logprobs * weight).sum()
    local_loss.backward()
    local_grads = dict(local.named_parameters())
    start_of = dict(zip(order, batch.cu_seqlens[:-1].tolist(), strict=True))
    for backend in ("dense", "flex"):
        SDPAttention.packed_backend = backend
        sdpa.zero_grad()
        backward = backend == "dense" or torch.cuda.is_available()  # flex_attention has no CPU backward
        with torch.set_grad_enabled(backward):
            logits, _ = _forward_step(lambda b, o: (o, {}), (), iter([batch]), sdpa)
        logprobs = logprobs_of(logits, batch.tokens)
        packed_logits = gather_from_tensor_model_parallel_region(logits.detach())[0]
        results[f"packed_{backend}"] = [packed_logits[start_of[i] : start_of[i] + n] for i, n in enumerate(lengths)]
        # inside a sequence: the predictions of its tokens 1 .. n-1 (not the next sequence's first token)
        mine = [logprobs[start_of[i] : start_of[i] + n - 1] for i, n in enumerate(lengths)]
        results[f"logprobs_{backend}"] = [lp.detach() for lp in mine]
        if not backward:
            continue
        sum((lp * w).sum() for lp, w in zip(mine, weights, strict=True)).backward()
        diff = max((p.grad - local_grads[name].grad).abs().max() for name, p in sdpa.named_parameters())
        diff = torch.as_tensor(diff, device=device())
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
        results[f"grad_diff_{backend}"] = [diff]
    grad_max = max(p.grad.abs().max() for p in local.parameters())
    grad_max = torch.as_tensor(grad_max, device=device())
    dist.all_reduce(grad_max, op=dist.ReduceOp.MAX)
    results["grad_max"] = [grad_max]
    if dist.get_rank() == 0:
        torch.save({k: [t.float().cpu() for t in v] for k, v in results.items()}, out)


def packed_step_sync_rank(model_cfg: ModelSpec, lengths: list[int], out: str) -> None:
    """A bf16 model (under megatron-core's `Float16Module`) trains one packed row through the trainer's
    `_forward_step` twice: the second forward and backward under `torch.cuda.set_sync_debug_mode("error")`, which
    raises at any operation that synchronises the host with the device. Rank 0 saves whether it did."""
    from megatron.core.transformer.module import Float16Module

    from hf_mcore_bridge.grpo.algorithm.batching import Rollout, pack_microbatches
    from hf_mcore_bridge.grpo.backends.megatron.policy import _forward_step

    layout = Layout()
    torch.manual_seed(3)
    gpt = build_gpt_model(model_cfg, layout, torch.bfloat16, padded_vocab(model_cfg, layout), device=device())
    model = Float16Module(gpt.config, gpt)
    generator = torch.Generator().manual_seed(4)
    sequences = [torch.randint(0, model_cfg.vocab_size, (n,), generator=generator) for n in lengths]
    rollouts = [Rollout(tuple(s[:2].tolist()), tuple(s[2:].tolist()), (0.0,) * (len(s) - 2)) for s in sequences]
    (batch,) = pack_microbatches(rollouts, sum(lengths))
    batch = batch.to(device())

    def step() -> None:
        logits, _ = _forward_step(lambda b, o: (o, {}), (), iter([batch]), model)
        logits.float().square().mean().backward()

    step()  # first use: kernels chosen, memory allocated
    torch.cuda.synchronize()
    error = ""
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    except RuntimeError as err:
        error = str(err).splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    if dist.get_rank() == 0:
        Path(out).write_text(error or "no synchronisation")


def mtp_logits_rank(checkpoint: str, layout: Layout, tokens: torch.Tensor, out: str) -> None:
    """A checkpoint loaded into a GPTModel built with its multi-token-prediction layers (every tensor must load), run
    on `tokens` with `labels=tokens` (megatron-core computes the MTP layers only with labels); the output layer's
    logits, TP-gathered, in the order megatron-core computes them (MTP layers first, then the model's), saved by
    global rank 0 as a list."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    _, checkpoint_dir = resolve_checkpoint(Path(checkpoint))
    args = read_common(checkpoint_dir)["args"]
    model_cfg = from_megatron_args(args)
    model = build_gpt_model(model_cfg, layout, torch.float32, args.padded_vocab_size, device=device(), mtp=True)
    model.eval()
    load_distributed_checkpoint(model, checkpoint_dir)
    captured: list[torch.Tensor] = []
    # cloned: the loss (vocab-parallel cross entropy) then changes the logits in place
    model.output_layer.register_forward_hook(lambda module, inputs, output: captured.append(output[0].detach().clone()))
    tokens = tokens.to(device())
    positions = torch.arange(tokens.shape[1], device=device()).expand(tokens.shape[0], -1)
    from hf_mcore_bridge.megatron.model import causal_mask

    with torch.no_grad():
        model(tokens, positions, causal_mask(tokens.shape[1], device()), labels=tokens)
    logits = [gather_from_tensor_model_parallel_region(x)[..., : model_cfg.vocab_size] for x in captured]
    if dist.get_rank() == 0 and parallel_state.get_tensor_model_parallel_rank() == 0:
        torch.save([x.transpose(0, 1).float().cpu() for x in logits], out)  # [b, s, vocab] each
