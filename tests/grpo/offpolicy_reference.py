"""An independent GRPO trainer for the tests: HF transformers + autograd + `torch.optim.SGD`, written from the
algorithm's definition and sharing no code with `hf_mcore_bridge.grpo` (no `grpo_loss`, no `make_microbatches`).

It replays a run from its logged rollouts (`rollouts.jsonl`: token ids, engine log-probs, rewards) and the HF
model the run started from, and returns every mini-batch's loss and gradient norm (`replay`), or step one's
log-probs, loss and every parameter's gradient (`first_update`):
- log-probs: each rollout alone (no padding), `log_softmax(logits / T)` at the positions that predict the
  completion tokens (position `len(prompt) - 1 + i` predicts completion token `i`);
- advantages: per group of `G` consecutive rollouts, `(r - mean) / (std + 1e-6)` with the sample std, 0 for a
  group of equal rewards;
- per token: `max(-ratio * A, -clip(ratio, 1 - eps_low, 1 + eps_high) * A)` with `ratio = exp(lp - lp_old)`, times
  the engine-mismatch weight of the old policy vs the engine (`tis`: `min(exp(lp_old - lp_engine), cap)`;
  `icepop`: that ratio where it lies in `[low, high]`, else 0), plus `beta * (exp(d) - d - 1)` with
  `d = lp_ref - lp` (k3 KL to the initial weights);
- aggregation over a mini-batch: token (sum over its completion tokens / their count) or sequence (each
  sequence's mean, summed / the number of sequences); overlong filtering leaves out the rollouts whose last token
  is no stop token (from the loss and from those counts);
- one SGD step (momentum as configured) per mini-batch after clipping the gradient to `clip_grad` in total norm.

Assumes the run's optimizer is SGD without weight decay at a constant learning rate, and a KL reference equal to
the initial weights (what the trainer keeps).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class ReferenceSettings:
    """The knobs of the run being replayed."""

    group: int
    minibatches: int
    temperature: float
    lr: float
    momentum: float
    clip_grad: float
    kl_coef: float
    clip_low: float = 0.2
    clip_high: float = 0.2
    aggregation: str = "token"
    is_correction: str = "none"
    tis_cap: float = 2.0
    icepop_low: float = 0.5
    icepop_high: float = 5.0
    overlong_filtering: bool = False
    stop_token_ids: tuple[int, ...] = ()


def read_rollouts(path: Path) -> dict[int, list[dict]]:
    """The logged rollouts by step, in the order the trainer logged (and used) them."""
    by_step: dict[int, list[dict]] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        by_step.setdefault(row["step"], []).append(row)
    return by_step


def advantages_of(rewards: list[float], group: int) -> list[float]:
    out = []
    for start in range(0, len(rewards), group):
        values = torch.tensor(rewards[start : start + group], dtype=torch.float64)
        if values.max() == values.min():
            out += [0.0] * group
        else:
            out += ((values - values.mean()) / (values.std() + 1e-6)).tolist()
    return out


def completion_logprobs(model: torch.nn.Module, row: dict, temperature: float) -> torch.Tensor:
    """[C] log-probs of the completion tokens of `row` under `model` at `temperature`."""
    prompt, completion = row["prompt_ids"], row["completion_ids"]
    ids = torch.tensor([prompt + completion])
    logits = model(ids).logits[0].float()
    predicting = logits[len(prompt) - 1 : len(prompt) - 1 + len(completion)] / temperature
    return torch.log_softmax(predicting, dim=-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def is_truncated(row: dict, stop_token_ids: tuple[int, ...]) -> bool:
    """No stop token ended the completion: generation ran into its length limit."""
    return row["completion_ids"][-1] not in stop_token_ids


def _token_losses(
    row: dict, lp: torch.Tensor, old: torch.Tensor, ref: torch.Tensor, advantage: float, s: ReferenceSettings
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per completion token: the weighted clipped surrogate term and the k3 KL term."""
    engine = torch.tensor(row["engine_logprobs"], dtype=torch.float32)
    ratio = torch.exp(lp - old)
    surrogate = torch.maximum(-ratio * advantage, -ratio.clamp(1 - s.clip_low, 1 + s.clip_high) * advantage)
    engine_ratio = torch.exp(old - engine)
    if s.is_correction == "tis":
        surrogate = surrogate * torch.clamp(engine_ratio, max=s.tis_cap)
    elif s.is_correction == "icepop":
        kept = (engine_ratio >= s.icepop_low) & (engine_ratio <= s.icepop_high)
        surrogate = surrogate * torch.where(kept, engine_ratio, torch.zeros_like(engine_ratio))
    d = ref - lp
    return surrogate, torch.exp(d) - d - 1


def _minibatch_loss(
    model: torch.nn.Module,
    rows: list[dict],
    old: list[torch.Tensor],
    ref: list[torch.Tensor],
    advantages: list[float],
    s: ReferenceSettings,
) -> torch.Tensor:
    pg_terms, kl_terms = [], []
    for row, row_old, row_ref, advantage in zip(rows, old, ref, advantages, strict=True):
        if s.overlong_filtering and is_truncated(row, s.stop_token_ids):
            continue
        lp = completion_logprobs(model, row, s.temperature)
        pg, kl = _token_losses(row, lp, row_old, row_ref, advantage, s)
        if s.aggregation == "sequence":
            pg, kl = pg.mean()[None], kl.mean()[None]  # one value per sequence
        pg_terms.append(pg)
        kl_terms.append(kl)
    if not pg_terms:
        return torch.zeros((), requires_grad=True)
    pg, kl = torch.cat(pg_terms), torch.cat(kl_terms)  # tokens (or sequences) of the whole mini-batch
    return pg.mean() + s.kl_coef * kl.mean()


def first_update(
    policy_dir: Path, rows: list[dict], s: ReferenceSettings
) -> tuple[list[torch.Tensor], float, dict[str, torch.Tensor]]:
    """The first step of a run on `rows` (its rollouts, as logged) taken as one mini-batch, before any update: each
    row's completion log-probs, the loss, and its gradient under each HF parameter name. The old policy and the KL
    reference are the initial weights, as at step one."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
    advantages = advantages_of([r["reward"] for r in rows], s.group)
    with torch.no_grad():
        old = [completion_logprobs(model, r, s.temperature) for r in rows]
    loss = _minibatch_loss(model, rows, old, old, advantages, s)
    loss.backward()
    return old, float(loss.detach()), {name: p.grad for name, p in model.named_parameters()}


def replay(policy_dir: Path, rollouts_file: Path, steps: int, s: ReferenceSettings) -> list[list[dict[str, float]]]:
    """Per step, per mini-batch: `loss` (before its update) and `grad_norm` (before clipping)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
    reference = copy.deepcopy(model).eval()
    optimizer = torch.optim.SGD(model.parameters(), lr=s.lr, momentum=s.momentum)
    by_step = read_rollouts(rollouts_file)
    out = []
    for step in range(1, steps + 1):
        rows = by_step[step]
        advantages = advantages_of([r["reward"] for r in rows], s.group)
        with torch.no_grad():
            old = [completion_logprobs(model, r, s.temperature) for r in rows]
            ref = [completion_logprobs(reference, r, s.temperature) for r in rows]
        size = len(rows) // s.minibatches
        per_minibatch = []
        for start in range(0, len(rows), size):
            part = slice(start, start + size)
            optimizer.zero_grad()
            loss = _minibatch_loss(model, rows[part], old[part], ref[part], advantages[part], s)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), s.clip_grad)
            optimizer.step()
            per_minibatch.append({"loss": float(loss.detach()), "grad_norm": float(grad_norm)})
        out.append(per_minibatch)
    return out
