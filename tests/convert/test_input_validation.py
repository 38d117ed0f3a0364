"""Every tensor's shape and dtype checked against the config before anything is written; failures while writing
reported with their real cause (full disk, truncated source, interrupt): one line, the right exit status, no
destination left behind and the sources untouched."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from hf_mcore_bridge.cli.main import app
from hf_mcore_bridge.convert.layout import Layout
from hf_mcore_bridge.convert.to_mcore import convert_hf_to_mcore
from hf_mcore_bridge.errors import BridgeError

runner = CliRunner()


def run(*args: object):
    return runner.invoke(app, [str(a) for a in args])


def snapshot(*roots: Path) -> dict[str, str]:
    """sha256 of every file under the roots."""
    return {
        str(p): hashlib.sha256(p.read_bytes()).hexdigest()
        for root in roots
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def assert_refused(result, parent: Path, source: Path, before: dict[str, str], *fragments: str, status: int = 2) -> str:
    """Exit `status`, one line holding every fragment, no destination or staging directory in `parent`, and the
    source byte-for-byte as it was (`before`)."""
    assert result.exit_code == status, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    assert lines[0].startswith("error: ") or status != 2, lines[0]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert not [p for p in parent.iterdir() if p.name == "out" or p.name.startswith(".out")], list(parent.iterdir())
    assert snapshot(source) == before
    return lines[0]


def _rewrite(hf_dir: Path, change) -> None:
    tensors = load_file(hf_dir / "model.safetensors")
    change(tensors)
    save_file(tensors, hf_dir / "model.safetensors", metadata={"format": "pt"})


def _to_mcore(src: Path, dst: Path, *extra: object):
    return run("convert", "--to", "mcore", src, dst, "--no-progress", *extra)


def _to_hf(src: Path, dst: Path, *extra: object):
    return run("convert", "--to", "hf", src, dst, "--no-progress", *extra)


@pytest.fixture
def llama(tiny_models, tmp_path) -> Path:
    return Path(shutil.copytree(tiny_models["llama"], tmp_path / "llama"))


L0 = "model.layers.0"
# the tiny Llama: hidden 64, 8 heads x head_dim 8, 4 KV heads, intermediate 96, vocab 211, untied
SHAPE_CASES = {
    "q_proj width": (f"{L0}.self_attn.q_proj.weight", (64, 60), "(64, 64)", "hidden_size=64"),
    "q_proj rows": (f"{L0}.self_attn.q_proj.weight", (56, 64), "(64, 64)", "num_attention_heads * head_dim=64"),
    "o_proj length": (f"{L0}.self_attn.o_proj.weight", (64, 48), "(64, 64)", "num_attention_heads * head_dim=64"),
    "down_proj length": ("model.layers.5.mlp.down_proj.weight", (64, 95), "(64, 96)", "intermediate_size=96"),
    "gate_proj rows": ("model.layers.2.mlp.gate_proj.weight", (80, 64), "(96, 64)", "intermediate_size=96"),
    "norm length": (f"{L0}.input_layernorm.weight", (63,), "(64,)", "hidden_size=64"),
    "embedding columns": ("model.embed_tokens.weight", (211, 60), "(211, 64)", "vocab_size=211"),
    "lm_head columns": ("lm_head.weight", (211, 65), "(211, 64)", "hidden_size=64"),
    "lm_head rows": ("lm_head.weight", (212, 64), "(211, 64)", "vocab_size=211"),
    "1-D weight": (f"{L0}.mlp.down_proj.weight", (64 * 96,), "(64, 96)", "intermediate_size=96"),
    "3-D weight": (f"{L0}.self_attn.k_proj.weight", (1, 32, 64), "(32, 64)", "num_key_value_heads * head_dim=32"),
    "2-D norm": ("model.norm.weight", (1, 64), "(64,)", "hidden_size=64"),
}


@pytest.mark.parametrize("case", SHAPE_CASES)
def test_hf_shape_against_config(case, llama, tmp_path):
    name, shape, expected, fields = SHAPE_CASES[case]
    _rewrite(llama, lambda t: t.update({name: torch.zeros(shape)}))
    before = snapshot(llama)
    found = str(shape)
    assert_refused(
        _to_mcore(llama, tmp_path / "out"), tmp_path, llama, before, name, "model.safetensors", found, expected, fields
    )


def test_qwen_biases_and_qk_norms(tiny_models, tmp_path):
    qwen2 = Path(shutil.copytree(tiny_models["qwen2"], tmp_path / "qwen2"))
    _rewrite(qwen2, lambda t: t.update({"model.layers.1.self_attn.v_proj.bias": torch.zeros(31)}))
    assert_refused(
        _to_mcore(qwen2, tmp_path / "out"),
        tmp_path,
        qwen2,
        snapshot(qwen2),
        "v_proj.bias",
        "(31,)",
        "(32,)",
        "head_dim",
    )
    qwen3 = Path(shutil.copytree(tiny_models["qwen3"], tmp_path / "qwen3"))  # head_dim 32
    _rewrite(qwen3, lambda t: t.update({"model.layers.3.self_attn.k_norm.weight": torch.zeros(8)}))
    assert_refused(
        _to_mcore(qwen3, tmp_path / "out"), tmp_path, qwen3, snapshot(qwen3), "k_norm", "(32,)", "head_dim=32"
    )


# the tiny Qwen3-MoE: 8 experts of width 32, hidden 64; layer 1 is dense (intermediate 96)
MOE_CASES = {
    "expert down_proj": ("model.layers.2.mlp.experts.5.down_proj.weight", (64, 31), "(64, 32)", "moe_intermediate"),
    "expert up_proj 3-D": ("model.layers.0.mlp.experts.0.up_proj.weight", (1, 32, 64), "(32, 64)", "moe_intermediate"),
    "router experts": ("model.layers.3.mlp.gate.weight", (7, 64), "(8, 64)", "experts=8"),
    "dense layer MLP": ("model.layers.1.mlp.up_proj.weight", (32, 64), "(96, 64)", "intermediate_size=96"),
}


@pytest.mark.parametrize("case", MOE_CASES)
def test_moe_expert_shapes(case, tiny_moe_models, tmp_path):
    name, shape, expected, fields = MOE_CASES[case]
    model = Path(shutil.copytree(tiny_moe_models["qwen3_moe"], tmp_path / "moe"))
    _rewrite(model, lambda t: t.update({name: torch.zeros(shape)}))
    assert_refused(_to_mcore(model, tmp_path / "out"), tmp_path, model, snapshot(model), name, expected, fields)


def _fuse_experts(tensors: dict[str, torch.Tensor], experts: int, layers: int) -> None:
    """Rewrite per-expert weights in the transformers-5 fused layout (gate_up_proj [E, 2F, H], down_proj [E, H, F])."""
    for layer in range(layers):
        prefix = f"model.layers.{layer}.mlp.experts"
        if f"{prefix}.0.gate_proj.weight" not in tensors:
            continue
        parts = [[tensors.pop(f"{prefix}.{e}.{p}_proj.weight") for e in range(experts)] for p in ("gate", "up", "down")]
        tensors[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat(gu) for gu in zip(parts[0], parts[1], strict=True)])
        tensors[f"{prefix}.down_proj"] = torch.stack(parts[2])


def test_fused_expert_layout_is_checked(tiny_moe_models, tmp_path):
    model = Path(shutil.copytree(tiny_moe_models["qwen3_moe"], tmp_path / "moe"))
    _rewrite(model, lambda t: _fuse_experts(t, 8, 4))
    assert _to_mcore(model, tmp_path / "ok").exit_code == 0  # the fused layout itself is accepted
    shutil.rmtree(tmp_path / "ok")
    name = "model.layers.2.mlp.experts.gate_up_proj"
    _rewrite(model, lambda t: t.update({name: t[name][:6]}))  # 6 experts where the config says 8
    assert_refused(
        _to_mcore(model, tmp_path / "out"),
        tmp_path,
        model,
        snapshot(model),
        name,
        "(6, 64, 64)",
        "(8, 64, 64)",
        "experts=8",
    )


# --- dtypes ---


def test_mixed_dtypes_refused_without_dtype(llama, tmp_path):
    norm = "model.layers.4.post_attention_layernorm.weight"
    _rewrite(llama, lambda t: t.update({norm: t[norm].to(torch.bfloat16)}))
    before = snapshot(llama)
    assert_refused(
        _to_mcore(llama, tmp_path / "out"), tmp_path, llama, before, "mixes dtypes", "bfloat16", norm, "--dtype"
    )

    result = _to_mcore(llama, tmp_path / "out", "--dtype", "fp32")
    assert result.exit_code == 0, result.output
    notes = [line for line in result.output.splitlines() if line.startswith("note: ")]
    assert len(notes) == 1 and "mixes dtypes" in notes[0] and "float32" in notes[0], result.output
    assert snapshot(llama) == before

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(tmp_path / "out" / "release")).read_metadata()
    dtypes = {m.properties.dtype for m in metadata.state_dict_metadata.values() if isinstance(m, TensorStorageMetadata)}
    assert dtypes == {torch.float32}
    # the cast norm holds exactly the bf16 values, widened (torch's own loader, preallocated by the metadata)
    key = "decoder.layers.mlp.linear_fc1.layer_norm_weight"
    state = {key: torch.empty(metadata.state_dict_metadata[key].size)}
    torch.distributed.checkpoint.load(state, storage_reader=FileSystemReader(str(tmp_path / "out" / "release")))
    assert torch.equal(state[key][4], load_file(llama / "model.safetensors")[norm].to(torch.float32))


def test_integer_weights_refused_even_with_dtype(llama, tmp_path):
    norm = "model.norm.weight"
    _rewrite(llama, lambda t: t.update({norm: torch.ones(64, dtype=torch.int32)}))
    before = snapshot(llama)
    for extra in ((), ("--dtype", "bf16")):
        assert_refused(
            _to_mcore(llama, tmp_path / "out", *extra), tmp_path, llama, before, norm, "int32", "must be floating point"
        )


# --- Megatron sources (--to hf) ---


@pytest.fixture
def dcp(tiny_models, tmp_path) -> Path:
    out = tmp_path / "mcore"
    convert_hf_to_mcore(tiny_models["llama"], out, layout=Layout(tp=2), show_progress=False)
    return out


@pytest.fixture
def legacy(tiny_models, tmp_path) -> Path:
    out = tmp_path / "legacy"
    convert_hf_to_mcore(tiny_models["llama"], out, layout=Layout(tp=2), show_progress=False, checkpoint_format="torch")
    return out


def _rank_files(root: Path) -> list[Path]:
    return sorted((root / "release").glob("mp_rank_*/model_optim_rng.pt"))


def _edit_legacy(root: Path, change) -> None:
    for path in _rank_files(root):
        state = torch.load(path, weights_only=False)
        change(state)
        torch.save(state, path)


def test_dcp_global_shape_against_args(dcp, tmp_path):
    from hf_mcore_bridge.checkpoint.megatron_dirs import read_common

    common = read_common(dcp / "release")
    common["args"].ffn_hidden_size = 80
    torch.save(common, dcp / "release" / "common.pt")
    shutil.rmtree(dcp / "hf_assets")  # the config is rebuilt from args
    assert_refused(
        _to_hf(dcp, tmp_path / "out"),
        tmp_path,
        dcp,
        snapshot(dcp),
        "decoder.layers.mlp.linear_fc1.weight",
        "__0_0.distcp",
        "(8, 192, 64)",
        "(8, 160, 64)",
        "ffn_hidden_size=80",
    )


def test_legacy_global_shape_against_args(legacy, tmp_path):
    def wrong_groups(state):
        state["args"].num_query_groups = 2
        state["args"].kv_channels = 8

    _edit_legacy(legacy, wrong_groups)
    shutil.rmtree(legacy / "hf_assets")
    assert_refused(
        _to_hf(legacy, tmp_path / "out"),
        tmp_path,
        legacy,
        snapshot(legacy),
        "decoder.layers.self_attention.linear_qkv.weight",
        "mp_rank_00/model_optim_rng.pt",
        "(8, 128, 64)",
        "(8, 96, 64)",
        "num_query_groups * kv_channels=16",
    )


def test_legacy_shard_that_differs_between_ranks(legacy, tmp_path):
    path = _rank_files(legacy)[1]
    state = torch.load(path, weights_only=False)
    state["model"]["decoder.layers.3.mlp.linear_fc2.weight"] = torch.zeros(64, 40)
    torch.save(state, path)
    assert_refused(
        _to_hf(legacy, tmp_path / "out"), tmp_path, legacy, snapshot(legacy), "mp_rank_01", "linear_fc2", "(64, 48)"
    )


def test_truncated_legacy_file(legacy, tmp_path):
    path = _rank_files(legacy)[1]  # only rank 0 was read before the first write, before this was checked
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    assert_refused(_to_hf(legacy, tmp_path / "out"), tmp_path, legacy, snapshot(legacy), str(path), "unreadable")


def test_megatron_mixed_and_integer_dtypes(legacy, tmp_path):
    key = "decoder.final_layernorm.weight"
    _edit_legacy(legacy, lambda s: s["model"].update({key: s["model"][key].to(torch.bfloat16)}))
    before = snapshot(legacy)
    assert_refused(_to_hf(legacy, tmp_path / "out"), tmp_path, legacy, before, "mixes dtypes", key, "--dtype")
    result = _to_hf(legacy, tmp_path / "out", "--dtype", "bf16")
    assert result.exit_code == 0 and "note: the checkpoint mixes dtypes" in result.output, result.output
    assert {t.dtype for t in load_file(tmp_path / "out" / "model.safetensors").values()} == {torch.bfloat16}
    shutil.rmtree(tmp_path / "out")

    _edit_legacy(legacy, lambda s: s["model"].update({key: torch.ones(64, dtype=torch.int32)}))
    assert_refused(
        _to_hf(legacy, tmp_path / "out", "--dtype", "fp32"),
        tmp_path,
        legacy,
        snapshot(legacy),
        key,
        "int32",
        "floating",
    )


def test_interrupted_export_exits_130_and_leaves_nothing(dcp, tmp_path, monkeypatch):
    from hf_mcore_bridge.checkpoint import parallel_write

    calls = {"n": 0}
    original = parallel_write.write_pieces

    def interrupt_midway(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 10:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(parallel_write, "write_pieces", interrupt_midway)
    assert_refused(_to_hf(dcp, tmp_path / "out"), tmp_path, dcp, snapshot(dcp), "interrupted", status=130)


# --- full disk ---


def _mounted_tmpfs(directory: Path, options: str):
    """A tmpfs mounted at `directory` (root only), unmounted afterwards; skips where mounting is not permitted."""
    if shutil.which("mount") is None or shutil.which("umount") is None:
        pytest.skip("no mount command here to create a small tmpfs")
    directory.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(directory)], capture_output=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.decode().strip() or result.returncode}")
    yield directory
    subprocess.run(["umount", str(directory)], check=True)


@pytest.fixture
def small_disk(tmp_path):
    """A 512 KiB tmpfs: a real full disk for writers, not a simulated error."""
    yield from _mounted_tmpfs(tmp_path / "small", "size=512k")


@pytest.fixture
def read_only_disk(tmp_path):
    yield from _mounted_tmpfs(tmp_path / "ro", "ro,size=512k")


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_full_disk_to_mcore(fmt, llama, small_disk):
    before = snapshot(llama)
    result = _to_mcore(llama, small_disk / "out", "--format", fmt)
    line = assert_refused(result, small_disk, llama, before, f"no space left on {small_disk} (tmpfs) while writing")
    written = ("__0_0.distcp", "__0_1.distcp") if fmt == "torch_dist" else ("mp_rank_00/model_optim_rng.pt",)
    assert any(f"{small_disk / 'out' / 'release' / name}" in line for name in written), line  # the data files
    assert os.listdir(small_disk) == []


def test_full_disk_to_hf(dcp, small_disk):
    before = snapshot(dcp)
    result = _to_hf(dcp, small_disk / "out")
    line = assert_refused(result, small_disk, dcp, before, f"no space left on {small_disk} (tmpfs) while writing")
    assert f"{small_disk / 'out' / 'model.safetensors'}" in line or "model-0000" in line, line
    assert os.listdir(small_disk) == []


def test_full_disk_while_copying_is_a_write_error_naming_the_target(llama, small_disk):
    """`shutil.copy2` names its source first when the write fails: still a write error, naming what was written."""
    from hf_mcore_bridge.checkpoint.write_errors import WriteError, device_of, reported_write_errors

    staging = small_disk / ".out.partial-0123abcd"
    staging.mkdir()
    with pytest.raises(WriteError) as caught, reported_write_errors(staging, small_disk / "out"):
        shutil.copy2(llama / "model.safetensors", staging / "model.safetensors")  # 1.1 MB onto 512 KiB
    expected = f"no space left on {device_of(staging)} while writing {small_disk / 'out' / 'model.safetensors'}"
    assert str(caught.value) == expected


def test_full_disk_export_of_a_dtensor_run(llama, small_disk, tmp_path):
    """A DTensor run's checkpoint holds its policy as an HF directory, which export copies: a full disk there is
    one line and exit 2, not an internal error."""
    from hf_mcore_bridge.grpo.backends.dtensor.checkpoint import HF_DIR

    checkpoints = tmp_path / "run" / "checkpoints"
    shutil.copytree(llama, checkpoints / "iter_0000001" / HF_DIR)
    (checkpoints / "latest_checkpointed_iteration.txt").write_text("1")
    before = snapshot(tmp_path / "run")
    result = run("export", tmp_path / "run", small_disk / "out")
    line = assert_refused(result, small_disk, tmp_path / "run", before, f"no space left on {small_disk} (tmpfs)")
    assert line.endswith(f"while writing {small_disk / 'out' / 'model.safetensors'}"), line
    assert os.listdir(small_disk) == []


def test_full_disk_demo(small_disk):
    """The demo's first write (the tiny model's `save_pretrained`, whose serializer reports `(os error 28)`)."""
    result = run("demo", small_disk / "demo", "--tp", "1", "--pp", "1")
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: no space left on {small_disk} (tmpfs) while writing")
    assert os.listdir(small_disk) == []


def test_read_only_destination(llama, read_only_disk, tmp_path):
    """The CLI refuses a read-only destination up front; the library, called directly, reports the failed write."""
    before = snapshot(llama)
    result = _to_mcore(llama, read_only_disk / "out")
    assert_refused(result, read_only_disk, llama, before, f"cannot write in {read_only_disk} (read-only")
    with pytest.raises(BridgeError) as caught:
        convert_hf_to_mcore(llama, read_only_disk / "out", show_progress=False)
    assert f"{read_only_disk} (tmpfs) is read-only; cannot write {read_only_disk / 'out'}" in str(caught.value)
    assert snapshot(llama) == before and list(read_only_disk.iterdir()) == []
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary sibling anywhere


def test_write_error_description_names_cause(tmp_path):
    import errno

    from hf_mcore_bridge.checkpoint.write_errors import describe, probe_errno

    file = tmp_path / "x"
    assert describe(errno.EDQUOT, file, "/d", "") == f"disk quota exceeded on /d while writing {file}"
    assert describe(errno.EROFS, file, "/d", "") == f"/d is read-only; cannot write {file}"
    assert describe(None, file, "/d", "boom") == f"writing {file} failed: boom"
    assert probe_errno(tmp_path) is None and list(tmp_path.iterdir()) == []


def test_config_vocabulary_larger_than_the_checkpoints(dcp, tmp_path):
    config = json.loads((dcp / "hf_assets" / "config.json").read_text())
    config["vocab_size"] = 300  # the checkpoint's embedding has 256 rows (211 padded for tp=2)
    (dcp / "hf_assets" / "config.json").write_text(json.dumps(config))
    assert_refused(
        _to_hf(dcp, tmp_path / "out"),
        tmp_path,
        dcp,
        snapshot(dcp),
        "embedding.word_embeddings.weight",
        "(256, 64)",
        "vocab_size=300",
    )


def test_write_errors_are_told_from_read_errors(tmp_path):
    import errno

    from hf_mcore_bridge.checkpoint.write_errors import WriteError, device_of, reported_write_errors
    from hf_mcore_bridge.errors import CheckpointError

    staging, destination = tmp_path / ".out.partial", tmp_path / "out"
    (staging / "release").mkdir(parents=True)
    (staging / "release" / "a.bin").write_bytes(b"x")

    def raised(error: BaseException) -> BaseException:
        with pytest.raises(BaseException) as info, reported_write_errors(staging, destination):
            raise error
        return info.value

    written = raised(OSError(errno.EIO, "Input/output error"))  # a write() failure carries no file name
    assert isinstance(written, WriteError)
    assert str(written) == f"I/O error on {device_of(staging)} while writing {destination / 'release' / 'a.bin'}"
    read = raised(OSError(errno.EIO, "Input/output error", "/elsewhere/model.safetensors"))
    assert isinstance(read, CheckpointError) and not isinstance(read, WriteError)
    assert str(read) == "input/output error while reading /elsewhere/model.safetensors"
    unrelated = RuntimeError("unrelated")
    assert raised(unrelated) is unrelated  # not a write failure: passes through unchanged


def test_verify_refuses_sequences_beyond_the_models_positions_before_any_rank(dcp, tiny_models):
    """The library's check (the command line makes the same one from config.json up front): `seq_len` past the
    checkpoint's `max_position_embeddings` is refused before the world starts, naming both numbers."""
    from hf_mcore_bridge.megatron.verify import VerifyJob, verify

    limit = json.loads((tiny_models["llama"] / "config.json").read_text())["max_position_embeddings"]
    with pytest.raises(BridgeError, match=rf"--seq-len {limit + 2} is longer than .* max_position_embeddings={limit}"):
        verify([VerifyJob(tiny_models["llama"], dcp)], Layout(), seq_len=limit + 2)


def test_a_forbidden_global_in_a_legacy_rank_file_is_one_line_naming_it(legacy, tmp_path):
    """Megatron files are read weights-only with an allow-list: a rank file whose pickle names `os.system` is
    refused naming the global (torch's own message is three lines suggesting `weights_only=False`)."""

    class RunsCode:
        def __reduce__(self):
            return os.system, (f"touch {tmp_path / 'ran'}",)

    (path,) = _rank_files(legacy)[:1]
    state = torch.load(path, weights_only=False)
    state["extra"] = RunsCode()
    torch.save(state, path)
    result = runner.invoke(app, ["convert", "--to", "hf", str(legacy), str(tmp_path / "out"), "--no-progress"])
    assert result.exit_code == 2, result.output
    (line,) = [line for line in result.output.splitlines() if line.strip()]
    assert line == (
        f"error: {path} refers to posix.system, which a weights-only load does not import or call (a pickle can run"
        " code); it was not loaded"
    )
    assert not (tmp_path / "ran").exists() and not (tmp_path / "out").exists()
