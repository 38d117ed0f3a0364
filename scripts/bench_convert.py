"""Speed and peak memory of `bridge convert`, both directions, against `cp -r` of the same checkpoint.

What it measures, per model size and in the same run:

- `cp -r SRC COPY`: the floor for any tool that reads a checkpoint and writes one of the same size (GNU cp copies
  in the kernel with copy_file_range, so it never moves the bytes through user space);
- `bridge convert --to mcore SRC DST --tp 2 --pp 2` (torch_dist) and `bridge convert --to hf DST BACK`;
- the same pair with `--format torch` (legacy per-rank files), only when a tiny probe shows that the option
  really writes the legacy format and round-trips bit-exactly; otherwise the reason is reported, nothing timed.
- with `--torch-writer`, also `--to mcore` written through torch's own writers (`torch.save` per item, DCP's
  `.metadata`; `HF_MCORE_BRIDGE_TORCH_WRITER=1`, what a conversion falls back to when the installed torch writes
  its formats differently from this project's torch-free writers), beside the torch-free conversion.

Each operation runs as its own child process under `/usr/bin/time -v`, so the wall time includes interpreter start
and imports (the project's modules are compiled to bytecode first, as `pip install` does: under
PYTHONDONTWRITEBYTECODE an editable checkout would compile them again at every start), and the peak RSS is the
child's own `ru_maxrss`. (`os.wait4` on a direct child of this process would not do: the kernel carries the RSS a
forked child shares with its parent into its `ru_maxrss` across exec, so it reports this process's size;
/usr/bin/time forks the command from its own small process.) Without /usr/bin/time the peak is the child's
`VmHWM`, sampled from /proc every 20 ms, which is also recorded as a cross-check. Its CPU time (user + system,
steadier than wall time on shared cores) and its peak anonymous RSS (sampled, i.e. without the file pages that
reading safetensors or torch files through mmap maps in) are recorded too. The table shows the median seconds
with the fastest and slowest run, the ratio to the median `cp -r` of the same size, the median CPU seconds and the
largest peak RSS of the runs.

Runs are interleaved: every size is run once (cp, to-mcore, to-hf, ...), then again up to `--repeats` times
while a repeat is expected to end within `--budget-min`. Before each size's runs its source is read once,
untimed, so that it is warm in the page cache; the cached fraction of each run's input is measured with
`fincore` and recorded. `--to hf` reads the checkpoint `--to mcore` has just written, which is warm too. Every
run starts after a `sync` (nothing is evicted), so no run pays for an earlier run's writeback; no child syncs its
own writes, so all figures are for writes into the page cache, as `cp -r` does them.

The models are random bf16 checkpoints of Llama-3.2-1B's shape (tied embeddings, llama3 RoPE scaling), written
straight to ~1 GB safetensors shards tensor by tensor without building a transformers model; the default sizes
are 16 layers (as published, ~2.5 GB) and 32 layers (~4.4 GB), to show whether peak memory grows with the model.
The first export of each size and format is compared with its source tensor by tensor (names, dtypes, bits);
any difference fails the run.

    nice -n 10 python scripts/bench_convert.py                       # full benchmark, ~2.5 GB and ~4.4 GB
    python scripts/bench_convert.py --tiny --layers 2 --repeats 1    # smoke test on a tiny shape
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil
import torch
from random_checkpoint import write_random_checkpoint
from safetensors import safe_open

from hf_mcore_bridge.checkpoint import writer_contract
from hf_mcore_bridge.checkpoint.writer_contract import TORCH_WRITER_ENV
from hf_mcore_bridge.mappings.llama import LLAMA3_ROPE

MB = 10**6
GB = 10**9
CONVERT_GOAL = 3.0
"""A conversion should take at most this many times as long as `cp -r` of the same checkpoint (issue 20)."""
RSS_GOAL_MB = 1500.0
"""Peak RSS goal of a dense conversion, in MB (10^6 bytes)."""
TIME_BIN = Path("/usr/bin/time")
INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True)
class LlamaShape:
    """The dimensions of a Llama decoder with tied embeddings and no biases."""

    layers: int
    hidden: int = 2048
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 64
    intermediate: int = 8192
    vocab: int = 128256
    max_positions: int = 131072

    def config(self) -> dict[str, Any]:
        """The HF `config.json` of a Llama-3.2-style model of this shape."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "torch_dtype": "bfloat16",
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab,
            "max_position_embeddings": self.max_positions,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "rope_scaling": dict(LLAMA3_ROPE),
            "tie_word_embeddings": True,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "bos_token_id": 128000,
            "eos_token_id": 128001,
        }


def tiny_shape(layers: int) -> LlamaShape:
    """A shape small enough for a smoke test, with GQA and a vocabulary that TP 2 must pad."""
    return LlamaShape(
        layers, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=96, vocab=211, max_positions=512
    )


def write_checkpoint(directory: Path, shape: LlamaShape, *, shard_bytes: int, seed: int = 0) -> int:
    """Write a random bf16 HF checkpoint of `shape` into `directory` (`random_checkpoint.write_random_checkpoint`,
    one tensor in memory at a time); returns the bytes of tensor data."""
    directory.mkdir(parents=True)
    return write_random_checkpoint(directory, shape.config(), dtype=torch.bfloat16, shard_bytes=shard_bytes, seed=seed)


def _safetensors_files(directory: Path) -> dict[str, Path]:
    """Tensor name -> file of an HF directory (indexed or single-file)."""
    index = directory / INDEX_NAME
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    with safe_open(str(directory / "model.safetensors"), framework="pt") as handle:
        return dict.fromkeys(handle.keys(), directory / "model.safetensors")


def _tensors(directory: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of an HF directory, one at a time, in name order."""
    files = _safetensors_files(directory)
    for name in sorted(files):
        with safe_open(str(files[name]), framework="pt") as handle:
            yield name, handle.get_tensor(name)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes: equal bytes are bit identity (-0 is not 0; torch.equal has no FP8 kernel)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


class NotIdentical(AssertionError):
    """An exported checkpoint differs from its source."""


def check_identical(source: Path, exported: Path) -> int:
    """Raise `NotIdentical` unless `exported` holds exactly the tensors of `source`, bit for bit.

    Returns the number of tensors compared.
    """
    expected, actual = _safetensors_files(source), _safetensors_files(exported)
    if set(expected) != set(actual):
        missing, extra = sorted(set(expected) - set(actual)), sorted(set(actual) - set(expected))
        raise NotIdentical(f"{exported}: missing {missing[:3]} ({len(missing)}), extra {extra[:3]} ({len(extra)})")
    for (name, want), (_, got) in zip(_tensors(source), _tensors(exported), strict=True):
        if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(_bytes(got), _bytes(want)):
            raise NotIdentical(
                f"{exported}: {name} is {got.dtype} {tuple(got.shape)}, "
                f"expected {want.dtype} {tuple(want.shape)}, or its values differ"
            )
    return len(expected)


@dataclass(frozen=True)
class Sample:
    """One timed child process."""

    seconds: float
    peak_rss_mb: float
    """`Maximum resident set size` of the child per /usr/bin/time (without it: `sampled_hwm_mb`)."""
    sampled_hwm_mb: float
    """The child's `VmHWM` (peak RSS) as last sampled from /proc: a cross-check of `peak_rss_mb`."""
    peak_anon_mb: float
    """Largest anonymous RSS seen by sampling /proc every 20 ms: the part of the peak that is not page cache
    mapped from files (safetensors are read through mmap, and those pages count in the RSS while mapped)."""
    cpu_s: float
    """User + system CPU seconds of the child: steadier than wall time when other work shares the cores."""
    source_cached: float | None
    """Fraction of the input's bytes in the page cache just before the run (None without `fincore`)."""
    in_process_s: float | None
    """The converter's own timing (`in X.Xs`), which leaves out interpreter start and imports."""


def cached_fraction(directory: Path) -> float | None:
    """Fraction of the bytes of the files under `directory` that are resident in the page cache."""
    fincore = shutil.which("fincore")
    files = [str(p) for p in directory.rglob("*") if p.is_file() and p.stat().st_size > 0]
    if fincore is None or not files:
        return None
    out = subprocess.run(
        [fincore, "--bytes", "--noheadings", "--raw", "--output", "RES,SIZE", *files],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    resident = size = 0
    for line in out.splitlines():
        res, total = (int(v) for v in line.split())
        resident, size = resident + min(res, total), size + total  # RES counts the last page whole
    return resident / size if size else None


class RssSampler(threading.Thread):
    """Samples a process tree's anonymous RSS (summed) and its processes' `VmHWM` (largest) until stopped."""

    def __init__(self, pid: int, interval: float = 0.02):
        super().__init__(daemon=True)
        self.pid, self.interval, self.anon_kb, self.hwm_kb = pid, interval, 0, 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            try:
                root = psutil.Process(self.pid)
                pids = [self.pid, *(c.pid for c in root.children(recursive=True))]
            except psutil.Error:
                return
            anon = 0
            for pid in pids:
                try:
                    status = Path(f"/proc/{pid}/status").read_text()
                except OSError:
                    continue
                anon += _status_kb(status, "RssAnon")
                self.hwm_kb = max(self.hwm_kb, _status_kb(status, "VmHWM"))
            self.anon_kb = max(self.anon_kb, anon)
            self._stop_event.wait(self.interval)

    def stop(self) -> tuple[float, float]:
        """Stop sampling; (peak anonymous RSS, largest VmHWM), in MB."""
        self._stop_event.set()
        self.join()
        return self.anon_kb * 1024 / MB, self.hwm_kb * 1024 / MB


def _status_kb(status: str, field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", status, re.MULTILINE)
    return int(match.group(1)) if match else 0


def run_child(command: list[str], reads: Path, log: Path) -> Sample:
    """Run `command` to completion after a `sync`; its wall time, CPU time and peak RSS. Exits on failure."""
    cached = cached_fraction(reads)
    timed = [str(TIME_BIN), "-v", "-o", str(log.with_suffix(".time")), *command] if TIME_BIN.exists() else command
    os.sync()
    with log.open("w") as out:
        started = time.perf_counter()
        child = subprocess.Popen(timed, stdout=out, stderr=subprocess.STDOUT)
        sampler = RssSampler(child.pid)
        sampler.start()
        _, status, usage = os.wait4(child.pid, 0)
        seconds = time.perf_counter() - started
        peak_anon_mb, sampled_hwm_mb = sampler.stop()
    child.returncode = os.waitstatus_to_exitcode(status)
    text = log.read_text()
    if child.returncode != 0:
        raise SystemExit(f"FAIL: {' '.join(command)} exited {child.returncode}:\n{text[-3000:]}")
    peak_mb = sampled_hwm_mb
    if TIME_BIN.exists():
        match = re.search(r"Maximum resident set size \(kbytes\): (\d+)", log.with_suffix(".time").read_text())
        if match is None:
            raise SystemExit(f"FAIL: no peak RSS in {log.with_suffix('.time')}")
        peak_mb = int(match.group(1)) * 1024 / MB
    reported = re.search(r" in ([0-9.]+)s$", text.strip())
    return Sample(
        seconds=seconds,
        peak_rss_mb=peak_mb,
        sampled_hwm_mb=sampled_hwm_mb,
        peak_anon_mb=peak_anon_mb,
        cpu_s=usage.ru_utime + usage.ru_stime,  # wait4 counts the waited-for grandchild under /usr/bin/time
        source_cached=cached,
        in_process_s=float(reported.group(1)) if reported else None,
    )


def compile_project() -> None:
    """Write the bytecode of the project's modules, as an install does, so that no timed run compiles them."""
    import compileall
    import importlib.util

    for package in ("hf_mcore_bridge", "hf_mcore_bridge.cli", "hf_mcore_bridge.mappings"):
        spec = importlib.util.find_spec(package)
        for location in (spec.submodule_search_locations or []) if spec else []:
            compileall.compile_dir(location, quiet=1)


def bridge_command() -> list[str]:
    """The `bridge` console script of this interpreter's environment."""
    for name in ("bridge", "hf-mcore-bridge"):
        candidate = Path(sys.executable).parent / name
        if candidate.exists():
            return [str(candidate)]
    return [sys.executable, "-m", "hf_mcore_bridge.cli.main"]


def _fresh(path: Path) -> Path:
    if path.exists():
        shutil.rmtree(path)
    return path


def probe_legacy_format(workdir: Path, bridge: list[str]) -> str | None:
    """None when `--format torch` writes legacy per-rank files that export back bit-exactly; else why not."""
    help_text = subprocess.run([*bridge, "convert", "--help"], capture_output=True, text=True).stdout
    if not re.search(r"--format\s+<[^>]*\btorch\b(?!_)", help_text):
        return "`bridge convert --help` lists no `--format torch`"
    source, mcore, back = workdir / "probe-hf", workdir / "probe-mcore", workdir / "probe-back"
    write_checkpoint(source, tiny_shape(4), shard_bytes=GB)
    convert = [*bridge, "convert", "--to", "mcore", str(source), str(mcore), "--tp", "2", "--pp", "2"]
    done = subprocess.run([*convert, "--format", "torch", "--no-progress"], capture_output=True, text=True)
    try:
        if done.returncode != 0:
            return f"`--format torch` fails on a tiny model: {(done.stdout + done.stderr).strip()[-300:]}"
        release = mcore / "release"
        if (release / ".metadata").exists() or not any(release.glob("mp_rank_*")):
            return "`--format torch` is accepted but writes a torch_dist checkpoint (no mp_rank_* directories)"
        to_hf = [*bridge, "convert", "--to", "hf", str(mcore), str(back), "--no-progress"]
        if subprocess.run(to_hf, capture_output=True).returncode != 0:
            return "`--to hf` cannot read the legacy checkpoint `--format torch` wrote"
        try:
            check_identical(source, back)
        except NotIdentical as err:
            return f"the legacy round trip of a tiny model is not bit-exact: {err}"
        return None
    finally:
        for path in (source, mcore, back):
            _fresh(path)


@dataclass
class Size:
    """One model size: its source checkpoint, the operations timed on it and their samples."""

    shape: LlamaShape
    base: Path
    data_bytes: int
    generate_s: float
    operations: dict[str, tuple[list[str], Path, Path]]
    """Operation -> (command, what it reads, what it writes)."""
    samples: dict[str, list[Sample]]
    verified: dict[str, Any]

    @property
    def name(self) -> str:
        return f"{self.shape.layers}L"

    @property
    def source(self) -> Path:
        return self.base / "hf"


def prepare_size(
    workdir: Path,
    shape: LlamaShape,
    *,
    formats: list[str],
    shard_bytes: int,
    bridge: list[str],
    baseline: Path | None = None,
    torch_writer: bool = False,
) -> Size:
    """Generate the source checkpoint of one size and list its operations (cp -r, then each format's pair, then
    the torch_dist pair of the `baseline` installation)."""
    base = workdir / f"llama-{shape.layers}L"
    source, copy = base / "hf", base / "copy"
    started = time.perf_counter()
    data_bytes = write_checkpoint(source, shape, shard_bytes=shard_bytes)
    generate_s = time.perf_counter() - started
    print(f"[{shape.layers}L] wrote {data_bytes / GB:.2f} GB of random bf16 in {generate_s:.1f}s", flush=True)
    (base / "logs").mkdir()
    operations: dict[str, tuple[list[str], Path, Path]] = {
        "cp -r": (["cp", "-r", str(source), str(copy)], source, copy)
    }
    for fmt in formats:
        mcore, back = base / f"mcore-{fmt}", base / f"back-{fmt}"
        to_mcore = [*bridge, "convert", "--to", "mcore", str(source), str(mcore), "--tp", "2", "--pp", "2"]
        operations[f"to mcore ({fmt})"] = ([*to_mcore, "--format", fmt, "--no-progress"], source, mcore)
        to_hf = [*bridge, "convert", "--to", "hf", str(mcore), str(back), "--no-progress"]
        operations[f"to hf (from {fmt})"] = (to_hf, mcore, back)
        if fmt == "torch_dist" and torch_writer:  # the same conversion through torch's writers
            forced = base / "mcore-torch-writer"
            command = ["env", f"{TORCH_WRITER_ENV}=1", *bridge, "convert", "--to", "mcore", str(source), str(forced)]
            operations[TORCH_WRITER_OP] = ([*command, "--tp", "2", "--pp", "2", "--no-progress"], source, forced)
    if baseline is not None:
        old = ["env", f"PYTHONPATH={baseline}", *bridge]  # the baseline's package before this checkout's
        mcore, back = base / "mcore-baseline", base / "back-baseline"
        to_mcore = [*old, "convert", "--to", "mcore", str(source), str(mcore), "--tp", "2", "--pp", "2"]
        operations[f"{BASELINE} to mcore"] = ([*to_mcore, "--no-progress"], source, mcore)
        operations[f"{BASELINE} to hf"] = (
            [*old, "convert", "--to", "hf", str(mcore), str(back), "--no-progress"],
            mcore,
            back,
        )
    return Size(shape, base, data_bytes, generate_s, operations, {op: [] for op in operations}, {})


BASELINE = "baseline"
"""Prefix of the operations run with the `--baseline` installation."""
TORCH_WRITER_OP = "to mcore (torch's writer)"
"""`--to mcore` (torch_dist) through torch's own writers (`--torch-writer`)."""


def run_order(operations: list[str], repeat: int) -> list[str]:
    """`cp -r` first, then this checkout's and the baseline's conversions, the two groups taking turns to go
    first from one repeat to the next (page-cache reuse favours whichever runs second)."""
    ours = [op for op in operations if op != "cp -r" and not op.startswith(BASELINE)]
    theirs = [op for op in operations if op.startswith(BASELINE)]
    return ["cp -r", *(ours + theirs if repeat % 2 == 0 else theirs + ours)]


def warm(directory: Path) -> None:
    """Read every file of `directory` once, so that the page cache holds it."""
    buffer = bytearray(16 * 2**20)
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        with path.open("rb", buffering=0) as handle:
            while handle.readinto(buffer):
                pass


def run_size_once(size: Size, repeat: int, *, verify: bool) -> float:
    """Time every operation of one size once, in order; returns the seconds spent verifying exports."""
    warm(size.source)
    verify_s = 0.0
    for op in run_order(list(size.operations), repeat):
        command, reads, writes = size.operations[op]
        _fresh(writes)
        tag = re.sub(r"[^a-z0-9]+", "-", op).strip("-")
        sample = run_child(command, reads, size.base / "logs" / f"{tag}-{repeat}.log")
        size.samples[op].append(sample)
        cached = "?" if sample.source_cached is None else f"{sample.source_cached:.0%}"
        print(
            f"[{size.name}] run {repeat + 1} {op}: {sample.seconds:.1f}s (CPU {sample.cpu_s:.1f}s), "
            f"peak RSS {sample.peak_rss_mb:.0f} MB (anon {sample.peak_anon_mb:.0f}), input cached {cached}",
            flush=True,
        )
        if op.startswith(("to hf", f"{BASELINE} to hf")):
            if verify:
                started = time.perf_counter()
                count = check_identical(size.source, writes)
                seconds = time.perf_counter() - started
                verify_s += seconds
                size.verified[op] = {"tensors": count, "bit_identical": True, "seconds": round(seconds, 1)}
                print(f"[{size.name}] {op}: export bit-identical to the source ({count} tensors)", flush=True)
            shutil.rmtree(writes)
            shutil.rmtree(reads)  # the Megatron checkpoint it read
        elif op in ("cp -r", TORCH_WRITER_OP):
            shutil.rmtree(writes)
    return verify_s


@dataclass(frozen=True)
class Row:
    """One line of the table: an operation on one model size, summarised over its runs."""

    size: str
    layers: int
    source_gb: float
    operation: str
    seconds: float
    """Median wall time of the runs."""
    ratio_to_cp: float
    """`seconds` over the median `cp -r` seconds of the same size."""
    cpu_s: float
    """Median user + system CPU seconds of the runs."""
    peak_rss_mb: float
    """Largest peak RSS of the runs."""
    peak_anon_mb: float
    """Largest sampled anonymous RSS of the runs."""
    runs_s: list[float]
    runs_cpu_s: list[float]
    runs_in_process_s: list[float | None]
    runs_peak_rss_mb: list[float]
    runs_sampled_hwm_mb: list[float]
    runs_peak_anon_mb: list[float]
    runs_source_cached: list[float | None]


def summarize(size: Size) -> list[Row]:
    cp_median = statistics.median(s.seconds for s in size.samples["cp -r"])
    rows = []
    for op, runs in size.samples.items():
        if not runs:
            continue
        median = statistics.median(s.seconds for s in runs)
        rows.append(
            Row(
                size=size.name,
                layers=size.shape.layers,
                source_gb=round(size.data_bytes / GB, 3),
                operation=op,
                seconds=round(median, 2),
                ratio_to_cp=round(median / cp_median, 2),
                cpu_s=round(statistics.median(s.cpu_s for s in runs), 2),
                peak_rss_mb=round(max(s.peak_rss_mb for s in runs), 1),
                peak_anon_mb=round(max(s.peak_anon_mb for s in runs), 1),
                runs_s=[round(s.seconds, 2) for s in runs],
                runs_cpu_s=[round(s.cpu_s, 2) for s in runs],
                runs_in_process_s=[s.in_process_s for s in runs],
                runs_peak_rss_mb=[round(s.peak_rss_mb, 1) for s in runs],
                runs_sampled_hwm_mb=[round(s.sampled_hwm_mb, 1) for s in runs],
                runs_peak_anon_mb=[round(s.peak_anon_mb, 1) for s in runs],
                runs_source_cached=[None if s.source_cached is None else round(s.source_cached, 3) for s in runs],
            )
        )
    return rows


def growth_lines(rows: list[Row]) -> list[str]:
    """Peak RSS of each conversion at every size relative to the smallest size: flat means bounded memory."""
    lines = []
    for op in dict.fromkeys(r.operation for r in rows if r.operation != "cp -r"):
        same = sorted((r for r in rows if r.operation == op), key=lambda r: r.layers)
        if len(same) > 1:
            steps = ", ".join(
                f"{r.size} {r.peak_rss_mb:.0f} MB ({r.peak_rss_mb / same[0].peak_rss_mb:.2f}x)" for r in same
            )
            lines.append(f"{op}: peak RSS {steps}")
    return lines


def baseline_lines(rows: list[Row]) -> list[str]:
    """This checkout's torch_dist conversions against the baseline's of the same size: wall, CPU and peak RSS."""
    lines = []
    pairs = (("to mcore (torch_dist)", f"{BASELINE} to mcore"), ("to hf (from torch_dist)", f"{BASELINE} to hf"))
    for ours_op, theirs_op in pairs:
        for ours in (r for r in rows if r.operation == ours_op):
            theirs = next((r for r in rows if r.size == ours.size and r.operation == theirs_op), None)
            if theirs is not None:
                lines.append(
                    f"{ours.size:>4} {ours_op:<24} {ours.seconds:.1f}s vs baseline {theirs.seconds:.1f}s "
                    f"({theirs.seconds / ours.seconds:.2f}x faster), CPU {ours.cpu_s:.1f}s vs {theirs.cpu_s:.1f}s, "
                    f"peak RSS {ours.peak_rss_mb:.0f} vs {theirs.peak_rss_mb:.0f} MB"
                )
    return lines


def goal_lines(rows: list[Row]) -> list[str]:
    """One line per conversion: its ratio to `cp -r` and its peak RSS against the goals."""
    lines = []
    for row in rows:
        if row.operation == "cp -r":
            continue
        speed = "ok" if row.ratio_to_cp <= CONVERT_GOAL else "MISSED"
        memory = "ok" if row.peak_rss_mb <= RSS_GOAL_MB else "MISSED"
        lines.append(
            f"{row.size:>4} {row.operation:<24} {row.ratio_to_cp:5.2f}x cp -r (goal <= {CONVERT_GOAL}x: {speed}), "
            f"peak RSS {row.peak_rss_mb:5.0f} MB (goal <= {RSS_GOAL_MB:.0f} MB: {memory})"
        )
    return lines


def format_table(rows: list[Row]) -> str:
    header = (
        f"{'size':>4} {'GB':>5} {'operation':<24} {'seconds':>8} {'min-max':>11} {'x cp -r':>8} {'CPU s':>7} "
        f"{'peak RSS MB':>12} {'anon MB':>8}  runs (s)"
    )
    lines = [header, "-" * (len(header) + 8)]
    for row in rows:
        runs = ", ".join(f"{s:.1f}" for s in row.runs_s)
        spread = f"{min(row.runs_s):.1f}-{max(row.runs_s):.1f}"
        lines.append(
            f"{row.size:>4} {row.source_gb:5.2f} {row.operation:<24} {row.seconds:8.1f} {spread:>11} "
            f"{row.ratio_to_cp:8.2f} {row.cpu_s:7.1f} {row.peak_rss_mb:12.0f} {row.peak_anon_mb:8.0f}  {runs}"
        )
    return "\n".join(lines)


CACHE_NOTE = (
    "source warm in the page cache before every run (read once, untimed, before each size's cp -r; the cached "
    "fraction measured per run is in the JSON); --to hf reads the checkpoint --to mcore has just written; every "
    "run starts after a sync; no child syncs its writes, so writes land in the page cache"
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[16, 32], help="model sizes, in decoder layers")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs of each operation, at most (median shown)")
    parser.add_argument(
        "--budget-min",
        type=float,
        default=14.0,
        help="repeat a size's runs only if they are expected to end within this many minutes of the start",
    )
    parser.add_argument("--workdir", type=Path, default=None, help="where checkpoints go (default: a /tmp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the work dir and the source checkpoints")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON results (default: bench_convert.json in --workdir, or in the current directory when the work "
        "dir is a temporary one, which is removed)",
    )
    parser.add_argument("--tiny", action="store_true", help="a tiny shape instead of Llama-3.2-1B (smoke test)")
    parser.add_argument("--no-legacy", action="store_true", help="skip the `--format torch` probe and runs")
    parser.add_argument(
        "--torch-writer",
        action="store_true",
        help=f"also time --to mcore (torch_dist) through torch's own writers ({TORCH_WRITER_ENV}=1)",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="another installation of the project (`pip install --no-deps --target DIR` of an older commit) whose "
        "torch_dist conversions are timed in the same runs, interleaved with this checkout's",
    )
    return parser.parse_args(argv)


def code_state() -> dict[str, Any]:
    """The commit and uncommitted files of the checkout the benchmark runs, so that figures name their code."""
    repo = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    return {"commit": git("rev-parse", "HEAD"), "uncommitted": git("status", "--porcelain").splitlines()}


def report(sizes: list[Size], args: argparse.Namespace, legacy: str, extra: dict[str, Any]) -> dict[str, Any]:
    """The results as JSON-ready data."""
    rows = [row for size in sizes for row in summarize(size)]
    return {
        "shape": "tiny" if args.tiny else "Llama-3.2-1B (hidden 2048, 32 heads, 8 KV heads, FFN 8192, vocab 128256)",
        "cache": CACHE_NOTE,
        "legacy_format": legacy,
        "goals": {"convert_max_ratio_to_cp": CONVERT_GOAL, "peak_rss_max_mb": RSS_GOAL_MB},
        "goal_check": goal_lines(rows),
        "against_baseline": baseline_lines(rows),
        "peak_rss_growth": growth_lines(rows),
        "rss_probe": ("/usr/bin/time -v" if TIME_BIN.exists() else "VmHWM sampled") + "; anon RSS sampled every 20 ms",
        "cpus": os.cpu_count(),
        "niceness": os.nice(0),
        "torch": torch.__version__,
        "code": code_state(),
        **extra,
        "sizes": {
            s.name: {"generate_s": round(s.generate_s, 1), "data_bytes": s.data_bytes, "verified": s.verified}
            for s in sizes
        },
        "rows": [asdict(row) for row in rows],
    }


def run_benchmark(args: argparse.Namespace, workdir: Path, out: Path) -> tuple[list[Size], str]:
    """Probe the legacy format, generate every size, then time all sizes repeat by repeat within the budget."""
    started = time.perf_counter()
    compile_project()
    bridge = bridge_command()
    reason = "skipped (--no-legacy)" if args.no_legacy else probe_legacy_format(workdir, bridge)
    legacy = "measured" if reason is None else f"not measured: {reason}"
    print(f"--format torch: {legacy}", flush=True)
    formats = ["torch_dist", "torch"] if reason is None else ["torch_dist"]
    shard_bytes = 64 * 1024 if args.tiny else GB
    sizes = [
        prepare_size(
            workdir,
            tiny_shape(n) if args.tiny else LlamaShape(n),
            formats=formats,
            shard_bytes=shard_bytes,
            bridge=bridge,
            baseline=args.baseline.resolve() if args.baseline else None,
            torch_writer=args.torch_writer,
        )
        for n in args.layers
    ]
    contract = writer_contract.verdict()  # checked here (it imports torch), so that no timed child checks it
    print(f"torch-free writers against the installed torch: {contract.note or 'the same bytes'}", flush=True)
    load_start = os.getloadavg()
    last_s: dict[str, float] = {}
    for repeat in range(args.repeats):
        for size in sizes:
            if repeat > 0:
                expected_end = time.perf_counter() - started + last_s[size.name]
                if expected_end > args.budget_min * 60:
                    print(f"[{size.name}] run {repeat + 1} skipped: it would end after ~{expected_end / 60:.1f} min")
                    continue
            size_started = time.perf_counter()
            verify_s = run_size_once(size, repeat, verify=repeat == 0)
            last_s[size.name] = time.perf_counter() - size_started - verify_s
        extra = {
            "writer_contract": contract.note or "the torch-free writers write the installed torch's bytes",
            "repeats_done": max(len(runs) for size in sizes for runs in size.samples.values()),
            "load_average_start": load_start,
            "load_average_end": os.getloadavg(),
            "total_s": round(time.perf_counter() - started, 1),
        }
        out.write_text(json.dumps(report(sizes, args, legacy, extra), indent=2) + "\n")  # kept if a later repeat dies
    return sizes, legacy


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.repeats < 1 or any(n < 2 or n % 2 for n in args.layers):
        raise SystemExit("--repeats must be >= 1 and every --layers value even (pipeline-parallel 2)")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench_convert-", dir="/tmp"))
    workdir.mkdir(parents=True, exist_ok=True)
    out = (args.out or (workdir if args.workdir else Path.cwd()) / "bench_convert.json").resolve()
    try:
        sizes, legacy = run_benchmark(args, workdir, out)
    finally:
        if not args.keep:
            for layers in args.layers:
                shutil.rmtree(workdir / f"llama-{layers}L", ignore_errors=True)
            if args.workdir is None:
                shutil.rmtree(workdir, ignore_errors=True)
    result = json.loads(out.read_text())
    rows = [row for size in sizes for row in summarize(size)]
    print()
    print(format_table(rows))
    print()
    print("seconds and CPU s: medians of the interleaved runs listed; peak RSS and anon: the largest of the runs")
    print(CACHE_NOTE)
    print(f"--format torch: {legacy}")
    print(
        f"load average (1, 5, 15 min) {tuple(round(x, 1) for x in result['load_average_start'])} at the first run, "
        f"{tuple(round(x, 1) for x in result['load_average_end'])} at the last, on {os.cpu_count()} CPUs"
    )
    print("goals:")
    for line in result["goal_check"]:
        print("  " + line)
    for line in result["peak_rss_growth"]:
        print(line)
    if result["against_baseline"]:
        print(f"against the baseline ({args.baseline}), medians of the same interleaved runs:")
        for line in result["against_baseline"]:
            print("  " + line)
    print(f"total {result['total_s'] / 60:.1f} min; wrote {out}")


if __name__ == "__main__":
    main()
