"""`examples/external_rl_loop.py` runs as its docstring says (torchrun, two gloo ranks, a tiny model) and shows what
a refit is for: after each fake training step the engine's log-probs are the old policy's until
`engine.load_weights(bridge.export_hf_weights(models))`, and the trainer's after it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).parents[2] / "examples" / "external_rl_loop.py"
GAP = re.compile(r"step (\d+): max \|engine - trainer\| log-prob before refit = (\S+), after refit = (\S+)")


@pytest.mark.slow
def test_external_rl_loop_refits_the_engine_through_load_weights(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(EXAMPLE), "--steps", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    gaps = [(int(step), float(before), float(after)) for step, before, after in GAP.findall(done.stdout)]
    assert [step for step, _, _ in gaps] == [1, 2], done.stdout
    for step, before, after in gaps:
        assert after <= 1e-5, f"step {step}: the refit left the engine {after} away from the trainer"
        assert before > 1e-2, f"step {step}: the fake step did not move the policy ({before})"
