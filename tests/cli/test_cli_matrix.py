"""The command line's bad-input matrix: per command, each refused invocation exits with its status, prints exactly
one `error:` line matching its message, and leaves the sources and the destination byte-for-byte as they were.

Cases are table rows (id, argv, exit status, message regex); `{W}` in an argv stands for the shared workspace,
which holds a tiny Llama HF directory, a Megatron checkpoint converted from it, and damaged inputs: symlink loops,
an index whose shards link to each other, names longer than the file system takes (built in the argv), corrupt and
truncated safetensors, a pickle naming `os.system`, a legacy checkpoint missing a rank directory, a chat template
that does not parse. The whole workspace is snapshotted before and after each case (see `tree_snapshot.py`), so a
staging directory or a log directory left behind fails the case as well (and so would the file the pickle's
payload creates if it ran).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tree_snapshot import assert_unchanged, snapshot
from typer.testing import CliRunner

from hf_mcore_bridge.cli.main import app
from hf_mcore_bridge.convert.layout import Layout
from hf_mcore_bridge.convert.to_mcore import convert_hf_to_mcore

runner = CliRunner()

Case = tuple[str, list[str], int, str]
LOOP = "cannot be followed: symlinks in it form a loop"
TOO_LONG = r"holds a name of 3\d\d bytes; the file system takes at most 255"


@pytest.fixture(scope="module")
def workspace(tiny_models, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("matrix")
    shutil.copytree(tiny_models["llama"], root / "llama")
    convert_hf_to_mcore(root / "llama", root / "mcore", layout=Layout(tp=2), show_progress=False)
    (root / "file.txt").write_text("not a directory\n")
    (root / "empty").mkdir()
    (root / "bad_json").mkdir()
    (root / "bad_json" / "config.json").write_text("{not json")
    (root / "yaml_syntax.yaml").write_text("policy:\n  model_path: [unclosed\n")
    (root / "yaml_list.yaml").write_text("- policy\n- data\n")
    (root / "binary.yaml").write_bytes(b"\xff\xfe\x00\x81 not text")
    (root / "empty.yaml").write_text("")
    run = {
        "policy": {"model_path": str(root / "llama")},
        "data": {"task": "repeat_digit"},
        "logger": {"log_dir": str(root / "runs"), "tensorboard": False},
    }
    (root / "run.yaml").write_text(json.dumps(run))  # JSON is YAML
    _damaged_inputs(root)
    return root


LONG = "x" * 300
"""A file name longer than any Linux file system takes (NAME_MAX is 255 bytes)."""
STAGING_TOO_LONG = "z" * 250
"""A name the file system takes, but `.NAME.partial-XXXXXXXX` (the staging sibling) it does not."""


def _damaged_inputs(root: Path) -> None:
    """Inputs a path lookup, a reader or a template parser refuses, built here (nothing is downloaded)."""
    from safetensors import safe_open

    from hf_mcore_bridge.grpo.data.tiny_chat import build_chat_tokenizer

    (root / "loop_a").symlink_to("loop_b")  # two links leading to each other
    (root / "loop_b").symlink_to("loop_a")
    (root / "self_link").symlink_to("self_link")
    with safe_open(str(root / "llama" / "model.safetensors"), framework="numpy") as handle:
        names = list(handle.keys())
    for name, shard in (("index_loop", "a.safetensors"), ("index_long", f"{LONG}.safetensors")):
        (root / name).mkdir()
        shutil.copy(root / "llama" / "config.json", root / name)
        index = {"metadata": {}, "weight_map": dict.fromkeys(names, shard)}
        (root / name / "model.safetensors.index.json").write_text(json.dumps(index))
    (root / "index_loop" / "a.safetensors").symlink_to("b.safetensors")
    (root / "index_loop" / "b.safetensors").symlink_to("a.safetensors")
    weights = (root / "llama" / "model.safetensors").read_bytes()
    for name, data in (
        ("corrupt_hf", b"\x13\x00\x00\x00\x00\x00\x00\x00not json at all...."),
        ("truncated_hf", weights[:-100]),
    ):
        shutil.copytree(root / "llama", root / name)
        (root / name / "model.safetensors").write_bytes(data)
    _pickle_that_runs_code(root / "pickle_evil", root / "pickle_ran")
    legacy = root / "legacy_missing_rank"
    convert_hf_to_mcore(
        root / "llama", legacy, layout=Layout(tp=2, pp=2), checkpoint_format="torch", show_progress=False
    )
    shutil.rmtree(legacy / "release" / "mp_rank_01_001")
    chat = Path(shutil.copytree(root / "llama", root / "chat_bad"))
    build_chat_tokenizer(chat)
    tokenizer_config = json.loads((chat / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = "{% for m in messages %}{{ m.content }"  # the `}}` is missing
    (chat / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))


class _RunsCode:
    """Pickles as a call of `os.system` (what a malicious `.bin` holds)."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple:
        return os.system, (self.command,)


def _pickle_that_runs_code(directory: Path, witness: Path) -> None:
    """An HF directory whose `pytorch_model.bin` would create `witness` if its pickle were run."""
    import torch

    directory.mkdir()
    shutil.copy(directory.parent / "llama" / "config.json", directory)
    torch.save({"model.embed_tokens.weight": _RunsCode(f"touch {witness}")}, directory / "pytorch_model.bin")


def _argv(template: list[str], workspace: Path) -> list[str]:
    return [part.replace("{W}", str(workspace)) for part in template]


def assert_refused(workspace: Path, argv: list[str], code: int, message: str) -> None:
    before = snapshot(workspace)
    result = runner.invoke(app, _argv(argv, workspace))
    assert result.exit_code == code, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    assert lines[0].startswith("error: ") and "internal error" not in result.output, lines[0]
    assert re.search(message.replace("{W}", str(workspace)), lines[0]), lines[0]
    assert_unchanged(before, workspace)


TO_MCORE = ["convert", "--to", "mcore", "--no-progress"]
CONVERT_TO_MCORE: list[Case] = [
    ("missing-source", [*TO_MCORE, "{W}/nowhere", "{W}/out"], 2, r"source: no such directory: {W}/nowhere$"),
    ("source-is-a-file", [*TO_MCORE, "{W}/file.txt", "{W}/out"], 2, r"file\.txt is not a directory"),
    ("source-without-config", [*TO_MCORE, "{W}/empty", "{W}/out"], 2, r"config\.json does not exist"),
    ("malformed-config", [*TO_MCORE, "{W}/bad_json", "{W}/out"], 2, r"config\.json is not readable JSON"),
    ("tp-0", [*TO_MCORE, "--tp", "0", "{W}/llama", "{W}/out"], 2, r"tp=0 must be at least 1"),
    ("tp-negative", [*TO_MCORE, "--tp", "-2", "{W}/llama", "{W}/out"], 2, r"tp=-2 must be at least 1"),
    ("tp-3", [*TO_MCORE, "--tp", "3", "{W}/llama", "{W}/out"], 2, r"num_attention_heads=8 is not divisible by tp=3"),
    ("tp-8", [*TO_MCORE, "--tp", "8", "{W}/llama", "{W}/out"], 2, r"num_query_groups=4 is not divisible by tp=8"),
    ("pp-negative", [*TO_MCORE, "--pp", "-1", "{W}/llama", "{W}/out"], 2, r"pp=-1 must be at least 1"),
    ("pp-3", [*TO_MCORE, "--pp", "3", "{W}/llama", "{W}/out"], 2, r"num_layers=8 is not divisible by pp=3"),
    ("pp-16", [*TO_MCORE, "--pp", "16", "{W}/llama", "{W}/out"], 2, r"pp=16 is larger than num_layers=8"),
    ("vpp-0", [*TO_MCORE, "--pp", "2", "--vpp", "0", "{W}/llama", "{W}/out"], 2, r"vpp=0 must be at least 1"),
    ("vpp-3", [*TO_MCORE, "--pp", "2", "--vpp", "3", "{W}/llama", "{W}/out"], 2, r"not divisible by pp\*vpp=6"),
    ("cp-0", [*TO_MCORE, "--cp", "0", "{W}/llama", "{W}/out"], 2, r"cp=0 must be at least 1"),
    ("ep-on-dense", [*TO_MCORE, "--ep", "2", "{W}/llama", "{W}/out"], 2, r"ep=2 needs a mixture-of-experts model"),
    ("etp-0", [*TO_MCORE, "--etp", "0", "{W}/llama", "{W}/out"], 2, r"etp=0 must be at least 1"),
    (
        "first-stage-negative",
        [*TO_MCORE, "--pp", "2", "--first-stage-layers", "-1", "{W}/llama", "{W}/out"],
        2,
        r"first_stage_layers=-1 must not be negative",
    ),
    (
        "vocab-multiple-0",
        [*TO_MCORE, "--make-vocab-size-divisible-by", "0", "{W}/llama", "{W}/out"],
        2,
        r"--make-vocab-size-divisible-by=0 must be at least 1",
    ),
    (
        "vocab-multiple-negative",
        [*TO_MCORE, "--make-vocab-size-divisible-by", "-128", "{W}/llama", "{W}/out"],
        2,
        r"--make-vocab-size-divisible-by=-128 must be at least 1",
    ),
    ("dtype-unknown", [*TO_MCORE, "--dtype", "fp8", "{W}/llama", "{W}/out"], 2, r"Invalid value for '--dtype'"),
    ("format-unknown", [*TO_MCORE, "--format", "zarr", "{W}/llama", "{W}/out"], 2, r"Invalid value for '--format'"),
    ("tp-not-a-number", [*TO_MCORE, "--tp", "two", "{W}/llama", "{W}/out"], 2, r"Invalid value for '--tp'"),
    ("missing-to", ["convert", "{W}/llama", "{W}/out"], 2, r"Missing option '--to'"),
    ("missing-destination", [*TO_MCORE, "{W}/llama"], 2, r"Missing argument"),
    ("unknown-option", [*TO_MCORE, "--tpp", "2", "{W}/llama", "{W}/out"], 2, r"No such option: --tpp"),
    ("destination-is-a-file", [*TO_MCORE, "{W}/llama", "{W}/file.txt"], 2, r"exists and is not a directory"),
    ("destination-under-a-file", [*TO_MCORE, "{W}/llama", "{W}/file.txt/out"], 2, r"file\.txt is not a directory"),
    ("destination-not-empty", [*TO_MCORE, "{W}/llama", "{W}/mcore"], 2, r"is not empty; pass --overwrite"),
    (
        "hf-only-options",
        [*TO_MCORE, "--tokenizer", "{W}/llama", "--max-shard-size", "1GB", "{W}/llama", "{W}/out"],
        2,
        r"--tokenizer, --max-shard-size apply to --to hf only, not to --to mcore",
    ),
    (
        "fp8-scale-format-with-to-mcore",
        [*TO_MCORE, "--fp8-scale-format", "float32", "{W}/llama", "{W}/out"],
        2,
        r"--fp8-scale-format applies to --to hf only, not to --to mcore$",
    ),
    ("destination-symlink-loop", [*TO_MCORE, "{W}/llama", "{W}/loop_a"], 2, rf"destination: {{W}}/loop_a {LOOP}$"),
    ("destination-links-to-itself", [*TO_MCORE, "{W}/llama", "{W}/self_link"], 2, rf"{{W}}/self_link {LOOP}$"),
    ("destination-inside-a-symlink-loop", [*TO_MCORE, "{W}/llama", "{W}/loop_a/out"], 2, rf"loop_a/out {LOOP}$"),
    ("source-symlink-loop", [*TO_MCORE, "{W}/loop_b", "{W}/out"], 2, rf"source: {{W}}/loop_b {LOOP}$"),
    ("destination-name-too-long", [*TO_MCORE, "{W}/llama", f"{{W}}/{LONG}"], 2, rf"destination: .* {TOO_LONG}$"),
    ("destination-under-a-long-name", [*TO_MCORE, "{W}/llama", f"{{W}}/{LONG}/out"], 2, rf"destination: .*{TOO_LONG}"),
    ("source-name-too-long", [*TO_MCORE, f"{{W}}/{LONG}", "{W}/out"], 2, rf"source: {{W}}/x+ {TOO_LONG}$"),
    (
        "destination-name-leaves-no-room-for-the-staging-sibling",
        [*TO_MCORE, "{W}/llama", f"{{W}}/{STAGING_TOO_LONG}"],
        2,
        r"its name is 250 bytes long, but the output is built in a hidden sibling named \.NAME\.partial-XXXXXXXX,"
        r" which the file system takes only for names of at most 237 bytes$",
    ),
    (
        "index-shards-in-a-symlink-loop",
        [*TO_MCORE, "{W}/index_loop", "{W}/out"],
        2,
        rf"model\.safetensors\.index\.json names shard a\.safetensors, which {LOOP}$",
    ),
    (
        "index-shard-name-too-long",
        [*TO_MCORE, "{W}/index_long", "{W}/out"],
        2,
        r"names shard x+\.safetensors, which holds a name of 312 bytes; the file system takes at most 255$",
    ),
    (
        "pickle-naming-a-forbidden-global",
        [*TO_MCORE, "--allow-pickle", "{W}/pickle_evil", "{W}/out"],
        2,
        r"pickle_evil/pytorch_model\.bin refers to posix\.system, which a weights-only load does not import or"
        r" call \(a pickle can run code\); it was not loaded$",
    ),
]

TO_HF = ["convert", "--to", "hf", "--no-progress"]
CONVERT_TO_HF: list[Case] = [
    ("missing-source", [*TO_HF, "{W}/nowhere", "{W}/out"], 2, r"source: no such directory: {W}/nowhere$"),
    ("not-a-checkpoint", [*TO_HF, "{W}/empty", "{W}/out"], 2, r"not a Megatron checkpoint"),
    ("tokenizer-nowhere", [*TO_HF, "--tokenizer", "{W}/nowhere", "{W}/mcore", "{W}/out"], 2, r"--tokenizer: no such"),
    ("tokenizer-is-a-file", [*TO_HF, "--tokenizer", "{W}/file.txt", "{W}/mcore", "{W}/out"], 2, r"not a directory"),
    (
        "tokenizer-without-tokenizer-files",
        [*TO_HF, "--tokenizer", "{W}/empty", "{W}/mcore", "{W}/out"],
        2,
        r"--tokenizer: {W}/empty holds no tokenizer files \(none of tokenizer\.json, tokenizer\.model",
    ),
    ("hf-config-nowhere", [*TO_HF, "--hf-config", "{W}/nowhere", "{W}/mcore", "{W}/out"], 2, r"--hf-config: no such"),
    (
        "hf-config-malformed",
        [*TO_HF, "--hf-config", "{W}/bad_json", "{W}/mcore", "{W}/out"],
        2,
        r"--hf-config: .* is not readable JSON",
    ),
    ("shard-size-lots", [*TO_HF, "--max-shard-size", "lots", "{W}/mcore", "{W}/out"], 2, r"'lots' is not a size"),
    ("shard-size-0", [*TO_HF, "--max-shard-size", "0", "{W}/mcore", "{W}/out"], 2, r"'0' must be larger than 0"),
    ("shard-size-0GB", [*TO_HF, "--max-shard-size", "0GB", "{W}/mcore", "{W}/out"], 2, r"must be larger than 0"),
    ("shard-size-negative", [*TO_HF, "--max-shard-size", "-1GB", "{W}/mcore", "{W}/out"], 2, r"must be larger than 0"),
    ("shard-size-unit", [*TO_HF, "--max-shard-size", "5GiB", "{W}/mcore", "{W}/out"], 2, r"is not a size"),
    ("iteration-negative", [*TO_HF, "--iteration", "-1", "{W}/mcore", "{W}/out"], 2, r"--iteration=-1 must be at"),
    ("iteration-unknown", [*TO_HF, "--iteration", "5", "{W}/mcore", "{W}/out"], 2, r"has no iteration 5"),
    ("destination-is-a-file", [*TO_HF, "{W}/mcore", "{W}/file.txt"], 2, r"exists and is not a directory"),
    (
        "destination-not-empty",
        [*TO_HF, "{W}/mcore", "{W}/llama"],
        2,
        r"is not empty and was not written by hf-mcore-bridge.*--overwrite-foreign",
    ),
    ("tp-with-to-hf", [*TO_HF, "--tp", "2", "{W}/mcore", "{W}/out"], 2, r"--tp applies to --to mcore only"),
    (
        "fp8-scale-format-unknown",
        [*TO_HF, "--fp8-blockwise", "--fp8-scale-format", "e8m0", "{W}/mcore", "{W}/out"],
        2,
        r"Invalid value for '--fp8-scale-format': .*'e8m0' is not one of 'source', 'ue8m0', 'float32'",
    ),
    (
        "fp8-scale-format-without-fp8-blockwise",
        [*TO_HF, "--fp8-scale-format", "ue8m0", "{W}/mcore", "{W}/out"],
        2,
        r"--fp8-scale-format applies with --fp8-blockwise only$",
    ),
    ("format-with-to-hf", [*TO_HF, "--format", "torch", "{W}/mcore", "{W}/out"], 2, r"--format applies to --to mcore"),
    ("destination-symlink-loop", [*TO_HF, "{W}/mcore", "{W}/loop_a"], 2, rf"destination: {{W}}/loop_a {LOOP}$"),
    ("source-name-too-long", [*TO_HF, f"{{W}}/{LONG}", "{W}/out"], 2, rf"source: {{W}}/x+ {TOO_LONG}$"),
    (
        "legacy-rank-directory-missing",
        [*TO_HF, "{W}/legacy_missing_rank", "{W}/out"],
        2,
        r"legacy rank directory {W}/legacy_missing_rank/release/mp_rank_01_001 is missing: a checkpoint saved at"
        r" tp=2 pp=2 has one per rank, each holding model_optim_rng\.pt$",
    ),
]

VERIFY: list[Case] = [
    ("hf-dir-missing", ["verify", "{W}/nowhere", "{W}/mcore"], 2, r"HF directory: no such directory: {W}/nowhere$"),
    ("hf-dir-is-a-file", ["verify", "{W}/file.txt", "{W}/mcore"], 2, r"file\.txt is not a directory"),
    ("hf-dir-without-config", ["verify", "{W}/empty", "{W}/mcore"], 2, r"config\.json does not exist"),
    ("mcore-missing", ["verify", "{W}/llama", "{W}/nowhere"], 2, r"Megatron checkpoint: no such directory"),
    ("tolerance-negative", ["verify", "{W}/llama", "{W}/mcore", "--tolerance", "-1"], 2, r"--tolerance=-1.0 must"),
    ("tolerance-nan", ["verify", "{W}/llama", "{W}/mcore", "--tolerance", "nan"], 2, r"--tolerance=nan must"),
    ("batch-negative", ["verify", "{W}/llama", "{W}/mcore", "--batch", "-1"], 2, r"--batch=-1 must be at least 1"),
    ("batch-0", ["verify", "{W}/llama", "{W}/mcore", "--batch", "0"], 2, r"--batch=0 must be at least 1"),
    ("seq-len-0", ["verify", "{W}/llama", "{W}/mcore", "--seq-len", "0"], 2, r"--seq-len=0 must be at least 1"),
    ("cp-seq-len", ["verify", "{W}/llama", "{W}/mcore", "--cp", "2", "--seq-len", "6"], 2, r"multiple of 2 x --cp = 4"),
    ("tp-3", ["verify", "{W}/llama", "{W}/mcore", "--tp", "3"], 2, r"num_attention_heads=8 is not divisible by tp=3"),
    ("tp-0", ["verify", "{W}/llama", "{W}/mcore", "--tp", "0"], 2, r"tp=0 must be at least 1"),
    ("pp-3", ["verify", "{W}/llama", "{W}/mcore", "--pp", "3"], 2, r"num_layers=8 is not divisible by pp=3"),
    ("ep-on-dense", ["verify", "{W}/llama", "{W}/mcore", "--ep", "2"], 2, r"needs a mixture-of-experts model"),
    ("dtype-unknown", ["verify", "{W}/llama", "{W}/mcore", "--dtype", "int8"], 2, r"Invalid value for '--dtype'"),
    ("hf-dir-symlink-loop", ["verify", "{W}/loop_a", "{W}/mcore"], 2, rf"HF directory: {{W}}/loop_a {LOOP}$"),
    ("mcore-name-too-long", ["verify", "{W}/llama", f"{{W}}/{LONG}"], 2, rf"Megatron checkpoint: .* {TOO_LONG}$"),
    (
        "seq-len-beyond-max-positions",
        ["verify", "{W}/llama", "{W}/mcore", "--seq-len", "16386"],
        2,
        r"--seq-len 16386 is longer than the model's max_position_embeddings=16384 \({W}/llama/config\.json\)$",
    ),
    # the HF weights are read after the world ran: their headers are checked before it starts
    (
        "corrupt-safetensors",
        ["verify", "{W}/corrupt_hf", "{W}/mcore", "--seq-len", "8"],
        2,
        r"corrupt_hf/model\.safetensors is not a readable safetensors file \(corrupt or truncated\): .*invalid JSON",
    ),
    (
        "truncated-safetensors",
        ["verify", "{W}/truncated_hf", "{W}/mcore", "--seq-len", "8"],
        2,
        r"truncated_hf/model\.safetensors is not a readable safetensors file \(corrupt or truncated\)",
    ),
    (
        "index-shards-in-a-symlink-loop",
        ["verify", "{W}/index_loop", "{W}/mcore", "--seq-len", "8"],
        2,
        rf"names shard a\.safetensors, which {LOOP}$",
    ),
]

INSPECT: list[Case] = [
    ("missing", ["inspect", "{W}/nowhere"], 2, r"checkpoint: no such directory: {W}/nowhere$"),
    ("a-file", ["inspect", "{W}/file.txt"], 2, r"file\.txt is not a directory"),
    ("not-a-checkpoint", ["inspect", "{W}/empty"], 2, r"not a Megatron checkpoint"),
    ("symlink-loop", ["inspect", "{W}/self_link"], 2, rf"checkpoint: {{W}}/self_link {LOOP}$"),
    ("name-too-long", ["inspect", f"{{W}}/{LONG}"], 2, rf"checkpoint: {{W}}/x+ {TOO_LONG}$"),
    ("index-shards-in-a-symlink-loop", ["inspect", "{W}/index_loop"], 2, rf"names shard a\.safetensors, which {LOOP}$"),
    ("legacy-rank-directory-missing", ["inspect", "{W}/legacy_missing_rank"], 2, r"mp_rank_01_001 is missing"),
]

EXPORT: list[Case] = [
    ("run-dir-missing", ["export", "{W}/nowhere", "{W}/out"], 2, r"run directory: no such directory"),
    ("step-negative", ["export", "{W}/empty", "{W}/out", "--step", "-1"], 2, r"--step=-1 must be at least 0"),
    ("destination-is-a-file", ["export", "{W}/empty", "{W}/file.txt"], 2, r"exists and is not a directory"),
    ("no-checkpoints", ["export", "{W}/empty", "{W}/out"], 2, r"holds no checkpoints"),
    ("destination-inside-a-symlink-loop", ["export", "{W}/mcore", "{W}/loop_b/out"], 2, rf"loop_b/out {LOOP}$"),
    ("run-dir-name-too-long", ["export", f"{{W}}/{LONG}", "{W}/out"], 2, rf"run directory: {{W}}/x+ {TOO_LONG}$"),
]

DEMO: list[Case] = [
    ("tp-0", ["demo", "{W}/demo", "--tp", "0"], 2, r"--tp=0 must be at least 1"),
    ("tp-3", ["demo", "{W}/demo", "--tp", "3"], 2, r"num_attention_heads=8 is not divisible by tp=3"),
    ("pp-3", ["demo", "{W}/demo", "--pp", "3"], 2, r"num_layers=8 is not divisible by pp=3"),
    ("destination-is-a-file", ["demo", "{W}/file.txt"], 2, r"exists and is not a directory"),
    ("destination-not-ours", ["demo", "{W}/llama", "--overwrite"], 2, r"not written by hf-mcore-bridge"),
    ("destination-symlink-loop", ["demo", "{W}/loop_a"], 2, rf"destination: {{W}}/loop_a {LOOP}$"),
]

GRPO = ["train", "grpo", "--config"]
DTENSOR = ["policy.megatron_cfg.enabled=false", "policy.dtensor_cfg.enabled=true"]
TRAIN_GRPO: list[Case] = [
    ("config-missing", [*GRPO, "{W}/nowhere.yaml"], 2, r"--config: no such file: {W}/nowhere\.yaml$"),
    ("config-is-a-directory", [*GRPO, "{W}/empty"], 2, r"--config: .*empty is not a file"),
    ("yaml-syntax-error", [*GRPO, "{W}/yaml_syntax.yaml"], 2, r"not valid YAML: .* at line \d+, column \d+"),
    ("yaml-not-a-mapping", [*GRPO, "{W}/yaml_list.yaml"], 2, r"top level must be a mapping"),
    ("config-not-text", [*GRPO, "{W}/binary.yaml"], 2, r"binary\.yaml: cannot read the config"),
    ("config-empty", [*GRPO, "{W}/empty.yaml"], 2, r"policy\.model_path is required"),
    ("config-missing-option", ["train", "grpo"], 2, r"Missing option '--config'"),
    ("unknown-key", [*GRPO, "{W}/run.yaml", "grpo.num_generation_per_prompt=4"], 2, r"did you mean"),
    ("malformed-override", [*GRPO, "{W}/run.yaml", "grpo.seed"], 2, r"not of the form key\.sub=value"),
    (
        "override-value-not-yaml",
        [*GRPO, "{W}/run.yaml", "grpo.seed=[1, 2"],
        2,
        r"override 'grpo\.seed=\[1, 2': the value is not valid YAML: expected ',' or '\]', but got '<stream end>'"
        r" at line 1, column 6$",
    ),
    ("config-symlink-loop", [*GRPO, "{W}/loop_a"], 2, rf"--config: {{W}}/loop_a {LOOP}$"),
    ("config-name-too-long", [*GRPO, f"{{W}}/{LONG}.yaml"], 2, rf"--config: {{W}}/x+\.yaml {TOO_LONG}$"),
    # found before the policy is converted: no run directory appears
    (
        "chat-template-does-not-parse",
        [*GRPO, "{W}/run.yaml", "policy.model_path={W}/chat_bad"],
        2,
        r"the chat template of {W}/chat_bad does not parse: unexpected '}' \(line 1\)$",
    ),
    (
        "chat-template-does-not-parse-dry-run",
        [*GRPO, "{W}/run.yaml", "policy.model_path={W}/chat_bad", "--dry-run"],
        2,
        r"the chat template of {W}/chat_bad does not parse: unexpected '}' \(line 1\)$",
    ),
    (
        "negative-learning-rate",
        [*GRPO, "{W}/run.yaml", "policy.megatron_cfg.optimizer.lr=-1.0e-6"],
        2,
        r"policy\.megatron_cfg\.optimizer\.lr=-1e-06 must be >= 0",
    ),
    (
        "learning-rate-as-text",
        [*GRPO, "{W}/run.yaml", "policy.megatron_cfg.optimizer.lr=1e-6"],
        2,
        r"optimizer\.lr must be a number, got '1e-6' \(YAML reads 1e-6 as text: write 1\.0e-6\)",
    ),
    (
        "adam-beta-1",
        [*GRPO, "{W}/run.yaml", "policy.megatron_cfg.optimizer.adam_beta2=1.0"],
        2,
        r"adam_beta2=1 must be < 1",
    ),
    (
        "min-lr-above-lr",
        [*GRPO, "{W}/run.yaml", "policy.megatron_cfg.scheduler.min_lr=0.5"],
        2,
        r"scheduler\.min_lr=0\.5 is above the learning rate",
    ),
    (
        "warmup-negative",
        [*GRPO, "{W}/run.yaml", "policy.megatron_cfg.scheduler.lr_warmup_steps=-1"],
        2,
        r"lr_warmup_steps=-1 must be >= 0",
    ),
    (
        "decay-within-warmup",
        [*GRPO, "{W}/run.yaml", "policy.megatron_cfg.scheduler.lr_warmup_steps=5", "+decay=5"],
        2,
        r"lr_decay_steps=5 must be larger than lr_warmup_steps=5",
    ),
    (
        "dtensor-negative-learning-rate",
        [
            *GRPO,
            "{W}/run.yaml",
            "policy.megatron_cfg.enabled=false",
            "policy.dtensor_cfg.enabled=true",
            "policy.dtensor_cfg.lr=-0.1",
        ],
        2,
        r"policy\.dtensor_cfg: lr, eps, clip_grad must be >= 0",
    ),
    ("tp-0", [*GRPO, "{W}/run.yaml", "policy.megatron_cfg.tensor_model_parallel_size=0"], 2, r"must be >= 1"),
    ("vocab-multiple-0", [*GRPO, "{W}/run.yaml", "policy.megatron_cfg.make_vocab_size_divisible_by=0"], 2, r">= 1"),
    (
        "model-path-missing",
        [*GRPO, "{W}/run.yaml", "policy.model_path={W}/nowhere"],
        2,
        r"policy\.model_path: no such directory: {W}/nowhere$",
    ),
    (
        "tokenizer-given-missing",
        [*GRPO, "{W}/run.yaml", "policy.tokenizer={W}/nowhere.json"],
        2,
        r"policy\.tokenizer: no such file",
    ),
    # the tiny HF model has no tokenizer.json: found before the model is converted (no run directory appears)
    ("tokenizer-not-found", [*GRPO, "{W}/run.yaml"], 2, r"no tokenizer\.json found .*; set policy\.tokenizer"),
    # nor in a Megatron checkpoint's HF assets: found before the DTensor backend exports it to HF, or a log
    # directory is made for the megatron-core backend
    (
        "tokenizer-not-in-checkpoint-assets",
        [*GRPO, "{W}/run.yaml", "policy.model_path={W}/mcore"],
        2,
        r"no tokenizer\.json found \(looked at \['{W}/mcore/hf_assets'\]\)",
    ),
    (
        "dtensor-tokenizer-not-in-checkpoint-assets",
        [*GRPO, "{W}/run.yaml", "policy.model_path={W}/mcore", *DTENSOR],
        2,
        r"no tokenizer\.json found \(looked at \['{W}/mcore/hf_assets'\]\)",
    ),
]


def _expand(cases: list[Case]) -> list[Case]:
    # "+decay=N" is shorthand for the scheduler's decay steps (keeps the table rows short)
    return [
        (cid, [a.replace("+decay=", "policy.megatron_cfg.scheduler.lr_decay_steps=") for a in argv], code, msg)
        for cid, argv, code, msg in cases
    ]


MATRIX = {
    "convert-to-mcore": CONVERT_TO_MCORE,
    "convert-to-hf": CONVERT_TO_HF,
    "verify": VERIFY,
    "inspect": INSPECT,
    "export": EXPORT,
    "demo": DEMO,
    "train-grpo": _expand(TRAIN_GRPO),
}


@pytest.mark.parametrize(
    ("argv", "code", "message"),
    [
        pytest.param(argv, code, message, id=f"{command}:{cid}")
        for command, cases in MATRIX.items()
        for cid, argv, code, message in cases
    ],
)
def test_bad_input_is_one_line_and_changes_nothing(workspace, argv, code, message):
    assert_refused(workspace, argv, code, message)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--ep", "2"], r"legacy MoE checkpoints are written for the local spec \(--spec local\)"),
        (["--tp", "2", "--etp", "1", "--spec", "local"], r"expert tensor parallelism equal to tp; use torch_dist"),
    ],
    ids=["te-spec", "etp-not-tp"],
)
def test_legacy_format_of_a_moe_model_is_refused_before_anything_is_written(tiny_moe_models, tmp_path, extra, message):
    """What the legacy format cannot hold is one line before the output's staging directory (or a progress bar)
    exists, not an error from inside the writer."""
    source = tiny_moe_models["qwen3_moe"]
    before = snapshot(source.parent, tmp_path)
    argv = ["convert", "--to", "mcore", "--format", "torch", *extra, str(source), str(tmp_path / "out")]
    result = runner.invoke(app, argv)  # with the progress bar on: it must not have started
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and re.search(message, lines[0]), result.output
    assert_unchanged(before, source.parent, tmp_path)


# --- read-only destination --------------------------------------------------------------------------------------


@pytest.fixture
def read_only_dir(tmp_path) -> Path:
    """A directory nobody may write in: a read-only tmpfs where mounting is allowed (root ignores permission
    bits), else a chmod 0555 directory for an ordinary user; skipped where neither works."""
    target = tmp_path / "ro"
    target.mkdir()
    if os.geteuid() != 0:
        target.chmod(0o555)
        yield target
        target.chmod(0o755)
        return
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(target)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"running as root and cannot mount a read-only tmpfs: {mounted.stderr.decode().strip()}")
    try:
        yield target
    finally:
        subprocess.run(["umount", str(target)], check=True)


@pytest.mark.parametrize(
    "argv",
    [
        [*TO_MCORE, "{W}/llama", "{RO}/out"],
        [*TO_MCORE, "{W}/llama", "{RO}/deeper/out"],
        [*TO_HF, "{W}/mcore", "{RO}/out"],
        ["export", "{W}/empty", "{RO}/out"],
        ["demo", "{RO}/demo"],
    ],
    ids=["convert-to-mcore", "convert-to-mcore-nested", "convert-to-hf", "export", "demo"],
)
def test_read_only_destination_is_refused_up_front(workspace, read_only_dir, argv):
    assert not os.access(read_only_dir, os.W_OK)
    argv = [part.replace("{RO}", str(read_only_dir)) for part in argv]
    before = snapshot(read_only_dir)
    assert_refused(workspace, argv, 2, r"cannot write in .*ro \(read-only or no permission\)")
    assert_unchanged(before, read_only_dir)


# --- bad input is reported before the heavy libraries load ------------------------------------------------------

_PROBE = """
import sys
import time
from hf_mcore_bridge.cli.main import app
heavy = ("torch", "transformers", "megatron", "safetensors", "numpy")
try:
    app(sys.argv[1:])
except SystemExit as exit:
    loaded = sorted(name for name in heavy if name in sys.modules)
    print(f"exit={exit.code} loaded={','.join(loaded)}")
"""


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["convert", "-h"],
        ["--version"],
        ["convert", "--to", "mcore", "/nonexistent", "/tmp/x"],
        ["convert", "--to", "hf", "--max-shard-size", "lots", "{W}/mcore", "{W}/out"],
        ["verify", "{W}/llama", "{W}/mcore", "--tp", "3"],
        ["inspect", "/nonexistent"],
        ["train", "grpo", "--config", "/nonexistent.yaml"],
        ["train", "grpo", "--config", "{W}/run.yaml", "policy.megatron_cfg.optimizer.lr=-1.0"],
        ["train", "grpo", "--config", "{W}/run.yaml", "logger.num_val_samples_to_print=-1"],
    ],
    ids=[
        "help",
        "convert-help",
        "version",
        "convert-missing",
        "shard-size",
        "verify-tp3",
        "inspect",
        "grpo",
        "grpo-value",
        "grpo-last-cheap-check",
    ],
)
def test_no_heavy_import_before_the_first_output(workspace, argv):
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, *_argv(argv, workspace)], capture_output=True, text=True, timeout=60
    )
    last = result.stdout.strip().splitlines()[-1]
    assert last.endswith("loaded="), result.stdout + result.stderr
    assert last.startswith(("exit=0", "exit=2")), result.stdout
    if last.startswith("exit=0"):  # help and version: nothing on stderr (no library's import warnings)
        assert result.stderr == "", result.stderr
    else:
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr


# --- polish --------------------------------------------------------------------------------------------------------


def test_version_is_the_installed_distributions():
    from importlib.metadata import version

    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"hf-mcore-bridge {version('hf-mcore-bridge')}"


@pytest.mark.parametrize(
    "command", [["convert"], ["verify"], ["inspect"], ["export"], ["demo"], ["train", "grpo"]], ids=" ".join
)
def test_short_help_with_an_example(command):
    short, long = runner.invoke(app, [*command, "-h"]), runner.invoke(app, [*command, "--help"])
    assert short.exit_code == 0 and short.output == long.output
    examples = short.output.split("Examples:")[1]
    assert f"bridge {' '.join(command)} " in examples, short.output


def test_tokenizer_option_puts_its_files_in_the_export(workspace, tmp_path):
    """The accepted neighbour of `tokenizer-without-tokenizer-files`: a directory with tokenizer files is copied."""
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text('{"version": "1.0"}')
    (tokenizer / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    result = runner.invoke(
        app, [*TO_HF, "--tokenizer", str(tokenizer), str(workspace / "mcore"), str(tmp_path / "out")]
    )
    assert result.exit_code == 0, result.output
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "out" / name).read_bytes() == (tokenizer / name).read_bytes()


# --- the snapshot helper itself ------------------------------------------------------------------------------------


def test_snapshot_sees_every_kind_of_change(tmp_path):
    data = tmp_path / "a" / "f"
    data.parent.mkdir()
    data.write_bytes(b"x" * 10)
    mode = data.stat().st_mode & 0o777
    before = snapshot(tmp_path)
    assert_unchanged(before, tmp_path)
    changes = {
        "one byte": (lambda: data.write_bytes(b"x" * 9 + b"y"), lambda: data.write_bytes(b"x" * 10)),
        "a staging sibling": (lambda: (tmp_path / ".a.partial-1").mkdir(), lambda: (tmp_path / ".a.partial-1").rmdir()),
        "the mode": (lambda: data.chmod(0o600 if mode != 0o600 else 0o644), lambda: data.chmod(mode)),
        "a removal": (data.unlink, lambda: data.write_bytes(b"x" * 10)),
    }
    for change, undo in changes.values():
        change()
        with pytest.raises(AssertionError, match=r"added|removed|changed"):
            assert_unchanged(before, tmp_path)
        undo()
        assert_unchanged(before, tmp_path)


# --- verify's verdicts and interrupts -------------------------------------------------------------------------------


@pytest.mark.slow
def test_verify_fail_exits_1_without_an_internal_error(workspace, tmp_path):
    """A checkpoint that does not hold the HF model: FAIL and exit status 1; the same checkpoint against its own
    model: OK and 0 (so the FAIL comes from the changed weight, not from the command)."""
    from safetensors.torch import load_file, save_file

    changed = Path(shutil.copytree(workspace / "llama", tmp_path / "changed"))
    tensors = load_file(changed / "model.safetensors")
    tensors["model.layers.3.post_attention_layernorm.weight"] *= 1.5
    save_file(tensors, changed / "model.safetensors", metadata={"format": "pt"})
    before = snapshot(workspace, changed)
    failed = runner.invoke(app, ["verify", str(changed), str(workspace / "mcore"), "--seq-len", "8", "--batch", "1"])
    assert failed.exit_code == 1, failed.output
    assert failed.output.startswith("FAIL ") and "error" not in failed.output, failed.output
    passed = runner.invoke(app, ["verify", str(workspace / "llama"), str(workspace / "mcore"), "--seq-len", "8"])
    assert passed.exit_code == 0 and passed.output.startswith("OK "), passed.output
    assert_unchanged(before, workspace, changed)


@pytest.mark.slow
def test_verify_interrupted_by_ctrl_c_exits_130_and_cleans_up(workspace, tmp_path):
    """SIGINT to the whole process group (what Ctrl-C does) once the ranks run: status 130, one line, the scratch
    directory removed, the sources unchanged."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    before = snapshot(workspace)
    bridge = Path(sys.executable).parent / "bridge"
    process = subprocess.Popen(
        [str(bridge), "verify", str(workspace / "llama"), str(workspace / "mcore")],
        env={**os.environ, "TMPDIR": str(scratch)},
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for _ in range(1200):  # the world starts once verify has made its scratch directory
            if any(scratch.glob("bridge-verify-*")) or process.poll() is not None:
                break
            time.sleep(0.05)
        time.sleep(1.0)
        os.killpg(process.pid, signal.SIGINT)
        out, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 130, out + err
    lines = [line for line in (out + err).splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("stopped by SIGINT"), out + err
    assert list(scratch.iterdir()) == []  # neither the scratch directory nor torch's per-rank error files
    assert_unchanged(before, workspace)


# --- the cheap layout check against config.json ---------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["mixtral", "qwen3_moe", "qwen2_moe"])
def test_expert_parallel_sizes_checked_against_the_config(variant, tiny_moe_models):
    """EP must divide the expert count the config states under its family's key (8, 8 and 4 experts here)."""
    from hf_mcore_bridge.cli.validate import layout_fits
    from hf_mcore_bridge.errors import LayoutError

    config = json.loads((tiny_moe_models[variant] / "config.json").read_text())
    experts = config.get("num_local_experts") or config["num_experts"]
    layout_fits(Layout(tp=2, ep=2), config)
    layout_fits(Layout(ep=experts), config)
    with pytest.raises(LayoutError, match=f"num_experts={experts} is not divisible by ep=3"):
        layout_fits(Layout(ep=3), config)


def test_debug_raises_the_up_front_error_with_its_traceback(workspace):
    from hf_mcore_bridge.errors import BridgeError

    result = runner.invoke(app, ["--debug", "verify", str(workspace / "llama"), str(workspace / "mcore"), "--tp", "3"])
    assert result.exit_code != 0 and isinstance(result.exception, BridgeError)
    assert "num_attention_heads=8 is not divisible by tp=3" in str(result.exception)


# --- signals while a command loads, a launcher's world of the wrong size ---------------------------------------------


def _wait_for_library(pid: int, name: str, timeout: float = 120.0) -> None:
    """Until process `pid` has mapped a shared library whose path contains `name` (it is importing it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if name in Path(f"/proc/{pid}/maps").read_text():
                return
        except FileNotFoundError:
            break
        time.sleep(0.01)
    raise AssertionError(f"process {pid} ended or did not load {name} within {timeout:.0f} s")


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize(
    ("signum", "status", "background"),
    [(signal.SIGTERM, 143, False), (signal.SIGINT, 130, False), (signal.SIGINT, 130, True)],
    ids=["term", "int", "int-background"],
)
def test_a_signal_while_export_loads_ends_it_with_its_cleanup(workspace, signum, status, background):
    """SIGTERM (or Ctrl-C) while `export` is still loading its libraries, before its output exists: the status a
    shell reports for the signal (not death by it: -15 to the parent), the one line, and nothing left behind. Also
    SIGINT to an export started ignoring it, as a script's background job is."""
    before = snapshot(workspace)
    bridge = Path(sys.executable).parent / "bridge"
    command = [str(bridge), "export", str(workspace / "mcore"), str(workspace / "out")]
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_ignore_sigint if background else None,
    )
    try:
        _wait_for_library(process.pid, "libtorch")
        process.send_signal(signum)
        out, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == status, out + err
    assert [line for line in (out + err).splitlines() if line.strip()] == [
        "interrupted; nothing was written to the destination"
    ], out + err
    assert_unchanged(before, workspace)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_a_torchrun_world_of_the_wrong_size_is_one_line_from_rank_0(workspace, tmp_path):
    """`torchrun --nproc-per-node 2` (gloo on CPU) of a config that lays out 4 ranks: between them the ranks print
    one line, from global rank 0, which exits with status 2 (torchrun's summary names it the root cause); rank 1
    says nothing and is stopped by torchrun once rank 0 has failed. torchrun then reports the failure as it reports
    any failed rank, with its own summary and status 1: that part is torchrun's (`launcher/api.py` raises
    `ChildFailedError` for any non-zero rank), not something a rank can change."""
    before = snapshot(workspace)
    logs = tmp_path / "torchrun"
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_free_port())),
        *("--log-dir", str(logs), "--redirects", "3"),  # each rank's stdout and stderr in its own files
        *("-m", "hf_mcore_bridge.cli.main", "train", "grpo", "--config", str(workspace / "run.yaml")),
        "cluster.gpus_per_node=4",
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "BRIDGE_DEBUG")}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env | {"OMP_NUM_THREADS": "1"})
    printed = {
        rank: [
            line
            for path in sorted(logs.glob(f"*/attempt_0/{rank}/std*.log"))
            for line in path.read_text().splitlines()
            if line.strip()
        ]
        for rank in (0, 1)
    }
    assert printed == {
        0: [
            "error: the launcher started WORLD_SIZE=2 ranks but cluster.gpus_per_node x cluster.num_nodes (4 x 1)"
            " needs 4"
        ],
        1: [],
    }, done.stderr[-3000:]
    root_cause = done.stderr.split("Root Cause (first observed failure):")[-1]
    assert re.search(r"rank\s*: 0 \(local_rank: 0\)\n\s*exitcode\s*: 2 ", root_cause), done.stderr[-3000:]
    assert done.returncode == 1
    assert_unchanged(before, workspace)
