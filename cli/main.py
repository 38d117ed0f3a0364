"""The `bridge` command (also installed as `hf-mcore-bridge`): a thin shell over the library.

Every sub-command first checks all its options cheaply (`cli/validate.py`: paths, numbers, sizes, the layout
against the model's config.json), then imports the library (torch, transformers, megatron-core) and calls one
function. Exit status: 0 success, 1 a verification that failed (`FAIL ...`) or an unexpected error ("internal
error", `--debug` shows the traceback), 2 bad input or environment (one line, `error: ...`), 130 interrupted
(SIGINT), 143 terminated (SIGTERM) while a command that writes an output (`convert`, `export`, `demo`) ran: from
its start, not only once its output directory exists, so that it always ends with its cleanup and one line.

Only light modules (typer, the standard library, `hf_mcore_bridge.errors` / `.layout` / `.checkpoint.atomic`) are
imported at the top so that a mistyped path is reported in a fraction of a second.
"""

from __future__ import annotations

import enum
import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import typer
from typer.core import TyperGroup

from hf_mcore_bridge.checkpoint.atomic import sigterm_interrupts
from hf_mcore_bridge.cli import validate
from hf_mcore_bridge.convert.layout import Layout
from hf_mcore_bridge.errors import BridgeError, RunStopped, WorldError

# Let torch's CPU allocator back large tensors with transparent huge pages: conversion allocates one fresh
# tensor per chunk, and faulting in 4 KiB pages otherwise costs more than copying the bytes. Set before torch loads.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def _is_usage_error(err: Exception) -> bool:
    # typer >= 0.26 vendors its own copy of click, so its UsageError is not click's: recognise it by class name
    names = {cls.__name__ for cls in type(err).__mro__}
    return "UsageError" in names and "NoArgsIsHelpError" not in names


class _Group(TyperGroup):
    """Usage errors (unknown option, bad choice, missing argument) as one `error:` line with exit status 2, like
    every other error, instead of click's usage block."""

    @staticmethod
    def _one_line(err: Exception) -> NoReturn:
        ctx = getattr(err, "ctx", None)
        hint = f" (see '{ctx.command_path} -h')" if ctx is not None else ""
        message = " ".join(err.format_message().split())  # type: ignore[attr-defined]
        typer.secho(f"error: {message}{hint}", err=True, fg=typer.colors.RED)
        raise typer.Exit(2)

    def make_context(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().make_context(*args, **kwargs)
        except Exception as err:
            if _is_usage_error(err):
                self._one_line(err)
            raise

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except Exception as err:
            if _is_usage_error(err):
                self._one_line(err)
            raise


class _App(typer.Typer):
    """The console scripts' entry point. A command that leaves nothing running and no file open (a conversion)
    may skip the interpreter's teardown after succeeding: with torch loaded, freeing every module object takes
    about a fifth as long as importing them. Tests that invoke the command group in-process are not affected."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().__call__(*args, **kwargs)
        except SystemExit as done:
            if _state["skip_teardown"] and done.code in (0, None):
                _exit_now(0)
            raise


def _exit_now(code: int) -> NoReturn:
    """End the process without the interpreter's teardown, after what of it leaves files behind: the output
    streams are flushed and `multiprocessing`'s scratch directory (`pymp-*` in TMPDIR, which holds the fork
    server's socket once ranks were started) is removed, as its exit handler would have."""
    sys.stdout.flush()
    sys.stderr.flush()
    process = sys.modules.get("multiprocessing.process")
    if process is not None:
        scratch = process.current_process()._config.get("tempdir")  # type: ignore[attr-defined]
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    os._exit(code)


app = _App(
    cls=_Group,
    context_settings={"help_option_names": ["-h", "--help"]},
    help=(
        "Bridge HuggingFace checkpoints and Megatron-Core: convert at any TP/PP layout, verify against "
        "transformers, inspect.\n\nTypical use:\n\n"
        "  bridge convert --to mcore --tp 2 --pp 2 ./Llama-3.2-1B ./llama-mcore\n\n"
        "  bridge verify ./Llama-3.2-1B ./llama-mcore --tp 2 --pp 2\n\n"
        "  bridge convert --to hf ./llama-mcore ./llama-hf\n\n"
        "On Linux, iproute2 also ships a `bridge` command; inside the project's virtual environment ours comes "
        "first, and `hf-mcore-bridge` is the same command under an unambiguous name."
    ),
    no_args_is_help=True,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
)

_state = {"debug": False, "skip_teardown": False}
T = TypeVar("T")


class Target(enum.StrEnum):
    mcore = "mcore"
    hf = "hf"


class DType(enum.StrEnum):
    bf16 = "bf16"
    fp16 = "fp16"
    fp32 = "fp32"


class Spec(enum.StrEnum):
    te = "te"
    local = "local"


class Format(enum.StrEnum):
    torch_dist = "torch_dist"
    torch = "torch"


class DirectoryLayout(enum.StrEnum):
    megatron_lm = "megatron-lm"
    megatron_bridge = "megatron-bridge"


class Fp8ScaleFormat(enum.StrEnum):
    """`fp8_checkpoint.SCALE_FORMATS`, or the FP8 source's."""

    source = "source"
    ue8m0 = "ue8m0"
    float32 = "float32"


class McoreVersion(enum.StrEnum):
    """megatron-core releases whose `torch_dist` layout can be written (`megatron_dirs.MCORE_VERSIONS`)."""

    v16 = "0.16"
    v17 = "0.17"
    v18 = "0.18"
    v19 = "0.19"


def _quiet_libraries() -> None:
    """megatron-core warns at import about optional CUDA extensions that a CPU conversion never uses."""
    if not _state["debug"]:
        from hf_mcore_bridge.quiet import quiet_libraries

        quiet_libraries()


def _fail(err: BridgeError) -> NoReturn:
    """Report bad input as one line and exit 2 (with --debug: the traceback). An error every rank of a launcher's
    world raised alike is reported by the rank it says reports it (global rank 0); the others exit 2 silently."""
    if _state["debug"]:
        raise err
    if isinstance(err, WorldError) and not err.reports:
        raise typer.Exit(2)
    typer.secho(f"error: {err}", err=True, fg=typer.colors.RED)
    raise typer.Exit(2) from None


def _check(checks: Callable[[], T]) -> T:
    """Run a command's up-front option checks, before any heavy import: a `BridgeError` is one line and exit 2."""
    try:
        return checks()
    except BridgeError as err:
        _fail(err)


def _run(action: Callable[[], T], *, writes: bool = False) -> T:
    """Run a command body: one-line errors for bad input, tracebacks only with --debug. `writes`: the command writes
    an output, and SIGTERM stops it as Ctrl-C does (cleanup, one line, exit status 143) from here on."""
    _quiet_libraries()
    try:
        if writes:
            with sigterm_interrupts():
                return action()
        return action()
    except (typer.Exit, typer.Abort):
        raise  # a deliberate exit status (verify's FAIL is 1), not an error
    except BridgeError as err:
        _fail(err)
    except RunStopped as stopped:  # a signal stopped the ranks; the message says what was saved
        typer.secho(str(stopped), err=True, fg=typer.colors.RED)
        # asked to stop: skip the interpreter's teardown, seconds long with torch and megatron-core loaded
        _exit_now(stopped.exit_code)
    except KeyboardInterrupt as err:  # SIGINT, or SIGTERM while an output is written (atomic.Terminated: 143)
        typer.secho("interrupted; nothing was written to the destination", err=True, fg=typer.colors.RED)
        raise typer.Exit(getattr(err, "exit_code", 130)) from None
    except Exception as err:
        if _state["debug"]:
            raise
        typer.secho(f"internal error: {type(err).__name__}: {err} (rerun with --debug for the traceback)", err=True)
        raise typer.Exit(1) from None


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"hf-mcore-bridge {version('hf-mcore-bridge')}")
        except PackageNotFoundError:  # running from a checkout that was not installed
            from hf_mcore_bridge import __version__

            typer.echo(f"hf-mcore-bridge {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    debug: Annotated[bool, typer.Option("--debug", help="Show full tracebacks instead of one-line errors.")] = False,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Bridge HuggingFace checkpoints and Megatron-Core."""
    _state["debug"] = debug or os.environ.get("BRIDGE_DEBUG") == "1"


CONVERT_EXAMPLES = """Examples:

\b
  bridge convert --to mcore --tp 2 --pp 2 ./Llama-3.2-1B ./llama-mcore
  bridge convert --to mcore --format torch --tp 2 ./Llama-3.2-1B ./llama-legacy
  bridge convert --to hf --max-shard-size 2GB ./llama-mcore ./llama-hf
  bridge convert --to hf --fp8-blockwise ./deepseek-mcore ./deepseek-fp8"""


@app.command(epilog=CONVERT_EXAMPLES)
def convert(
    source: Annotated[Path, typer.Argument(help="HF model directory (--to mcore) or Megatron checkpoint (--to hf).")],
    destination: Annotated[Path, typer.Argument(help="Output directory: absent, empty, or see --overwrite.")],
    to: Annotated[Target, typer.Option("--to", help="Target format.")],
    tp: Annotated[int, typer.Option(help="Tensor-parallel size the checkpoint is prepared for.")] = 1,
    pp: Annotated[int, typer.Option(help="Pipeline-parallel size.")] = 1,
    vpp: Annotated[int | None, typer.Option(help="Virtual pipeline stages per pipeline rank.")] = None,
    cp: Annotated[int, typer.Option(help="Context-parallel size (recorded in args).")] = 1,
    ep: Annotated[int, typer.Option(help="Expert-parallel size (MoE).")] = 1,
    etp: Annotated[int | None, typer.Option(help="Expert tensor-parallel size (MoE; default: --tp).")] = None,
    first_stage_layers: Annotated[int | None, typer.Option(help="Layers on the first pipeline stage.")] = None,
    last_stage_layers: Annotated[int | None, typer.Option(help="Layers on the last pipeline stage.")] = None,
    dtype: Annotated[DType | None, typer.Option(help="Cast weights (default: keep the source dtype).")] = None,
    spec: Annotated[Spec, typer.Option(help="Megatron layer spec the checkpoint is named for.")] = Spec.te,
    fmt: Annotated[Format, typer.Option("--format", help="Megatron checkpoint format (--to mcore).")] = (
        Format.torch_dist
    ),
    directory_layout: Annotated[
        DirectoryLayout,
        typer.Option(
            "--layout",
            help="Checkpoint directory layout (--to mcore): megatron-lm (release/, args) or megatron-bridge"
            " (iter_0000000/ with run_config.yaml).",
        ),
    ] = DirectoryLayout.megatron_lm,
    mcore_version: Annotated[
        McoreVersion | None,
        typer.Option(help="megatron-core release whose torch_dist layout to write (default: the installed one)."),
    ] = None,
    make_vocab_size_divisible_by: Annotated[int, typer.Option(help="Vocabulary padding multiple (times TP).")] = 128,
    iteration: Annotated[int | None, typer.Option(help="Which saved iteration to export (--to hf).")] = None,
    hf_config: Annotated[Path | None, typer.Option(help="HF config.json (or its directory) for --to hf.")] = None,
    tokenizer: Annotated[Path | None, typer.Option(help="Directory with tokenizer files for --to hf.")] = None,
    max_shard_size: Annotated[
        str | None, typer.Option(help="Largest safetensors shard, e.g. 500MB (--to hf; default 5GB).")
    ] = None,
    fp8_blockwise: Annotated[
        bool,
        typer.Option(
            help="Write the linear layers' weights as 128 x 128 FP8 (e4m3) blocks with weight_scale_inv, as"
            " DeepSeek publishes them (--to hf)."
        ),
    ] = False,
    mxfp4: Annotated[
        bool,
        typer.Option(
            help="Write fused expert weights as MXFP4 blocks and scales, as GPT-OSS publishes them; bit-identical"
            " for weights that came from MXFP4 (--to hf)."
        ),
    ] = False,
    fp8_scale_format: Annotated[
        Fp8ScaleFormat | None,
        typer.Option(
            help="Scales of --fp8-blockwise: source (default: the FP8 source's format and its scales, bit-identical"
            " where the weights are unchanged; ue8m0 when the source was not FP8), ue8m0 (powers of two, as"
            " DeepSeek-V3.1) or float32 (amax / 448, as DeepSeek-V3)."
        ),
    ] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace a destination written earlier by this tool.")] = False,
    overwrite_foreign: Annotated[
        bool,
        typer.Option(
            help="Replace any non-empty destination, even one this tool did not write (deletes its contents)."
        ),
    ] = False,
    ignore_unknown: Annotated[bool, typer.Option(help="Skip tensors the architecture does not know.")] = False,
    allow_pickle: Annotated[bool, typer.Option(help="Read .bin (pickle) HF weights, weights-only.")] = False,
    strict_mtp: Annotated[
        bool,
        typer.Option(
            help="Refuse, rather than drop with a notice, multi-token-prediction layers megatron-core cannot hold"
            " (--to mcore)."
        ),
    ] = False,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
) -> None:
    """Convert HF -> Megatron-Core (`--to mcore`) or Megatron-Core -> HF (`--to hf`).

    --to mcore writes a Megatron-LM-loadable checkpoint (release/, args, vocabulary padded for --tp) from one
    CPU process, streaming tensor by tensor. --to hf reads a checkpoint of any layout and format.
    """
    layout = Layout(tp, pp, vpp, cp, ep, etp, first_stage_layers, last_stage_layers)

    def checks() -> int:
        validate.options_for_direction(
            f"--to {to.value}",
            {
                "--tp": tp != 1,
                "--pp": pp != 1,
                "--vpp": vpp is not None,
                "--cp": cp != 1,
                "--ep": ep != 1,
                "--etp": etp is not None,
                "--first-stage-layers": first_stage_layers is not None,
                "--last-stage-layers": last_stage_layers is not None,
                "--spec": spec is not Spec.te,
                "--format": fmt is not Format.torch_dist,
                "--mcore-version": mcore_version is not None,
                "--layout": directory_layout is not DirectoryLayout.megatron_lm,
                "--make-vocab-size-divisible-by": make_vocab_size_divisible_by != 128,
                "--allow-pickle": allow_pickle,
                "--strict-mtp": strict_mtp,
            }
            if to is Target.hf
            else {
                "--iteration": iteration is not None,
                "--hf-config": hf_config is not None,
                "--tokenizer": tokenizer is not None,
                "--max-shard-size": max_shard_size is not None,
                "--fp8-blockwise": fp8_blockwise,
                "--fp8-scale-format": fp8_scale_format is not None,
                "--mxfp4": mxfp4,
            },
        )
        if fp8_scale_format is not None and not fp8_blockwise:
            raise BridgeError("--fp8-scale-format applies with --fp8-blockwise only")
        if to is Target.mcore:
            if mcore_version is not None and fmt is Format.torch:
                raise BridgeError("--mcore-version applies to --format torch_dist only")
            if directory_layout is DirectoryLayout.megatron_bridge and fmt is Format.torch:
                raise BridgeError("--layout megatron-bridge holds --format torch_dist checkpoints only")
            validate.layout_fits(layout, validate.hf_model_dir(source, "source"))
            validate.at_least("--make-vocab-size-divisible-by", make_vocab_size_divisible_by, 1)
        else:
            validate.existing_dir(source, "source")
            validate.at_least("--iteration", iteration, 0)
            if hf_config is not None:
                validate.hf_config_option(hf_config)
            if tokenizer is not None:
                validate.tokenizer_dir(tokenizer)
        validate.writable_destination(destination)
        return validate.shard_size(max_shard_size or "5GB")

    shard_bytes = _check(checks)

    def action() -> None:
        if to is Target.mcore:
            from hf_mcore_bridge.convert.to_mcore import convert_hf_to_mcore

            result = convert_hf_to_mcore(
                source,
                destination,
                layout=layout,
                dtype=dtype.value if dtype else None,
                spec=spec.value,
                make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                overwrite=overwrite,
                overwrite_foreign=overwrite_foreign,
                ignore_unknown=ignore_unknown,
                allow_pickle=allow_pickle,
                show_progress=progress,
                checkpoint_format=fmt.value,
                mcore_version=int(mcore_version.value.split(".")[1]) if mcore_version else None,
                directory_layout=directory_layout.value,
                strict_mtp=strict_mtp,
            )
        else:
            from hf_mcore_bridge.convert.to_hf import convert_mcore_to_hf
            from hf_mcore_bridge.errors import CheckpointError
            from hf_mcore_bridge.grpo.backends.dtensor.checkpoint_dirs import conversion_refusal

            refusal = conversion_refusal(source, iteration)
            if refusal is not None:
                raise CheckpointError(refusal)
            result = convert_mcore_to_hf(
                source,
                destination,
                iteration=iteration,
                dtype=dtype.value if dtype else None,
                max_shard_size=shard_bytes,
                hf_config=hf_config,
                tokenizer=tokenizer,
                overwrite=overwrite,
                overwrite_foreign=overwrite_foreign,
                ignore_unknown=ignore_unknown,
                show_progress=progress,
                fp8_blockwise=fp8_blockwise,
                fp8_scale_format=(fp8_scale_format or Fp8ScaleFormat.source).value,
                mxfp4=mxfp4,
            )
        typer.echo(
            f"wrote {result.destination} ({result.model.architecture}, {result.tensors} tensors, "
            f"{result.bytes_written / 2**20:.1f} MiB) in {result.seconds:.1f}s"
        )
        for note in result.notes:
            typer.echo(f"note: {note}", err=True)
        _state["skip_teardown"] = True  # the output is complete and every file it wrote is closed

    _run(action, writes=True)


VERIFY_EXAMPLES = """Examples:

\b
  bridge verify ./Llama-3.2-1B ./llama-mcore --tp 2 --pp 2
  bridge verify ./Llama-3.2-1B ./llama-mcore --cp 2
  bridge verify ./Llama-3.2-1B ./llama-mcore --seq-len 64 --text "$(cat some-prose.txt)"
  bridge verify ./Llama-3.2-1B ./llama-mcore --dtype bf16 --tolerance 0.2"""


@app.command(epilog=VERIFY_EXAMPLES)
def verify(
    hf_dir: Annotated[Path, typer.Argument(help="The HF model directory (the reference).")],
    mcore_dir: Annotated[Path, typer.Argument(help="The Megatron checkpoint (root, iter_* or release).")],
    tp: Annotated[int, typer.Option(help="Tensor-parallel size to load at.")] = 1,
    pp: Annotated[int, typer.Option(help="Pipeline-parallel size to load at.")] = 1,
    ep: Annotated[int, typer.Option(help="Expert-parallel size to load at (MoE).")] = 1,
    cp: Annotated[
        int,
        typer.Option(help="Context-parallel size to run at (the project's attention; --seq-len a multiple of 2 x CP)."),
    ] = 1,
    dtype: Annotated[DType, typer.Option(help="Compute dtype on both sides.")] = DType.fp32,
    seq_len: Annotated[int, typer.Option(help="Tokens per sequence.")] = 16,
    batch: Annotated[int, typer.Option(help="Sequences.")] = 2,
    tolerance: Annotated[float | None, typer.Option(help="Max |dlogit| (default: 1e-4 fp32, 0.15 bf16).")] = None,
    text: Annotated[
        str | None,
        typer.Option(
            help="Run this text (tokenized by the HF directory's tokenizer, --batch x --seq-len tokens of it) instead"
            " of random token ids: a trained model's logits on real text show a wrong weight far more plainly."
        ),
    ] = None,
) -> None:
    """Load the checkpoint into real megatron-core at a layout and compare logits with HF transformers.

    Starts TP x PP x CP x EP processes (gloo on CPU, NCCL on GPU), or under torchrun uses the world it was given.
    Prints OK or FAIL; a FAIL beyond the tolerance exits with status 1.
    """
    layout = Layout(tp=tp, pp=pp, cp=cp, ep=ep)

    def checks() -> None:
        hf_config = validate.hf_model_dir(hf_dir, "HF directory")
        validate.existing_dir(mcore_dir, "Megatron checkpoint")
        validate.at_least("--seq-len", seq_len, 1)
        validate.seq_len_fits(seq_len, hf_config, hf_dir / "config.json")
        validate.at_least("--batch", batch, 1)
        validate.at_least("--cp", cp, 1)
        if seq_len % (2 * cp):
            raise BridgeError(f"--seq-len {seq_len} must be a multiple of 2 x --cp = {2 * cp} (the CP split)")
        validate.tolerance(tolerance)
        validate.layout_fits(layout, hf_config)
        if text is not None:
            validate.text_with_tokenizer(text, hf_dir)

    _check(checks)

    def action() -> None:
        from hf_mcore_bridge.megatron.verify import VerifyJob
        from hf_mcore_bridge.megatron.verify import verify as run_verify

        results = run_verify(
            [VerifyJob(hf_dir, mcore_dir)],
            layout,
            dtype=dtype.value,
            batch=batch,
            seq_len=seq_len,
            tolerance=tolerance,
            text=text,
        )
        if not results:  # a launcher's rank other than 0: rank 0 reports
            return
        (result,) = results
        typer.echo(result.summary())
        if not result.passed:
            raise typer.Exit(1)

    _run(action)


INSPECT_EXAMPLES = """Examples:

\b
  bridge inspect ./llama-mcore
  bridge inspect ./Llama-3.2-1B --json --no-tensors"""


@app.command(epilog=INSPECT_EXAMPLES)
def inspect(
    path: Annotated[Path, typer.Argument(help="An HF model directory or a Megatron checkpoint.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for machines.")] = False,
    tensors: Annotated[bool, typer.Option(help="List every tensor.")] = True,
) -> None:
    """Show architecture, layout, dtype, parameter count and tensors of a checkpoint.

    Reads HF safetensors directories, Megatron checkpoints in both formats this tool writes (torch_dist, also in
    the Megatron-Bridge layout, and the legacy per-rank torch files, at any TP/PP/VPP/EP) and the DTensor
    trainer's checkpoints (through their HF copy of the policy).
    """
    _check(lambda: validate.existing_dir(path, "checkpoint"))

    def action() -> None:
        from hf_mcore_bridge.convert.inspect import inspect_path
        from hf_mcore_bridge.grpo.backends.dtensor.checkpoint_dirs import inspection_of

        report = inspection_of(path) or inspect_path(path)
        if as_json:
            typer.echo(json.dumps(report.to_dict(), indent=2))
            return
        _print_inspection(report, tensors)

    _run(action)


def _print_inspection(report: Any, tensors: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"[bold]{report.path}[/bold]  ({report.format})")
    console.print(f"architecture: {report.architecture or 'unknown'}")
    if report.layout:
        console.print("layout: " + " ".join(f"{k}={v}" for k, v in report.layout.items()))
    console.print(f"dtypes: {', '.join(report.dtypes)}")
    console.print(f"parameters: {report.parameters:,}  ({report.total_bytes / 2**20:,.1f} MiB)")
    for note in report.notes:
        console.print(f"note: {note}")
    if tensors:
        table = Table("tensor", "shape", "dtype", "bytes")
        for row in report.tensors:
            table.add_row(row.name, str(tuple(row.shape)), row.dtype, f"{row.bytes:,}")
        console.print(table)


train_app = typer.Typer(
    help="Train policies on megatron-core.", no_args_is_help=True, context_settings=app.info.context_settings
)
app.add_typer(train_app, name="train")


GRPO_EXAMPLES = """Examples:

\b
  bridge train grpo --config examples/grpo_tiny.yaml policy.model_path=./tiny-llama
  bridge train grpo --config run.yaml grpo.max_num_steps=50 logger.log_dir=runs/a"""


@train_app.command("grpo", epilog=GRPO_EXAMPLES)
def train_grpo_command(
    config: Annotated[Path, typer.Option("--config", help="The run's YAML (see examples/).")],
    overrides: Annotated[list[str] | None, typer.Argument(help="Dotted overrides: grpo.max_num_steps=50 ...")] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Validate, print the first prompts as the engine will see them, exit.")
    ] = False,
) -> None:
    """GRPO on megatron-core with the embedded engine: `bridge train grpo --config run.yaml key=value ...`.

    Every key under `policy.megatron_cfg` is forwarded to megatron-core (TransformerConfig, OptimizerConfig, DDP
    config); unknown keys are errors naming the closest valid key. Metrics go to `logger.log_dir`. The whole
    config (values, paths, the tokenizer) is checked before the model is converted or any process starts.
    """
    _check(lambda: validate.existing_file(config, "--config"))

    def action() -> None:
        from hf_mcore_bridge.grpo.run.config import load_config

        # validated before the training stack (torch, megatron-core, transformers) is imported: a mistake in the
        # config is reported in a fraction of a second
        run_config = load_config(config, overrides or [])
        validate.grpo_paths(run_config.policy.model_path, run_config.policy.tokenizer)
        if dry_run:
            _print_preview(run_config)
            return
        from hf_mcore_bridge.grpo.run.trainer import train_grpo
        from hf_mcore_bridge.megatron.world import reports_here

        result = train_grpo(run_config)
        if not reports_here():  # a launcher's rank other than 0: rank 0 reports
            return
        rewards = result.series("reward_mean")
        last = sum(rewards[-5:]) / max(1, len(rewards[-5:]))
        typer.echo(f"{result.steps} steps; mean reward of the last 5: {last:.3f}; metrics in {result.log_dir}")

    _run(action)


def _print_preview(grpo_config: Any) -> None:
    from hf_mcore_bridge.grpo.run.preview import preview_run

    preview = preview_run(grpo_config)
    template = "on" if preview.chat_template else "off"
    typer.echo(
        f"config OK: {preview.num_train} training prompts, {preview.num_val} validation; chat template {template}"
    )
    stops = ", ".join(f"{i} {t!r}" for i, t in zip(preview.stop_token_ids, preview.stop_tokens, strict=True))
    typer.echo(f"stop tokens: {stops or 'none'}")
    for number, prompt in enumerate(preview.prompts, start=1):
        typer.echo(f"--- prompt {number}: {len(prompt.token_ids)} tokens, answer {prompt.answer!r}")
        typer.echo(prompt.text)


EXPORT_EXAMPLES = """Examples:

\b
  bridge export runs/grpo ./policy-hf
  bridge export runs/grpo ./policy-hf --step 100 --push-to-hub my-org/my-policy --private
  bridge export runs/grpo-lora ./policy-adapter --peft"""


@app.command(epilog=EXPORT_EXAMPLES)
def export(
    run_dir: Annotated[Path, typer.Argument(help="A GRPO run (or its checkpoint directory).")],
    destination: Annotated[Path, typer.Argument(help="Where the HF model goes: absent, empty, or see --overwrite.")],
    step: Annotated[int | None, typer.Option(help="Which saved step (default: the latest).")] = None,
    base_model: Annotated[str | None, typer.Option(help="The base model named in the model card.")] = None,
    push_to_hub: Annotated[str | None, typer.Option(help="Upload to this Hub repo (ORG/NAME).")] = None,
    private: Annotated[bool, typer.Option(help="Create the Hub repo private.")] = False,
    overwrite: Annotated[bool, typer.Option(help="Replace a destination written earlier by this tool.")] = False,
    overwrite_foreign: Annotated[
        bool,
        typer.Option(
            help="Replace any non-empty destination, even one this tool did not write (deletes its contents)."
        ),
    ] = False,
    peft: Annotated[
        bool,
        typer.Option(
            help="A LoRA run: write its adapters as a PEFT directory (default: the base model with them merged)."
        ),
    ] = False,
) -> None:
    """Export a trained policy as an HF model with a model card (config, reward curve); optionally to the Hub.

    The upload uses your usual Hugging Face credentials (HF_TOKEN or `huggingface-cli login`).
    """

    def checks() -> None:
        validate.existing_dir(run_dir, "run directory")
        validate.at_least("--step", step, 0)
        validate.writable_destination(destination)

    _check(checks)

    def action() -> None:
        from hf_mcore_bridge.grpo.run.export import export_run

        result = export_run(
            run_dir,
            destination,
            step=step,
            base_model=base_model,
            push_to_hub=push_to_hub,
            private=private,
            overwrite=overwrite,
            overwrite_foreign=overwrite_foreign,
            peft=peft,
        )
        typer.echo(f"wrote {result.destination}" + (f"; uploaded: {result.repo_url}" if result.repo_url else ""))

    _run(action, writes=True)


DEMO_EXAMPLES = """Examples:

\b
  bridge demo
  bridge demo /tmp/bridge-demo --tp 2 --pp 1"""


@app.command(epilog=DEMO_EXAMPLES)
def demo(
    workdir: Annotated[Path, typer.Argument(help="Where to put the demo checkpoints.")] = Path("demo"),
    tp: Annotated[int, typer.Option(help="Tensor-parallel size.")] = 2,
    pp: Annotated[int, typer.Option(help="Pipeline-parallel size.")] = 2,
    overwrite: Annotated[bool, typer.Option(help="Replace a directory written by an earlier demo.")] = False,
    overwrite_foreign: Annotated[
        bool,
        typer.Option(
            help="Replace any non-empty destination, even one this tool did not write (deletes its contents)."
        ),
    ] = False,
) -> None:
    """Build a tiny Llama-architecture checkpoint locally, convert it to TP x PP, verify it, export it back."""

    def checks() -> None:
        validate.at_least("--tp", tp, 1)
        validate.at_least("--pp", pp, 1)
        validate.writable_destination(workdir)

    _check(checks)

    def action() -> None:
        from hf_mcore_bridge.demo import run_demo

        for line in run_demo(workdir, tp=tp, pp=pp, overwrite=overwrite, overwrite_foreign=overwrite_foreign):
            typer.echo(line)

    _run(action, writes=True)


if __name__ == "__main__":
    sys.exit(app())
