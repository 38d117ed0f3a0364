"""Sampling parameters and the pure functions that turn logits into tokens and log-probabilities.

The reported log-probability of a sampled token is taken under the temperature-scaled distribution
`log_softmax(logits / temperature)`, BEFORE top-k / top-p truncation; a trainer computing importance ratios must
compute the same quantity. Greedy rows (temperature 0) report `log_softmax(logits)` (temperature 1).

Randomness is counter-based: each sampled token draws one uniform number from a hash of (seed, stream, step),
where the stream identifies the sample (request and sample index) and the step is the number of tokens it has
generated so far (SplitMix64: the (seed, stream) pair is hashed once per sample into a key, `stream_key`, and
step t draws the t-th output of the stream started there; numpy on the host, so a step costs a few
microseconds); the token is then the inverse-CDF draw from the truncated distribution. A sample's tokens thus
depend only on its seed, stream and logits, not on which other sequences share its batch or on scheduling.
Truncation follows transformers' order: temperature, then top-k, then top-p on the renormalised top-k mass.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from hf_mcore_bridge.engine.compiled import CompiledOrEager


@dataclass(frozen=True)
class SamplingParams:
    """How to sample the completions of one prompt."""

    n: int = 1
    """Samples per prompt; they share the prompt's KV-cache blocks."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the most probable tokens whose mass reaches top_p (1 keeps all)."""
    top_k: int = 0
    """Keep the k most probable tokens (0 or negative keeps all)."""
    max_tokens: int = 16
    """Tokens to generate at most per sample."""
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    """Generation stops after one of these is sampled; the stop token is kept in the output."""
    seed: int | None = None
    """Seed of the counter-based generator; None draws a fresh one per `generate` call."""
    logprobs: bool = True
    """Return the log-probability of each sampled token (see the module docstring for its definition)."""

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


_GAMMA = np.uint64(0x9E3779B97F4A7C15)
"""SplitMix64's increment (2**64 / golden ratio)."""


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's output function on uint64 arrays (numpy's uint64 arithmetic wraps modulo 2**64)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def stream_key(seed: int, stream: int) -> int:
    """The 64-bit key of one sample's random stream (seed: any int, stream: non-negative, below 2**64)."""
    seeded = _splitmix64(np.array([seed & (2**64 - 1)], dtype=np.uint64) + _GAMMA)
    return int(_splitmix64((seeded ^ np.uint64(stream)) + _GAMMA)[0])


def counter_uniforms(keys: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """One uniform number in (0, 1) per row: the `step`-th output of the SplitMix64 stream started at `key`.

    keys: [B] uint64 from `stream_key`; steps: [B] uint64. Returns [B] float64 with 53 random bits.
    """
    bits = _splitmix64(keys + (steps + np.uint64(1)) * _GAMMA)
    return ((bits >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)


def temperature_logprobs(logits: torch.Tensor, temperature: torch.Tensor, scale: bool = True) -> torch.Tensor:
    """log_softmax(logits / t) per row, with t = 1 for greedy rows (t = 0).

    logits: [B, V] float32; temperature: [B]. Returns [B, V] float32. `scale=False` skips the division, for
    callers that know every temperature is 0 or 1.
    """
    if not scale:
        return torch.log_softmax(logits, dim=-1)
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).to(logits.dtype)
    return torch.log_softmax(logits / t[:, None], dim=-1)


def truncation_mask(logprobs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Tokens kept by top-k then top-p (top-p over the mass renormalised within the top k).

    logprobs: [B, V]; top_k: [B] int64 (<= 0 keeps all); top_p: [B] float (1 keeps all). Returns [B, V] bool.
    At least the most probable token is always kept.
    """
    vocab = logprobs.shape[-1]
    sorted_lp, order = logprobs.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logprobs.device)[None, :]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
    keep_sorted = rank < k[:, None]
    renormalised = torch.softmax(sorted_lp.masked_fill(~keep_sorted, float("-inf")), dim=-1)
    mass_before = renormalised.cumsum(dim=-1) - renormalised
    keep_sorted &= mass_before < top_p.to(mass_before.dtype)[:, None]
    keep_sorted[:, 0] = True
    return torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)


def _masses(scores: torch.Tensor, shift: torch.Tensor | None, keep: torch.Tensor | None) -> torch.Tensor:
    """Unnormalised probabilities exp(scores - shift), zero where `keep` is False (elementwise, any shape)."""
    probs = (scores - shift).exp() if shift is not None else scores.exp()
    return probs if keep is None else probs.masked_fill(~keep, 0.0)


def inverse_cdf_sample(
    logprobs: torch.Tensor,
    keep: torch.Tensor | None,
    uniforms: torch.Tensor,
    chunk: int = 1024,
    shift: torch.Tensor | None = None,
) -> torch.Tensor:
    """Draws one token per row from softmax(logprobs) restricted to `keep`, using the given uniform numbers.

    logprobs: [B, V] log-probabilities, or scores whose log-normaliser is `shift` [B] (the probabilities are then
    exp(logprobs - shift), never materialised for the whole vocabulary); keep: [B, V] bool or None (keep all);
    uniforms: [B] float64 in (0, 1). Returns [B] int64.
    Two-level inverse CDF: the float64 cumulative mass of `chunk`-token chunks picks a chunk, then the cumulative
    mass within that chunk picks the token. Exactly the flat inverse CDF, without a float64 scan of the vocabulary.
    Every probability is computed from its score where it is used, so a compiled caller reads the scores without
    writing the [B, V] probabilities.
    """
    rows, vocab = logprobs.shape
    full = vocab // chunk
    sums = []
    if full:
        head = logprobs[:, : full * chunk].view(rows, full, chunk)
        head_keep = keep[:, : full * chunk].view(rows, full, chunk) if keep is not None else None
        head_shift = shift[:, None, None] if shift is not None else None
        sums.append(_masses(head, head_shift, head_keep).sum(-1, dtype=torch.float64))
    if vocab % chunk:
        tail_keep = keep[:, full * chunk :] if keep is not None else None
        tail_shift = shift[:, None] if shift is not None else None
        tail = _masses(logprobs[:, full * chunk :], tail_shift, tail_keep)
        sums.append(tail.sum(-1, keepdim=True, dtype=torch.float64))
    chunk_cdf = torch.cat(sums, dim=1).cumsum(dim=1)
    # u <= 1 - 2**-52 keeps u * total strictly below the total, so a chunk with positive mass is always found.
    target = uniforms.clamp(max=1.0 - 2.0**-52)[:, None] * chunk_cdf[:, -1:]
    picked = torch.searchsorted(chunk_cdf, target, right=True).clamp_(max=chunk_cdf.shape[1] - 1)
    before = torch.where(picked > 0, chunk_cdf.gather(1, (picked - 1).clamp(min=0)), 0.0)
    index = picked * chunk + torch.arange(chunk, device=logprobs.device)[None, :]
    inside = index < vocab
    index = index.clamp(max=vocab - 1)
    values = _masses(
        logprobs.gather(1, index),
        shift[:, None] if shift is not None else None,
        inside if keep is None else inside & keep.gather(1, index),
    )
    within = torch.searchsorted(values.cumsum(dim=1, dtype=torch.float64), target - before, right=True)
    # The two float64 sums of one chunk may round differently: never step past the chunk's last token with mass.
    last = torch.where(values > 0, torch.arange(chunk, device=logprobs.device), 0).amax(dim=1, keepdim=True)
    return (picked * chunk + torch.minimum(within, last)).squeeze(1)


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling settings of one decode or prefill step, as device tensors."""

    temperature: torch.Tensor
    """[B] float32; 0 marks a greedy row."""
    top_k: torch.Tensor
    """[B] int64."""
    top_p: torch.Tensor
    """[B] float32."""
    uniforms: torch.Tensor
    """[B] float64 from `counter_uniforms`."""
    any_random: bool
    """Some row samples (temperature > 0)."""
    any_greedy: bool
    """Some row is greedy (temperature 0)."""
    any_truncation: bool
    """Some sampling row has top_k > 0 or top_p < 1."""
    any_scaled: bool = True
    """Some row's temperature is neither 0 nor 1 (otherwise the division by it is skipped)."""


def sample(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [B] int64 and their log-probabilities [B] float32 (temperature-scaled, before truncation).

    logits: [B, V] float32 (or a lower precision, upcast where read).
    """
    if batch.any_random and batch.any_truncation:
        return _sample_truncated(logits, batch)
    return sample_untruncated(
        logits, batch.temperature, batch.uniforms, batch.any_random, batch.any_greedy, batch.any_scaled
    )


def _sample_truncated(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample` for batches where some row keeps only its top-k / top-p tokens (sorts every row)."""
    logprobs = temperature_logprobs(logits.float(), batch.temperature, scale=batch.any_scaled)
    tokens = logits.argmax(dim=-1) if batch.any_greedy else None
    keep = truncation_mask(logprobs, batch.top_k, batch.top_p)
    drawn = inverse_cdf_sample(logprobs, keep, batch.uniforms)
    tokens = drawn if tokens is None else torch.where(batch.temperature > 0, drawn, tokens)
    return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)


def sample_untruncated(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    uniforms: torch.Tensor,
    any_random: bool,
    any_greedy: bool,
    scale: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample` for batches without top-k / top-p: the scores' log-normaliser is one reduction and the draw reads
    the scores in place, so no [B, V] log-probabilities are written (compiled by `Sampler`: two fused passes
    over the logits). `scale=False` skips the division by the temperature (every temperature is 0 or 1)."""
    scores = logits.float()
    if scale:
        scores = scores / torch.where(temperature > 0, temperature, torch.ones_like(temperature))[:, None]
    lse = torch.logsumexp(scores, dim=-1)
    tokens = logits.argmax(dim=-1) if any_greedy else None
    if any_random:
        drawn = inverse_cdf_sample(scores, None, uniforms, shift=lse)
        tokens = drawn if tokens is None else torch.where(temperature > 0, drawn, tokens)
    assert tokens is not None
    return tokens, scores.gather(1, tokens[:, None]).squeeze(1) - lse


class Sampler:
    """`sample`, with `sample_untruncated` run by the fused Triton kernel when `fused` is set
    (`triton_sampling`: one read of the logits, CUDA or Triton's interpreter), else compiled by `torch.compile`
    when `compile` is set (for CUDA: its reductions fuse into a few kernels that read the logits without writing
    [B, V] intermediates). If compilation fails, a warning names the error once and eager sampling is used from
    then on (`CompiledOrEager`); so, likewise, if the fused kernel fails (the torch path then). Truncated batches
    (top-k / top-p) always take `sample`."""

    def __init__(self, compile: bool, fused: bool = False) -> None:
        self._untruncated = CompiledOrEager(sample_untruncated, "sampling") if compile else None
        self.fused = fused

    @property
    def compiled(self) -> bool:
        return self._untruncated is not None and self._untruncated.compiled

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
        if batch.any_random and batch.any_truncation:
            return sample(logits, batch)
        args = (logits, batch.temperature, batch.uniforms, batch.any_random, batch.any_greedy, batch.any_scaled)
        if self.fused:
            from hf_mcore_bridge.engine.triton_sampling import fused_sample_untruncated

            try:
                return fused_sample_untruncated(*args)
            except torch.OutOfMemoryError:
                raise
            except Exception as err:  # a Triton compiler error: the torch path from now on
                warnings.warn(
                    f"fused sampler failed, using the torch sampler: {type(err).__name__}: {err}", stacklevel=2
                )
                self.fused = False
        if self._untruncated is None:
            return sample(logits, batch)
        return self._untruncated(*args)
