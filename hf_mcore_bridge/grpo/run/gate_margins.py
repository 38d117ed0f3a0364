"""The log-prob gate measured: `token_mult_prob_error` of a correct refit and of each refit fault, on a run's step 1.

`measure_gate_rank` runs on every rank of a GRPO world (`run.ranks.start_world`) with the run's own pieces: the policy
backend, the rank's engine, `trainer._refit` (with its transfer check), `trainer._generate_rollouts` for step 1 and
`trainer._train_step`'s gate, which sees the rollouts' engine-vs-trainer `token_mult_prob_error` before any optimizer
step. For each fault of `refit.faults` the engine is refitted through the faulty stream, step 1's rollouts are drawn
from it, and the gate's value is recorded and the step stopped before its update, so every measurement starts from
the same trainer weights. Then the correct refit's step 1 trains for real, and a stale copy is measured: the engine
keeps the pre-step weights (no refit) and the probe prompt is scored (`stale_probe`), then a refit whose engine copy
is overwritten by the pre-step weights after loading runs through the transfer check (`stale_check`: 1 when the
check stopped it).

Every fault is drawn with the same seed, so the correct and faulty engines sample from the same prompts; the gate's
value depends on the sampling temperature, the number of tokens and the model. Rank 0 writes the results as JSON.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from hf_mcore_bridge.errors import BridgeError
from hf_mcore_bridge.grpo.refit.faults import FAULTS, inject

__all__ = ["measure_gate", "measure_gate_rank", "measurement_config"]


def measurement_config(
    model: Path,
    precision: str,
    log_dir: Path,
    prompts: int = 4,
    generations: int = 4,
    max_new_tokens: int = 48,
    temperature: float = 1.0,
) -> Any:
    """The run measured: `model` at one rank, `precision` `fp32`, `bf16` or `fp8` (FP8 rollouts, a bf16 trainer),
    step 1's `prompts` x `generations` samples of the built-in `arithmetic` task (chat-templated where the tokenizer
    has a template). The gate's value is a mean of exp(|gap|) over the sampled tokens, dominated by the few tokens a
    wrong engine samples that the trainer finds unlikely: with a few hundred tokens it is steady (the defaults here),
    with a few dozen a fault may move it far less (SmolLM2, FP8, gate/up exchanged: 1.58 over 8 samples of up to 24
    tokens against 3284 over 16 of up to 48)."""
    from hf_mcore_bridge.grpo.run.config import config_from_dict

    return config_from_dict(
        {
            "policy": {
                "model_path": str(model),
                "dtype": "fp32" if precision == "fp32" else "bf16",
                "megatron_cfg": {"micro_batch_size": prompts * generations},
            },
            "grpo": {
                "num_prompts_per_step": prompts,
                "num_generations_per_prompt": generations,
                "max_num_steps": 1,
                "on_logprob_mismatch": "warn",
            },
            "generation": {
                "max_new_tokens": max_new_tokens,
                "temperature": temperature,
                "precision": "fp8" if precision == "fp8" else "dtype",
                "max_model_len": 256,
            },
            "data": {"task": "arithmetic"},
            "logger": {"log_dir": str(log_dir), "print_progress": False},
        }
    )


def measure_gate(config: Any, faults: list[str], work: Path) -> dict[str, Any]:
    """Prepare the run as `train_grpo` does (stop tokens, the policy converted), run `measure_gate_rank` in its
    world and return what rank 0 wrote: `values` (`correct`, each fault, `stale_probe`, `stale_check`) and
    `completion_tokens`."""
    from hf_mcore_bridge.grpo.data.chat import with_template_stop_ids
    from hf_mcore_bridge.grpo.data.stop_tokens import with_stop_token_ids
    from hf_mcore_bridge.grpo.run.ranks import start_world
    from hf_mcore_bridge.grpo.run.trainer import prepare_run

    config.validate()
    explicit_stops = config.generation.stop_token_ids is not None
    config = with_stop_token_ids(config)
    prepared = prepare_run(config)
    config = with_template_stop_ids(config, prepared.tokenizer_file, add_end_of_turn=not explicit_stops)
    out = work / "gate_margins.json"
    start_world(prepared.plan.dims, measure_gate_rank, config, prepared, list(faults), str(out))
    return json.loads(out.read_text())


class _Measured(Exception):
    """Raised by the measuring gate: the step stops before its optimizer step."""

    def __init__(self, error: float) -> None:
        super().__init__(error)
        self.error = error


def _with_fault(policy: Any, fault: str | None, hf_config: dict[str, Any]) -> Callable[[], None]:
    """Make the policy's refit streams carry `fault` (None: correct); returns the undo."""
    originals = {name: getattr(policy, name) for name in ("hf_weights", "shard_local_weights")}

    def faulty(original: Callable[..., Any]) -> Callable[..., Any]:
        def stream(*args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]] | None:
            out = original(*args, **kwargs)
            return out if out is None or fault is None else inject(out, fault, hf_config)

        return stream

    for name, original in originals.items():
        setattr(policy, name, faulty(original))

    def undo() -> None:
        for name in originals:
            delattr(policy, name)  # the instance attributes go; the class's methods show through again

    return undo


def _step_one_error(ctx: Any, policy: Any, trainer: Any, train: bool) -> tuple[float, int]:
    """Step 1's rollouts from the engine as it is now, and the gate's value on them; the optimizer step runs only
    where `train`. Also returns the number of completion tokens compared."""
    ctx.prompts.load_state_dict(ctx.first_prompts)  # step 1's prompts every time
    rollouts, _ = trainer._generate_rollouts(ctx, 1)
    seen: list[float] = []

    def gate(error: float) -> None:
        seen.append(error)
        if not train:
            raise _Measured(error)

    with contextlib.suppress(_Measured):
        trainer._train_step(policy, ctx.config, rollouts, gate=gate)
    return seen[0], sum(len(r.completion_ids) for r in rollouts)


def measure_gate_rank(config: Any, prepared: Any, faults: list[str], out_file: str) -> None:
    """On every rank: the gate's value for a correct refit and for each of `faults` (of `refit.faults.FAULTS` that
    apply to the model), then the stale copy's; rank 0 writes `{name: value}` and the token count to `out_file`."""
    import torch.distributed as dist

    from hf_mcore_bridge.grpo.run import trainer
    from hf_mcore_bridge.grpo.run.ranks import build_backend

    torch.manual_seed(config.grpo.seed)
    policy = build_backend(config, prepared)
    ctx = trainer._RankContext(config, prepared, policy)
    ctx.first_prompts = ctx.prompts.state_dict()
    results: dict[str, float] = {}
    tokens = 0
    for fault in faults:
        if fault not in FAULTS:
            raise ValueError(f"unknown refit fault {fault!r}; known: {', '.join(FAULTS)}")
        undo = _with_fault(policy, fault, prepared.hf_config)
        try:
            trainer._refit(ctx, policy, 0, initial=True)
        finally:
            undo()
        results[fault], tokens = _step_one_error(ctx, policy, trainer, train=False)
    trainer._refit(ctx, policy, 0, initial=True)
    before = {name: tensor.detach().clone() for name, tensor in ctx.engine.model.named_parameters()}
    results["correct"], tokens = _step_one_error(ctx, policy, trainer, train=True)  # the weights move
    results["stale_probe"] = trainer._probe(_Ungated(ctx), policy, 1)["probe_token_mult_prob_error"]
    results["stale_check"] = float(_stale_refit_stopped(ctx, policy, trainer, before))
    if dist.get_rank() == 0:
        Path(out_file).write_text(json.dumps({"values": results, "completion_tokens": tokens}, indent=1))
    ctx.scorer.close()


class _Ungated:
    """A rank context whose config never stops on the gate (the stale engine's value is measured, not gated)."""

    def __init__(self, ctx: Any) -> None:
        import dataclasses

        self._ctx = ctx
        grpo = dataclasses.replace(ctx.config.grpo, on_logprob_mismatch="warn")
        self.config = dataclasses.replace(ctx.config, grpo=grpo)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)


def _stale_refit_stopped(ctx: Any, policy: Any, trainer: Any, stale: dict[str, torch.Tensor]) -> bool:
    """A refit after step 1 whose engine copy ends up holding the pre-step weights: whether its check stops it."""
    load = ctx.engine.load_weights

    def load_then_revert(*args: Any, **kwargs: Any) -> Any:
        done = load(*args, **kwargs)
        with torch.no_grad():
            for name, param in ctx.engine.model.named_parameters():
                param.copy_(stale[name])
        return done

    ctx.engine.load_weights = load_then_revert
    try:
        trainer._refit(ctx, policy, 1)
    except BridgeError as stopped:
        return "failed its check" in str(stopped)
    finally:
        del ctx.engine.load_weights
    return False
