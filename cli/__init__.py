"""Command-line interface: the `bridge` command (typer), a thin shell over the library."""
