"""How GRPO runs start, resume and stop: real signals sent to `bridge train grpo` processes (one of them started in
the background by a shell script), two `torchrun` "nodes" over loopback against the same world spawned locally,
`bridge verify` under torchrun, the shared-storage check, world-size checks, and resuming with another model."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import yaml

from hf_mcore_bridge.checkpoint.megatron_dirs import TRACKER_NAME, iteration_dirname
from hf_mcore_bridge.errors import BridgeError
from hf_mcore_bridge.grpo.backends.megatron.checkpoint import latest_step
from hf_mcore_bridge.grpo.errors import GRPOConfigError
from hf_mcore_bridge.grpo.run.config import config_from_dict
from hf_mcore_bridge.grpo.run.plan import parallel_dims

from ..tiny_policy import build_tiny_policy

BRIDGE = [sys.executable, "-m", "hf_mcore_bridge.cli.main"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
TIMINGS = ("_s", "tokens_per_s")
STOPPED_WITHIN_S = 10.0
"""How soon after the signal every process of the run must be gone (the launcher allows ranks 5 s for SIGTERM)."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _env() -> dict[str, str]:
    """The test's environment without a launcher's variables, one thread per process."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "BRIDGE_DEBUG")}
    return env | {"OMP_NUM_THREADS": "1"}


def _config(root: Path, policy: Path, name: str, steps: int, **sections: dict) -> dict:
    prompts = root / "prompts.jsonl"
    if not prompts.exists():
        rows = [{"prompt": f"Repeat the digit {d}. Answer:", "answer": str(d)} for d in range(10)]
        prompts.write_text("\n".join(json.dumps(r) for r in rows))
    config = {
        "policy": {"model_path": str(policy), "megatron_cfg": {"micro_batch_size": 8, "optimizer": {"lr": 1e-2}}},
        "grpo": {"num_prompts_per_step": 4, "num_generations_per_prompt": 4, "max_num_steps": steps, "val_period": 0},
        "loss_fn": {"kl_coef": 0.01},
        "generation": {"max_new_tokens": 3, "stop_token_ids": [0], "max_model_len": 64},
        "data": {"train_jsonl": str(prompts)},
        "checkpointing": {"enabled": True, "checkpoint_dir": str(root / name / "ckpt"), "save_period": 1},
        "logger": {"log_dir": str(root / name / "logs"), "print_progress": True},
    }
    for section, values in sections.items():
        config[section] = config.get(section, {}) | values
    return config


def _yaml(root: Path, config: dict, name: str) -> Path:
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _comparable(log_dir: Path) -> list[dict[str, float]]:
    lines = (log_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if not k.endswith(TIMINGS)} for line in lines]


def _wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _logged_a_step(log_dir: Path) -> bool:
    path = log_dir / "metrics.jsonl"
    return path.exists() and path.stat().st_size > 0


def _running(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Those of `procs` still running after up to `timeout` seconds. An exited process whose parent died before
    reaping it stays a zombie where the init process does not reap orphans (some containers): it has stopped."""
    deadline = time.monotonic() + timeout
    while True:
        _, alive = psutil.wait_procs(procs, timeout=0.1)
        running = []
        for proc in alive:
            try:
                if proc.status() != psutil.STATUS_ZOMBIE:
                    running.append(proc)
            except psutil.NoSuchProcess:
                pass
        if not running or time.monotonic() > deadline:
            return running


def _in_groups(groups: set[int]) -> list[psutil.Process]:
    """The processes whose process group is one of `groups`."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getpgid(proc.pid) in groups:
                found.append(proc)
    return found


def _described(proc: psutil.Process) -> str:
    with contextlib.suppress(psutil.Error):
        return f"{proc.pid} (parent {proc.ppid()}): {' '.join(proc.cmdline())[:200]}"
    return f"{proc.pid} (gone)"


def _ranks(launcher: int) -> list[psutil.Process]:
    """The launcher's rank processes: the children of its fork server (`world`'s way on Linux), or its spawned
    children elsewhere (a rank's own children come and go during saves)."""
    ranks = []
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(launcher).children():
            with contextlib.suppress(psutil.Error):
                command = " ".join(child.cmdline())
                if "spawn_main" in command:
                    ranks.append(child)
                elif "forkserver" in command:
                    ranks += child.children()
    return ranks


# Checks that start no process --------------------------------------------------------------------------------------


def test_num_nodes_multiplies_the_ranks_and_needs_gpus_per_node(tmp_path: Path) -> None:
    base = _config(tmp_path, tmp_path / "policy", "run", 1)
    config = config_from_dict(base, ["cluster.gpus_per_node=2", "cluster.num_nodes=2"])
    config.validate()
    assert parallel_dims(config).world == 4
    with pytest.raises(GRPOConfigError, match="num_nodes > 1 needs gpus_per_node"):
        config_from_dict(base, ["cluster.num_nodes=2"]).validate()
    with pytest.raises(GRPOConfigError, match="num_nodes=0 must be >= 1"):
        config_from_dict(base, ["cluster.num_nodes=0"]).validate()


def test_a_launcher_world_of_another_size_is_refused_before_anything_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hf_mcore_bridge.grpo.run.launch import check_start
    from hf_mcore_bridge.grpo.run.trainer import train_grpo

    base = _config(tmp_path, tmp_path / "policy", "run", 1)
    two_nodes = config_from_dict(base, ["cluster.gpus_per_node=1", "cluster.num_nodes=2"])
    with pytest.raises(GRPOConfigError, match=r"cluster.num_nodes=2: a multi-node run is started by a launcher"):
        check_start(two_nodes, parallel_dims(two_nodes))  # no launcher
    launcher = {"RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    for name, value in (launcher | {"WORLD_SIZE": "3"}).items():
        monkeypatch.setenv(name, value)
    with pytest.raises(BridgeError, match=r"WORLD_SIZE=3 ranks but cluster.gpus_per_node x cluster.num_nodes"):
        train_grpo(two_nodes)
    assert not (tmp_path / "run").exists()
    with pytest.raises(BridgeError, match=r"WORLD_SIZE=3 ranks but the config's layout .* needs 1"):
        check_start(config_from_dict(base), parallel_dims(config_from_dict(base)))
    monkeypatch.setenv("WORLD_SIZE", "2")
    check_start(two_nodes, parallel_dims(two_nodes))  # the world the config lays out


def test_only_global_rank_0_reports_an_error_every_rank_meets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`bridge train grpo` as rank 1, then as rank 0, of a launcher's 2-rank world, for a config that lays out 4
    ranks: rank 1 exits with status 2 without a word (after the wait that the launcher cuts short once rank 0 has
    failed: 0 s here), rank 0 prints the one line. The real launch is `test_cli_matrix`'s torchrun test."""
    from typer.testing import CliRunner

    from hf_mcore_bridge.cli.main import app
    from hf_mcore_bridge.megatron import world

    monkeypatch.setattr(world, "REPORT_GRACE_S", 0.0)
    policy = build_tiny_policy(tmp_path / "policy", seed=1)
    config = _yaml(tmp_path, _config(tmp_path, policy, "run", 1, cluster={"gpus_per_node": 4}), "run")
    launcher = {"WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    printed = {}
    for rank in ("1", "0"):
        for name, value in (launcher | {"RANK": rank}).items():
            monkeypatch.setenv(name, value)
        result = CliRunner().invoke(app, ["train", "grpo", "--config", str(config)])
        assert result.exit_code == 2, result.output
        printed[rank] = [line for line in result.output.splitlines() if line.strip()]
    assert printed == {
        "1": [],
        "0": [
            "error: the launcher started WORLD_SIZE=2 ranks but cluster.gpus_per_node x cluster.num_nodes (4 x 1)"
            " needs 4"
        ],
    }
    assert not (tmp_path / "run").exists()


def test_resuming_with_another_model_is_one_line(tmp_path: Path) -> None:
    from hf_mcore_bridge.convert.to_mcore import convert_hf_to_mcore
    from hf_mcore_bridge.grpo.run.launch import check_resumable
    from hf_mcore_bridge.grpo.run.trainer import train_grpo

    first = build_tiny_policy(tmp_path / "first", seed=1)
    other = build_tiny_policy(tmp_path / "other", seed=2, num_hidden_layers=3)
    root = tmp_path / "run" / "ckpt"  # a megatron checkpoint of `first` at step 2, as a run leaves it
    convert_hf_to_mcore(first, tmp_path / "converted", show_progress=False)
    root.mkdir(parents=True)
    (tmp_path / "converted" / "release").rename(root / iteration_dirname(2))
    (root / TRACKER_NAME).write_text("2")
    base = _config(tmp_path, first, "run", 4)

    check_resumable(config_from_dict(base), 2)  # its own model resumes
    with pytest.raises(GRPOConfigError) as err:
        train_grpo(config_from_dict(base, [f"policy.model_path={other}"]))
    message = str(err.value)
    assert "\n" not in message
    assert f"checkpoint_dir={root} (step 2) holds LlamaForCausalLM (2 layers" in message
    assert f"policy.model_path={other} is LlamaForCausalLM (3 layers" in message
    assert not (tmp_path / "run" / "logs").exists()  # refused before the policy was converted
    dtensor = ["policy.megatron_cfg.enabled=false", "policy.dtensor_cfg.enabled=true"]
    with pytest.raises(GRPOConfigError, match=r"holds megatron-core checkpoints .* with the DTensor backend"):
        check_resumable(config_from_dict(base, dtensor), 2)


# Process worlds ----------------------------------------------------------------------------------------------------


def _shared_storage_rank(base: str, out: str) -> None:
    import torch.distributed as dist

    from hf_mcore_bridge.grpo.run.launch import check_shared_storage

    rank = dist.get_rank()
    check_shared_storage({"logger.log_dir": Path(base) / "shared"})  # the same directory on every rank: passes
    try:  # each rank its own directory, as on nodes that do not share the storage
        check_shared_storage({"logger.log_dir": Path(base) / f"node{rank}"}, patience_s=1.0)
    except BridgeError as err:
        (Path(out) / f"{rank}.txt").write_text(str(err))


@pytest.mark.slow
def test_storage_that_is_not_shared_is_refused_on_every_rank(tmp_path: Path) -> None:
    from hf_mcore_bridge.megatron.world import run_torch_world

    run_torch_world(_shared_storage_rank, 2, str(tmp_path), str(tmp_path))
    for rank in (0, 1):
        message = (tmp_path / f"{rank}.txt").read_text()
        assert message.startswith(f"logger.log_dir={tmp_path / f'node{rank}'} is not shared storage: rank 1 on ")
    assert not [p for p in tmp_path.rglob(".bridge-shared-*")]  # the probe files are removed


@pytest.mark.slow
def test_signals_and_kill_stop_every_rank_within_seconds(tmp_path: Path) -> None:
    """Three launchers at once (start-up dominates): SIGINT to one started in the background by a shell script
    (which makes it ignore SIGINT) after a checkpoint, SIGTERM to one before any checkpoint, SIGKILL to a third."""
    policy = build_tiny_policy(tmp_path / "policy", seed=1)
    small = {"grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 2}, "loss_fn": {"kl_coef": 0.0}}
    configs = {
        "int": _config(tmp_path, policy, "int", 1000, cluster={"gpus_per_node": 2}, **small),
        "term": _config(tmp_path, policy, "term", 1000, checkpointing={"save_period": 1000}, **small),
        "kill": _config(tmp_path, policy, "kill", 1000, **small),
    }
    commands = {
        name: [*BRIDGE, "train", "grpo", "--config", str(_yaml(tmp_path, c, name))] for name, c in configs.items()
    }
    script = '"$@" >"$0.out" 2>"$0.err" & echo $! >"$0.pid"; wait $!; echo $? >"$0.rc"'
    shell = subprocess.Popen(["bash", "-c", script, str(tmp_path / "int"), *commands["int"]], env=_env())
    term = subprocess.Popen(commands["term"], env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    kill = subprocess.Popen(commands["kill"], env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pid_file = tmp_path / "int.pid"
    started: list[psutil.Process] = []
    try:
        _wait_for(lambda: len(_ranks(term.pid)) == 1, 300, "the SIGTERM run's rank")  # after the fork server's imports
        time.sleep(0.5)  # well inside the rank's start-up (forked: it imports nothing)
        term_ranks = _ranks(term.pid)
        started += term_ranks
        term.send_signal(signal.SIGTERM)
        term_out, term_err = term.communicate(timeout=STOPPED_WITHIN_S)
        assert not _running(term_ranks, 1)

        _wait_for(lambda: _logged_a_step(tmp_path / "kill" / "logs"), 180, "the killed run's first step")
        kill_procs = psutil.Process(kill.pid).children(recursive=True)
        groups = {rank.pid for rank in _ranks(kill.pid)}  # each rank leads a process group of its own
        started += kill_procs
        kill.kill()
        began = time.monotonic()
        kill_procs += _in_groups(groups)  # also what a rank forked after the snapshot (a checkpoint's writers)
        started += kill_procs
        left = _running(kill_procs, STOPPED_WITHIN_S)
        assert not left, [_described(proc) for proc in left]  # the ranks and their children die with the launcher
        kill_s = time.monotonic() - began

        ckpt = tmp_path / "int" / "ckpt"
        _wait_for(lambda: (ckpt / TRACKER_NAME).exists(), 180, "the SIGINT run's first checkpoint")
        launcher = int(pid_file.read_text())
        int_procs = psutil.Process(launcher).children(recursive=True)
        assert len(_ranks(launcher)) == 2
        started += int_procs
        os.kill(launcher, signal.SIGINT)
        began = time.monotonic()
        assert not _running(int_procs, STOPPED_WITHIN_S)
        int_s = time.monotonic() - began
        assert shell.wait(timeout=STOPPED_WITHIN_S) == 0
    finally:  # every launcher and rank, also those a failed assertion left running (the background launcher)
        roots = [shell.pid, term.pid, kill.pid, *([int(pid_file.read_text())] if pid_file.exists() else [])]
        for pid in roots:
            with contextlib.suppress(psutil.NoSuchProcess):
                root = psutil.Process(pid)
                started += [root, *root.children(recursive=True)]
        for process in started:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()

    assert term.returncode == 128 + signal.SIGTERM
    assert term_err.strip().splitlines()[-1] == (
        "stopped by SIGTERM after step 0 of 1000; no checkpoint was saved yet (checkpointing.save_period=1000)"
    )
    assert kill.wait() == -signal.SIGKILL
    assert (tmp_path / "int.rc").read_text().strip() == "130"
    int_err = (tmp_path / "int.err").read_text()
    step = latest_step(ckpt)
    assert step is not None
    assert f"; last checkpoint: step {step} in {ckpt / iteration_dirname(step)}; the same command resumes" in int_err
    assert int_err.strip().splitlines()[-1].startswith("stopped by SIGINT after step ")
    for text in (term_out, term_err, int_err, (tmp_path / "int.out").read_text()):
        assert "Traceback" not in text
    assert not list(ckpt.glob(".iter_*.partial"))
    print(f"all processes gone {int_s:.2f} s after SIGINT, {kill_s:.2f} s after SIGKILL of the launcher")


@pytest.mark.slow
def test_two_torchrun_nodes_give_the_metrics_of_the_world_spawned_locally(tmp_path: Path) -> None:
    """Two `torchrun --nnodes 2 --nproc-per-node 1` invocations over loopback (gloo) run the same DP2 world as one
    `bridge train grpo` spawning two ranks; `bridge verify` runs at PP2 under a one-node torchrun at the same time."""
    from hf_mcore_bridge.convert.to_mcore import convert_hf_to_mcore

    policy = build_tiny_policy(tmp_path / "policy", seed=1)
    convert_hf_to_mcore(policy, tmp_path / "mcore", show_progress=False)
    common = {"checkpointing": {"save_period": 2}, "logger": {"print_progress": False}}
    local = _yaml(tmp_path, _config(tmp_path, policy, "local", 2, cluster={"gpus_per_node": 2}, **common), "local")
    nodes = _config(tmp_path, policy, "nodes", 2, cluster={"gpus_per_node": 1, "num_nodes": 2}, **common)
    nodes_yaml, port = _yaml(tmp_path, nodes, "nodes"), _free_port()
    rendezvous = ["--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    module = ["-m", "hf_mcore_bridge.cli.main"]
    commands = [
        [*TORCHRUN, *rendezvous, "--node-rank", str(r), *module, "train", "grpo", "--config", str(nodes_yaml)]
        for r in (0, 1)
    ]
    commands.append([*BRIDGE, "train", "grpo", "--config", str(local)])
    verify = ["verify", str(policy), str(tmp_path / "mcore"), "--pp", "2"]  # the logits end on rank 1
    commands.append([*TORCHRUN, "--nproc-per-node", "2", "--master-port", str(_free_port()), *module, *verify])
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    runs = [subprocess.Popen(c, env=_env(), **pipes) for c in commands]
    try:
        outputs = [run.communicate(timeout=400) for run in runs]
    finally:
        for run in runs:
            if run.poll() is None:
                run.kill()
    for run, (_, err) in zip(runs, outputs, strict=True):
        assert run.returncode == 0, err[-2000:]
    (node0, _), (node1, _), _, (verified, _) = outputs

    spawned = _comparable(tmp_path / "local" / "logs")
    assert _comparable(tmp_path / "nodes" / "logs") == spawned
    assert [m["step"] for m in spawned] == [1, 2]
    assert any(m["grad_norm"] > 0 for m in spawned)  # the policy moved: the runs agree on something that can differ
    assert latest_step(tmp_path / "nodes" / "ckpt") == 2  # both "nodes" wrote their shards into the shared directory
    assert not list((tmp_path / "nodes" / "ckpt").glob(".iter_*.partial"))
    assert "2 steps; mean reward" in node0 and node1.strip() == ""  # global rank 0 reports, node 1 says nothing
    (line,) = [line for line in verified.splitlines() if line.strip()]  # one report, from global rank 0
    assert line.startswith(f"OK {tmp_path / 'mcore'} at tp=1 pp=2")


def test_the_slurm_example_starts_one_torchrun_per_node_with_the_rendezvous_on_the_first(tmp_path: Path) -> None:
    """examples/slurm_grpo.sbatch run by bash with stand-ins for scontrol, srun (as the task of node 1) and
    torchrun (which records its arguments)."""
    bin_dir, record = tmp_path / "bin", tmp_path / "torchrun.args"
    bin_dir.mkdir()
    fakes = {
        # a long node list: a reader that stops at the first line would leave scontrol to die of SIGPIPE
        "scontrol": 'printf "node-a\\nnode-b\\n"; seq -f "node-%g" 200000',
        "srun": 'shift; SLURM_NODEID=1 exec "$@"',
        "torchrun": f'printf "%s\\n" "$@" > {record}',
    }
    for name, body in fakes.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node-[a-b]", "SLURM_NNODES": "2"}
    script = Path(__file__).parents[3] / "examples" / "slurm_grpo.sbatch"
    env |= {"RUN_DIR": "/shared/run", "GPUS_PER_NODE": "4"}
    subprocess.run(["bash", str(script), "run.yaml", "grpo.max_num_steps=3"], env=env, check=True, timeout=30)
    assert record.read_text().splitlines() == [
        *("--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "4"),
        *("--master-addr", "node-a", "--master-port", "29500"),
        *("-m", "hf_mcore_bridge.cli.main", "train", "grpo", "--config", "run.yaml"),
        *("cluster.num_nodes=2", "cluster.gpus_per_node=4"),
        *("logger.log_dir=/shared/run/logs", "checkpointing.checkpoint_dir=/shared/run/checkpoints"),
        "grpo.max_num_steps=3",
    ]
