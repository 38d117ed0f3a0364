"""The `bridge` command: each sub-command is a thin shell over a library call."""

import typer

app = typer.Typer(help="Bridge HuggingFace checkpoints and Megatron-Core.", no_args_is_help=True)


@app.command()
def version() -> None:
    """Print the installed version."""
    from hf_mcore_bridge import __version__

    typer.echo(__version__)
