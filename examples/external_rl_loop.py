"""A minimal external RL loop on the bridge API: a megatron-core policy refits an inference engine after every step.

What an RL framework (verl, NeMo-RL, slime) does around its trainer, in a few lines:

1. `AutoBridge.from_pretrained` reads the HF model; `get_model(load_weights=True)` builds this rank's megatron-core
   `GPTModel` for the layout `parallel_state` was initialised with and fills it, each rank reading its slices;
2. the inference engine takes the trainer's weights through vLLM's contract, `engine.load_weights(iterable of
   (hf_name, tensor))`, fed by `bridge.export_hf_weights(models)`: full HF tensors on every rank, gathered over
   TP (this project's embedded engine stands in for vLLM, which does not install here; it shards itself over the
   same TP group);
3. each step: rollouts from the engine, a training step (here a fake one: the weights are perturbed), a refit.

The loop checks what a refit is for: after it, the engine's log-probs of its own greedy samples equal the trainer's
(fp32: within 1e-5); before it, they are the old policy's. Each step prints both gaps.

Run on CPU with a tiny model (built here) in a two-rank gloo world, or on GPUs with `--model DIR`:

    torchrun --nproc-per-node 2 examples/external_rl_loop.py --steps 3
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hf_mcore_bridge import AutoBridge
from hf_mcore_bridge.quiet import quiet_libraries


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="an HF model directory (default: a tiny Llama built here)")
    parser.add_argument("--steps", type=int, default=3, help="training steps")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (the trainer's and the engine's)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    quiet_libraries()  # megatron-core's warnings about optional extensions it does without
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    from megatron.core import parallel_state

    if cuda:
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp)
    if cuda:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(0)
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = args.model or shared_tiny_model(Path(scratch))
        run(AutoBridge.from_pretrained(model_dir), args.steps)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def shared_tiny_model(scratch: Path) -> Path:
    """A tiny random Llama, built by rank 0 into its scratch directory, whose path every rank gets."""
    path = [None]
    if dist.get_rank() == 0:
        from hf_mcore_bridge.models.tiny_models import build_tiny_model

        path = [str(build_tiny_model(scratch / "tiny-llama", "LlamaForCausalLM", seed=0))]
    dist.broadcast_object_list(path, src=0)
    return Path(path[0])


def run(bridge: AutoBridge, steps: int) -> None:
    """Build, load, refit after each (fake) step, and report the engine-vs-trainer log-prob gaps."""
    from megatron.core import parallel_state

    from hf_mcore_bridge.engine import Engine, EngineConfig, SamplingParams

    models = bridge.get_model(dtype=torch.float32, load_weights=True)
    device = next(models[0].parameters()).device
    config = EngineConfig(
        dtype=torch.float32,
        device=str(device),
        max_num_seqs=4,
        max_model_len=64,
        max_num_batched_tokens=64,
        kv_cache_memory_bytes=1 << 20,
    )
    engine = Engine(bridge.hf_config, config, tp_group=parallel_state.get_tensor_model_parallel_group())
    engine.load_weights(bridge.export_hf_weights(models))  # the initial weights, vLLM's `load_weights` contract
    prompts = [[1, 17, 42, 99, 7], [1, 5, 5, 180, 33, 2, 64]]
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    report(f"in sync before training: max |engine - trainer| log-prob = {gap(engine, models, prompts, greedy):.2e}")
    for step in range(1, steps + 1):
        fake_training_step(models, step)
        stale = gap(engine, models, prompts, greedy)
        engine.load_weights(bridge.export_hf_weights(models))  # the refit
        fresh = gap(engine, models, prompts, greedy)
        report(f"step {step}: max |engine - trainer| log-prob before refit = {stale:.2e}, after refit = {fresh:.2e}")


def fake_training_step(models: list[Any], step: int) -> None:
    """Stands in for an optimizer step: every weight moves by seeded noise (the same on every rank, so tensors
    every TP rank holds whole stay identical, as training keeps them)."""
    generator = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for chunk in models:
            for param in chunk.parameters():
                param.add_(0.05 * torch.randn(param.shape, generator=generator).to(param.device))


def gap(engine: Any, models: list[Any], prompts: list[list[int]], params: Any) -> float:
    """Greedy samples from the engine; the largest difference between the engine's log-prob of each sampled token
    and the trainer's (the megatron-core model's forward, logits gathered over TP)."""
    worst = 0.0
    for prompt, output in zip(prompts, engine.generate(prompts, params), strict=True):
        sample = output.samples[0]
        tokens = torch.tensor([prompt + sample.token_ids])
        trainer = trainer_logprobs(models, tokens, vocab=engine.model_config.vocab_size)[len(prompt) - 1 :]
        worst = max(worst, float((trainer - torch.tensor(sample.logprobs, dtype=trainer.dtype)).abs().max()))
    return worst


def trainer_logprobs(models: list[Any], tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """log_softmax of the model's logits, of each next token of `tokens: [1, S]`: `[S - 1]` (one pipeline stage)."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    (model,) = models
    device = next(model.parameters()).device
    tokens = tokens.to(device)
    positions = torch.arange(tokens.shape[1], device=device)[None]
    mask = torch.triu(torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool, device=device), diagonal=1)
    with torch.no_grad():
        logits = gather_from_tensor_model_parallel_region(model(tokens, positions, mask[None, None]))
    logprobs = torch.log_softmax(logits[0, :-1, :vocab].float(), dim=-1)
    return logprobs.gather(-1, tokens[0, 1:, None])[:, 0].cpu()


def report(line: str) -> None:
    if dist.get_rank() == 0:
        print(line, flush=True)


if __name__ == "__main__":
    main()
