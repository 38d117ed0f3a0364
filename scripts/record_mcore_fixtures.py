"""Record tiny checkpoints saved by the installed megatron-core itself, for `tests/convert/test_mcore_fixtures.py`.

megatron-core 0.17 and newer need Python >= 3.12, which the development machines lack: run this where there is
one (the GPU machine; it runs on the CPU, in gloo worlds), with the megatron-core wheels in `.whl/`:

    python3 scripts/record_mcore_fixtures.py .whl/megatron_core-0.1[789]*.whl

Each wheel is installed with this project (no dependencies, no index: torch, transformers, safetensors, typer and
psutil must be there already) into a temporary directory, and the recording runs against it; without arguments
it records for the megatron-core already importable. The script itself imports the project, so it must be
installed where this runs too. On the GPU machine, with the missing dependencies carried as wheels in `.whl/deps/`
(2026-12-01: transformers, tokenizers, safetensors, huggingface_hub, typer, rich, psutil, pyyaml and their needs):

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/deps/*.whl
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/proj .
    PYTHONPATH=/tmp/site:/tmp/proj python3 scripts/record_mcore_fixtures.py .whl/megatron_core-0.1[789]*.whl

Into `tests/fixtures/mcore-<major.minor>/` it writes, for a dense model (Llama, TP2 PP2, 4 ranks) and a mixture of
experts (Mixtral, EP2, 2 ranks), megatron-core's local spec, fp32:
- `<case>/release/` + `latest_checkpointed_iteration.txt`: a randomly initialised `GPTModel` saved with
  `dist_checkpointing.save`, with Megatron-LM's common entries (`args`, `checkpoint_version`, `iteration`);
- `<case>/config.json`: the model's HF config; `<case>/tokens.pt` and `<case>/logits.pt`: a fixed input and
  the logits megatron-core computed for it before saving ([batch, seq, vocab], unpadded).
It then checks this project's checkpoints of the same shapes (HF -> mcore with `--mcore-version` of each layout)
in the installed megatron-core: `dist_checkpointing.load(..., strict="raise_all")` at the case's layout, logits
against HF transformers' on the HF model converted; the outcome goes to `load_check.json` (the test reads it).
About 20 s a world on 16 cores; the fixtures are ~0.5 MB a release.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import traceback
from importlib.metadata import version
from pathlib import Path

os.environ["CUDA_VISIBLE_DEVICES"] = ""  # gloo on the CPU: 4 ranks cannot share one GPU under NCCL

import torch

from hf_mcore_bridge.checkpoint.megatron_dirs import MCORE_VERSIONS, common_state, write_tracker
from hf_mcore_bridge.convert import config_bridge
from hf_mcore_bridge.convert.layout import Layout
from hf_mcore_bridge.megatron.world import run_world
from hf_mcore_bridge.models.spec import ModelSpec
from hf_mcore_bridge.models.tiny_models import build_tiny_model, tiny_config

ROOT = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
CASES: dict[str, tuple[str, dict, Layout]] = {
    "llama-tp2pp2": ("LlamaForCausalLM", {"num_hidden_layers": 2}, Layout(tp=2, pp=2)),
    "mixtral-ep2": ("MixtralForCausalLM", {"num_hidden_layers": 2, "num_local_experts": 4}, Layout(ep=2)),
}
TOLERANCE = 1e-4


def _model_config(config: dict) -> ModelSpec:
    return config_bridge.megatron_spec(config)


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(0))


def save_rank(model_cfg: ModelSpec, layout: Layout, directory: str, tokens: torch.Tensor, logits_path: str) -> None:
    """Build a random GPTModel (local spec, megatron-core's unfused attention), save it, and keep its logits."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from hf_mcore_bridge.megatron.model import build_gpt_model
    from hf_mcore_bridge.megatron.verify import forward_stage

    torch.manual_seed(1234 + dist.get_rank())
    padded = config_bridge.padded_vocab(model_cfg, layout)
    model = build_gpt_model(
        model_cfg, layout, torch.float32, padded, device=torch.device("cpu"), core_attention="local"
    )
    with torch.no_grad():  # norms start at 1: make them differ so that a misplaced norm shows in the logits
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.copy_(1 + 0.1 * torch.sin(torch.arange(param.numel()) + len(name)).to(param))
    model.eval()
    args = config_bridge.megatron_args(model_cfg, layout, torch.float32, spec="local")
    if dist.get_rank() == 0:
        Path(directory).mkdir(parents=True, exist_ok=True)
    dist.barrier()
    state = {"model": model.sharded_state_dict(), **common_state(args, iteration=0)}
    dist_checkpointing.save(state, directory)
    dist.barrier()
    logits = forward_stage(model, model_cfg, tokens, torch.float32)
    if logits is not None:
        torch.save(logits, logits_path)


def strict_load_rank(model_cfg: ModelSpec, layout: Layout, directory: str, tokens: torch.Tensor, out: str) -> None:
    """Load a checkpoint with `dist_checkpointing.load(strict="raise_all")` and keep the logits."""
    from megatron.core import dist_checkpointing

    from hf_mcore_bridge.megatron.model import build_gpt_model
    from hf_mcore_bridge.megatron.verify import forward_stage

    try:
        from megatron.core.safe_globals import register_safe_globals

        register_safe_globals()
    except ImportError:
        pass
    padded = config_bridge.padded_vocab(model_cfg, layout)
    model = build_gpt_model(
        model_cfg, layout, torch.float32, padded, device=torch.device("cpu"), initialize=False, core_attention="local"
    )
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, directory, strict="raise_all")
    model.load_state_dict(state["model"], strict=True)
    logits = forward_stage(model.eval(), model_cfg, tokens, torch.float32)
    if logits is not None:
        torch.save(logits, out)


def record_case(name: str, out: Path) -> None:
    architecture, overrides, layout = CASES[name]
    config = tiny_config(architecture, **overrides)
    model_cfg = _model_config(config)
    case = out / name
    shutil.rmtree(case, ignore_errors=True)
    case.mkdir(parents=True)
    tokens = _tokens(model_cfg.vocab_size)
    run_world(save_rank, layout, model_cfg, layout, str(case / "release"), tokens, str(case / "logits.pt"))
    write_tracker(case, None)
    torch.save(tokens, case / "tokens.pt")
    (case / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def check_ours(name: str, layout_version: int, work: Path) -> dict:
    """This project's checkpoint of a case's shape, in the layout of `layout_version`, loaded strictly here."""
    from hf_mcore_bridge.convert.to_mcore import convert_hf_to_mcore
    from hf_mcore_bridge.megatron.verify import _hf_logits

    architecture, overrides, layout = CASES[name]
    hf_dir = build_tiny_model(work / f"{name}-hf", architecture, seed=7, **overrides)
    model_cfg = _model_config(tiny_config(architecture, **overrides))
    ours = work / f"{name}-v{layout_version}"
    convert_hf_to_mcore(hf_dir, ours, layout=layout, spec="local", mcore_version=layout_version, show_progress=False)
    tokens = _tokens(model_cfg.vocab_size)
    logits_path = work / f"{name}-v{layout_version}.pt"
    result: dict = {"case": name, "layout_of": f"0.{layout_version}"}
    try:
        run_world(strict_load_rank, layout, model_cfg, layout, str(ours / "release"), tokens, str(logits_path))
    except Exception as err:  # a refusal is a result to record, not a crash
        result.update(loaded=False, error=f"{type(err).__name__}: {err}"[:500])
        return result
    diff = (torch.load(logits_path, weights_only=True) - _hf_logits(hf_dir, tokens, "fp32")).abs().max().item()
    result.update(loaded=True, max_abs_logit_diff=diff, passed=diff <= TOLERANCE)
    return result


def record_with_wheels(wheels: list[str]) -> int:
    """Install each megatron-core wheel beside this project in a scratch directory and record with it."""
    project = Path(__file__).resolve().parent.parent
    status = 0
    for wheel in wheels:
        with tempfile.TemporaryDirectory() as target:
            pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-build-isolation"]
            subprocess.run([*pip, "--target", target, wheel, str(project)], check=True)
            # the scratch directory first, before anything the caller's PYTHONPATH carries (e.g. carried wheels)
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [target, os.environ.get("PYTHONPATH")]))}
            print(f"== {Path(wheel).name}", flush=True)
            status |= subprocess.run([sys.executable, str(Path(__file__).resolve())], env=env).returncode
    return status


def main() -> int:
    if len(sys.argv) > 1:
        return record_with_wheels(sys.argv[1:])
    installed = version("megatron-core")
    minor = int(installed.split(".")[1])
    if minor not in MCORE_VERSIONS:
        print(f"megatron-core {installed} is not one of 0.{MCORE_VERSIONS[0]}-0.{MCORE_VERSIONS[-1]}")
        return 2
    out = ROOT / f"mcore-0.{minor}"
    out.mkdir(parents=True, exist_ok=True)
    for name in CASES:
        record_case(name, out)
        print(f"recorded {out / name}")
    checks = []
    with tempfile.TemporaryDirectory() as work:
        for name in CASES:
            for layout_version in sorted({MCORE_VERSIONS[0], minor}):
                try:
                    checks.append(check_ours(name, layout_version, Path(work)))
                except Exception:
                    traceback.print_exc()
                    checks.append({"case": name, "layout_of": f"0.{layout_version}", "loaded": False})
                print(json.dumps(checks[-1]))
    report = {"megatron_core": installed, "python": sys.version.split()[0], "torch": torch.__version__}
    (out / "load_check.json").write_text(json.dumps({**report, "checks": checks}, indent=2) + "\n")
    own = [c for c in checks if c["layout_of"] == f"0.{minor}"]
    return 0 if own and all(c.get("passed") for c in own) else 1


if __name__ == "__main__":
    sys.exit(main())
