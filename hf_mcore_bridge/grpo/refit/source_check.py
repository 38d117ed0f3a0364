"""The initial refit against the checkpoint the run started from: the stream must give back the HF tensors exactly.

A run that starts from an HF directory converts it (`convert.to_mcore`) and builds its policy from that; before
any training step the policy's refit stream (`TrainingBackend.hf_weights`: the mapping table's export direction)
must reproduce every HF tensor of that directory, in the policy's dtype, bit for bit. The reference is the HF
files themselves, read by the checkpoint reader (FP8 checkpoints dequantized as conversion does), and compared with
`torch.equal` after casting to the streamed tensor's dtype (the cast conversion applied). So a refit stream that
differs from the model it came from stops the run before step 1, at any precision: a wrong split, head or expert
order, transpose or stale tensor on the export side, or an import that lost or moved something. What it cannot see
is a table wrong the same way in both directions (it round-trips exactly): the log-prob gate sees that
(`logprob_gate`), since megatron-core then computes a different function from the HF model the engine runs.

Costs one extra full-tensor stream at the start (its gathers, on every rank) and one read of the HF files on the
reporting rank; `grpo.check_initial_weights: false` skips it.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from hf_mcore_bridge.errors import BridgeError

__all__ = ["InitialWeightsError", "compare_with_source"]


class InitialWeightsError(BridgeError):
    """The initial refit stream differs from the HF checkpoint the policy was converted from."""


def compare_with_source(stream: Iterable[tuple[str, torch.Tensor]], hf_dir: Path, report: bool) -> int:
    """Exhaust `stream` (on every rank: it may be collective); where `report`, compare each tensor with the one of
    that name in `hf_dir` and raise `InitialWeightsError` (one line) naming those that differ or are missing.
    Returns the number of tensors compared (0 where not `report`)."""
    from hf_mcore_bridge.convert.fp8_checkpoint import open_hf_checkpoint

    source = open_hf_checkpoint(hf_dir) if report else None
    names = source.names() if source is not None else set()
    differ: list[str] = []
    missing: list[str] = []
    compared = 0
    for name, tensor in stream:
        if source is None:
            continue
        if name not in names:
            missing.append(name)
            continue
        expected = source.read(name).to(tensor.dtype)
        if expected.shape != tensor.shape or not torch.equal(expected, tensor.detach().to(expected.device)):
            differ.append(name)
        compared += 1
    problems = []
    if differ:
        problems.append(f"{len(differ)} differ: {_few(differ)}")
    if missing:
        problems.append(f"{len(missing)} are not in it: {_few(missing)}")
    if problems:
        raise InitialWeightsError(
            f"the initial refit's tensors do not give back the policy's HF checkpoint {hf_dir}: "
            + "; ".join(problems)
            + " (the mapping table's export does not invert its import; grpo.check_initial_weights=false to skip)"
        )
    return compared


def _few(names: list[str], shown: int = 4) -> str:
    return ", ".join(names[:shown]) + (f", ... ({len(names)} in all)" if len(names) > shown else "")
