"""Checkpoints saved by megatron-core 0.16-0.19 themselves (`tests/fixtures/mcore-<version>/`, recorded by
`scripts/record_mcore_fixtures.py`) export to HF models whose logits match those megatron-core computed.

A release whose fixtures are not recorded yet is skipped with the command that records them (megatron-core >= 0.17
needs Python 3.12). `load_check.json` is the recording machine's report of this project's checkpoints loaded by
that megatron-core with `strict="raise_all"`, logits against HF transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hf_mcore_bridge.checkpoint.megatron_dirs import read_common
from hf_mcore_bridge.convert.to_hf import convert_mcore_to_hf
from hf_mcore_bridge.megatron.verify import _hf_logits

FIXTURES = Path(__file__).parents[1] / "fixtures"
VERSIONS = ["0.16", "0.17", "0.18", "0.19"]
CASES = ["llama-tp2pp2", "mixtral-ep2"]


def _fixture(version: str) -> Path:
    directory = FIXTURES / f"mcore-{version}"
    if not directory.is_dir():
        pytest.skip(
            f"no checkpoints saved by megatron-core {version} in {directory}: record them on a Python 3.12 machine"
            f" with megatron-core {version} installed (scripts/record_mcore_fixtures.py)"
        )
    return directory


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("version", VERSIONS)
def test_checkpoint_saved_by_megatron_core_exports_with_its_logits(version, case, tmp_path):
    fixture = _fixture(version) / case
    release = fixture / "release"
    config = json.loads((fixture / "config.json").read_text())
    # the layout each release writes (megatron-core's source): common.pt up to 0.18, inside the DCP files from 0.19
    assert (release / "common.pt").exists() is (version != "0.19")
    args = read_common(release)["args"]
    assert args.num_layers == config["num_hidden_layers"] and args.hidden_size == config["hidden_size"]
    convert_mcore_to_hf(fixture, tmp_path / "hf", hf_config=fixture / "config.json", show_progress=False)
    tokens = torch.load(fixture / "tokens.pt", weights_only=True)
    recorded = torch.load(fixture / "logits.pt", weights_only=True)
    assert recorded.shape == (*tokens.shape, config["vocab_size"])
    assert (recorded - _hf_logits(tmp_path / "hf", tokens, "fp32")).abs().max() <= 1e-4


@pytest.mark.parametrize("version", VERSIONS)
def test_megatron_core_loaded_our_checkpoints_strictly(version):
    """The recording machine's report: this project's checkpoints written in the layout of `version` loaded in
    megatron-core `version` with `strict="raise_all"` and gave HF's logits."""
    report = json.loads((_fixture(version) / "load_check.json").read_text())
    assert report["megatron_core"].startswith(version + ".")
    own = [c for c in report["checks"] if c["layout_of"] == version]
    assert {c["case"] for c in own} == set(CASES)
    for check in own:
        assert check["loaded"] and check["passed"] and check["max_abs_logit_diff"] <= 1e-4, check


def test_a_wrong_model_does_not_match_the_recorded_logits(tmp_path):
    """The comparison can fail: the dense fixture's logits against the HF export of a different checkpoint."""
    fixture = _fixture("0.16") / "llama-tp2pp2"
    other = _fixture("0.16") / "mixtral-ep2"
    convert_mcore_to_hf(other, tmp_path / "hf", hf_config=other / "config.json", show_progress=False)
    tokens = torch.load(fixture / "tokens.pt", weights_only=True)
    recorded = torch.load(fixture / "logits.pt", weights_only=True)
    assert (recorded - _hf_logits(tmp_path / "hf", tokens, "fp32")).abs().max() > 1e-2
