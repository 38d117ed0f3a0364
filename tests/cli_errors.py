"""Running the `bridge` command in process, and what a refused input must look like: exit status 2, one line
starting `error: ` that names the problem, no traceback."""

from __future__ import annotations

from typer.testing import CliRunner

from hf_mcore_bridge.cli.main import app

runner = CliRunner()


def run(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def assert_one_line_error(result, *fragments: str) -> None:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    assert lines[0].startswith("error: ") and "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
